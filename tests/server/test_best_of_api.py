"""`best_of` on /v1/completions and /v1/chat/completions: best_of seeded candidates (candidate i
draws with seed + i, as `n` choices do), of which the `n` with the highest mean log probability
per generated token are returned, best first. Each reference ranking is computed here from the
same request sent with `n = best_of` and logprobs, so a wrong ranking fails."""
import json
import logging
import math
import socket
import time

import pytest
import requests

from strata.engine.logprobs import TokenLogprob
from strata.server.best_of import CandidateScore, best_candidates, candidate_options
from strata.server.schema import GenerationOptions
from live_server import metric_value

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Name three colours."}]
PROMPT = "Colours: red,"
SAMPLED = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
# A stop string cuts the candidates to different lengths, so the mean per token ranks them
# otherwise than their sum would (checked below: each case tells the two apart).
COMPLETION_BODY = {"prompt": PROMPT, "max_tokens": 12, "stop": ["e"], "seed": 2, **SAMPLED}
CHAT_BODY = {"messages": MESSAGES, "max_tokens": 10, "stop": ["e"], "seed": 0, **SAMPLED}


def post(live, path, body):
    response = requests.post(live.url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def ranking(values_per_candidate: list[list[float]]) -> list[int]:
    """Candidate indexes by mean log probability per token, highest first (ties: lower
    index), and checks that the sum would rank them otherwise."""
    means = [sum(v) / len(v) for v in values_per_candidate]
    by_mean = sorted(range(len(means)), key=lambda i: (-means[i], i))
    by_sum = sorted(range(len(means)), key=lambda i: (-sum(values_per_candidate[i]), i))
    assert by_mean[:2] != by_sum[:2], "this case cannot tell the mean from the sum"
    assert by_mean[:2] != [0, 1], "this case cannot tell a ranking from candidate order"
    return by_mean


def completion_candidates(live, body, best_of):
    """The reference: the candidates as `n` choices with their token_logprobs, and their
    ranking."""
    reply = post(live, COMPLETIONS, dict(body, n=best_of, logprobs=1))
    return reply, ranking([c["logprobs"]["token_logprobs"] for c in reply["choices"]])


def test_completions_return_the_best_mean_logprob_candidates(live):
    candidates, ranked = completion_candidates(live, COMPLETION_BODY, 5)
    reply = post(live, COMPLETIONS, dict(COMPLETION_BODY, n=2, best_of=5))
    want = [candidates["choices"][i] for i in ranked[:2]]
    assert [c["text"] for c in reply["choices"]] == [c["text"] for c in want]
    assert [c["finish_reason"] for c in reply["choices"]] == [c["finish_reason"] for c in want]
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in reply["choices"])  # none asked, none sent
    # every candidate's tokens were computed; the prompt counts once
    assert reply["usage"]["completion_tokens"] == candidates["usage"]["completion_tokens"]
    assert reply["usage"]["prompt_tokens"] == candidates["usage"]["prompt_tokens"]
    assert reply["usage"]["total_tokens"] == candidates["usage"]["total_tokens"]


def test_completions_carry_the_logprobs_asked_for(live):
    candidates, ranked = completion_candidates(live, COMPLETION_BODY, 5)
    reply = post(live, COMPLETIONS, dict(COMPLETION_BODY, n=3, best_of=5, logprobs=1))
    assert [c["logprobs"] for c in reply["choices"]] == \
        [candidates["choices"][i]["logprobs"] for i in ranked[:3]]
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]


def test_completions_echo_each_returned_choice(live):
    candidates, ranked = completion_candidates(live, COMPLETION_BODY, 5)
    reply = post(live, COMPLETIONS, dict(COMPLETION_BODY, n=2, best_of=5, echo=True))
    assert [c["text"] for c in reply["choices"]] == \
        [PROMPT + candidates["choices"][i]["text"] for i in ranked[:2]]
    # with logprobs the echo's lists lead with the prompt's tokens (its first without a figure)
    scored = post(live, COMPLETIONS, dict(COMPLETION_BODY, n=1, best_of=5, echo=True,
                                          logprobs=1))
    lists = scored["choices"][0]["logprobs"]
    num_prompt = scored["usage"]["prompt_tokens"]
    assert lists["token_logprobs"][0] is None
    best = candidates["choices"][ranked[0]]["logprobs"]
    assert lists["token_logprobs"][num_prompt:] == best["token_logprobs"]
    assert scored["choices"][0]["text"] == PROMPT + candidates["choices"][ranked[0]]["text"]


def test_chat_returns_the_best_mean_logprob_candidates(live):
    candidates = post(live, CHAT, dict(CHAT_BODY, n=4, logprobs=True))
    ranked = ranking([[e["logprob"] for e in c["logprobs"]["content"]]
                      for c in candidates["choices"]])
    reply = post(live, CHAT, dict(CHAT_BODY, n=2, best_of=4))
    want = [candidates["choices"][i] for i in ranked[:2]]
    assert [c["message"] for c in reply["choices"]] == [c["message"] for c in want]
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in reply["choices"])
    assert reply["usage"]["completion_tokens"] == candidates["usage"]["completion_tokens"]
    asked = post(live, CHAT, dict(CHAT_BODY, n=1, best_of=4, logprobs=True, top_logprobs=2))
    best = candidates["choices"][ranked[0]]["logprobs"]["content"]
    got = asked["choices"][0]["logprobs"]["content"]
    assert [e["logprob"] for e in got] == [e["logprob"] for e in best]
    assert all(len(e["top_logprobs"]) == 2 for e in got)


