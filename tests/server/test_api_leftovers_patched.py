"""Go with the out-of-area patch (worker.py; sampling.py, generate.py, prompting.py): Anthropic's
message_start split for answers of many tokens, and post_sampling_probs of sampled answers."""
import math

from test_api_leftovers_anthropic import split, stream_events
from test_api_leftovers_llama import PROMPT, post


def test_message_start_split_of_a_longer_answer(live):
    stream_events(live, max_tokens=4)
    events = [e for e in stream_events(live, max_tokens=6) if e[0] != "ping"]
    start, final = events[0][1]["message"]["usage"], events[-2][1]["usage"]
    assert split(final)[1] > 0 and split(start) == split(final)


def test_post_sampling_probs_of_a_sampled_answer(live):
    body = dict(prompt=PROMPT, n_predict=6, n_probs=3, temperature=1.0, top_k=3, top_p=1.0,
                min_p=0.0, seed=5, return_tokens=True)
    raw = post(live, "/completion", **body)
    chain = post(live, "/completion", post_sampling_probs=True, **body)
    assert raw["tokens"] == chain["tokens"]  # the figures asked for change no draw
    for r, c in zip(raw["completion_probabilities"], chain["completion_probabilities"],
                    strict=True):
        total = sum(math.exp(t["logprob"]) for t in r["top_logprobs"])
        expected = {t["id"]: math.exp(t["logprob"]) / total for t in r["top_logprobs"]}
        assert [t["id"] for t in c["top_probs"]] == [t["id"] for t in r["top_logprobs"]]
        for t in c["top_probs"]:
            assert math.isclose(t["prob"], expected[t["id"]], rel_tol=1e-4)
        assert math.isclose(c["prob"], expected[c["id"]], rel_tol=1e-4)


def test_min_p_cut_leaves_fewer_than_n_probs(live):
    body = dict(prompt=PROMPT, n_predict=4, n_probs=20, temperature=0.5, top_k=0,
                top_p=1.0, min_p=0.5, seed=1, post_sampling_probs=True)
    for entry in post(live, "/completion", **body)["completion_probabilities"]:
        probs = [t["prob"] for t in entry["top_probs"]]
        assert 1 <= len(probs) < 20 and math.isclose(sum(probs), 1.0, rel_tol=1e-6)
        assert min(probs) >= 0.5 * max(probs) - 1e-12