def test_best_of_equal_to_n_is_n(live):
    plain = post(live, COMPLETIONS, dict(COMPLETION_BODY, n=3))
    same = post(live, COMPLETIONS, dict(COMPLETION_BODY, n=3, best_of=3))
    assert [c["text"] for c in same["choices"]] == [c["text"] for c in plain["choices"]]
    assert same["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("path,body", [(COMPLETIONS, COMPLETION_BODY), (CHAT, CHAT_BODY)])
def test_a_stream_takes_best_of_only_equal_to_n(live, path, body):
    response = requests.post(live.url + path, timeout=60,
                             json=dict(body, n=1, best_of=3, stream=True))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "best_of"
    assert "'best_of' is 3" in error["message"] and "stream" in error["message"]
    response = requests.post(live.url + path, timeout=60,
                             json=dict(body, n=2, best_of=2, stream=True))
    assert response.status_code == 200, response.text
    indexes = {json.loads(line[len("data: "):])["choices"][0]["index"]
               for line in response.iter_lines(decode_unicode=True)
               if line.startswith("data: {")}
    assert indexes == {0, 1}


@pytest.mark.parametrize("path,body", [
    (COMPLETIONS, {"prompt": "x", "n": 3, "best_of": 2}),
    (CHAT, {"messages": MESSAGES, "n": 4, "best_of": 1}),
])
def test_best_of_below_n(live, path, body):
    response = requests.post(live.url + path, json=body, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "best_of"
    assert f"below 'n' ({body['n']})" in error["message"]
    assert f"[{body['n']}, 16]" in error["message"]


def test_endpoints_of_one_answer_refuse_best_of(live):
    for path, body in (("/v1/responses", {"input": "hi"}), ("/completion", {"prompt": "hi"})):
        response = requests.post(live.url + path, json=dict(body, best_of=2), timeout=60)
        assert response.status_code == 400, response.text
        assert "'best_of' is 2" in response.json()["error"]["message"]


def test_disconnect_cancels_every_candidate(live_long, caplog):
    """One slot: one candidate runs, the others wait; a client that goes away stops it and
    none of the others starts."""
    live = live_long
    caplog.set_level(logging.INFO, logger="strata.server")
    body = json.dumps({"prompt": "A long story:", "max_tokens": 4000, "ignore_eos": True,
                       "n": 1, "best_of": 3})
    generated_before = metric_value(live, "strata_generated_tokens_total")
    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
                      "Content-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
        deadline = time.monotonic() + 20
        while metric_value(live, "strata_requests_running") < 1:
            assert time.monotonic() < deadline, "the generation did not start"
            time.sleep(0.01)
    deadline = time.monotonic() + 20
    while caplog.text.count("(cancelled: client went away)") < 3:
        assert time.monotonic() < deadline, "not every candidate was cancelled"
        time.sleep(0.05)
    assert metric_value(live, "strata_requests_running") == 0
    generated = metric_value(live, "strata_generated_tokens_total") - generated_before
    time.sleep(0.3)  # nothing starts after: no candidate was left queued
    assert metric_value(live, "strata_requests_running") == 0
    assert metric_value(live, "strata_generated_tokens_total") - generated_before == generated
    assert generated < 4000


# ---- the ranking alone ----------------------------------------------------------------------
class _Event:
    def __init__(self, logprob):
        self.logprob = None if logprob is None else TokenLogprob(0, logprob)


def make_score(*logprobs) -> CandidateScore:
    score = CandidateScore()
    for value in logprobs:
        score.add(_Event(value))
    return score


def test_rank_by_mean_not_sum():
    scores = [make_score(-1.0, -1.0, -1.0), make_score(-2.5), make_score(-0.5, -0.7)]
    assert [s.mean_logprob for s in scores] == [-1.0, -2.5, pytest.approx(-0.6)]
    assert best_candidates(scores, 3) == [2, 0, 1]
    assert best_candidates(scores, 1) == [2]


def test_ties_go_to_the_lower_index():
    scores = [make_score(-2.0), make_score(-1.0, -1.0), make_score(-1.0), make_score(-3.0)]
    assert best_candidates(scores, 4) == [1, 2, 0, 3]


def test_the_stop_token_is_not_counted():
    assert make_score(-1.0, None).mean_logprob == -1.0  # a stop token's event has no figure


def test_an_empty_candidate_ranks_last_unless_all_are():
    scores = [make_score(), make_score(-9.0), make_score(-0.1)]
    assert scores[0].mean_logprob == -math.inf
    assert best_candidates(scores, 3) == [2, 1, 0]
    assert best_candidates([make_score(), make_score(), make_score()], 2) == [0, 1]


def test_candidates_compute_the_chosen_tokens_figure_only_when_ranked():
    assert candidate_options(GenerationOptions(), is_ranked=True).logprobs == 0
    assert candidate_options(GenerationOptions(), is_ranked=False).logprobs is None
    asked = GenerationOptions(logprobs=3)
    assert candidate_options(asked, is_ranked=True) is asked
