"""The server with several slots: concurrent requests equal solo runs, a request waits when every
slot is busy (and /metrics shows it), and a follow-up reports the cached prefix it reused."""
import threading
import time

import pytest
import requests

from conftest import start_live_server
from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.generate import collect
from strata.engine.sampling import SamplingParams
from strata.server.app import ServerConfig

N_CTX_TOKENS = 4096


@pytest.fixture(scope="module")
def live_two_slots(model_path):
    engine = Engine(EngineConfig(model_path, n_ctx=N_CTX_TOKENS, threads=2, parallel=2,
                                 prompt_chunk_tokens=64))
    server = start_live_server(engine, ServerConfig(model_id="tiny-server", keepalive_s=0.05))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def solo_engine(model_path):
    with Engine(EngineConfig(model_path, n_ctx=N_CTX_TOKENS, threads=2)) as engine:
        yield engine


def solo(engine, prompt, max_tokens):
    engine.reset()
    return collect(engine.generate(prompt, SamplingParams(max_tokens=max_tokens,
                                                          temperature=0.0, ignore_eos=True)))


def complete(url, prompt, max_tokens, **extra):
    response = requests.post(url + "/v1/completions", timeout=120, json=dict(
        prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True, **extra))
    assert response.status_code == 200, response.text
    return response.json()


def complete_at_once(url, prompts, max_tokens) -> list:
    """Send every prompt from its own thread at once; the answers in prompt order."""
    answers = [None] * len(prompts)

    def send(i):
        answers[i] = complete(url, prompts[i], max_tokens)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return answers


def metric_value(live, name):
    for line in requests.get(live.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def test_concurrent_requests_equal_solo_runs(live_two_slots, solo_engine):
    prompts = [[(i * k) % 3000 + 10 for i in range(n)] for k, n in ((3, 200), (7, 30),
                                                                    (11, 150))]
    answers = complete_at_once(live_two_slots.url, prompts, 12)
    for prompt, answer in zip(prompts, answers):
        assert answer["choices"][0]["text"] == solo(solo_engine, prompt, 12).text
        assert answer["usage"]["completion_tokens"] == 12
    for gauge in ("strata_requests_running", "strata_requests_queued",
                  "strata_requests_reading"):
        assert metric_value(live_two_slots, gauge) == 0


def test_a_server_with_drafts_answers_as_one_without(model_path, solo_engine):
    """--spec-type ngram-simple: concurrent greedy requests get the tokens of solo runs
    without drafts; /metrics counts the drafts."""
    engine = Engine(EngineConfig(model_path, n_ctx=N_CTX_TOKENS, threads=2, parallel=2,
                                 spec_type="ngram-simple", spec_ngram_size_n=2))
    server = start_live_server(engine, ServerConfig(model_id="tiny-server"))
    try:
        prompts = [[7, 7, 7, 7], [(i * 5) % 3000 + 10 for i in range(40)]]
        answers = complete_at_once(server.url, prompts, 150)
        for prompt, answer in zip(prompts, answers):
            assert answer["choices"][0]["text"] == solo(solo_engine, prompt, 150).text
        drafted = metric_value(server, "strata_draft_tokens_total")
        assert drafted > 0
        assert 0 <= metric_value(server, "strata_draft_tokens_accepted_total") <= drafted
    finally:
        server.stop()


def test_follow_up_reports_the_reused_prefix(live_two_slots, solo_engine):
    prompt = [(i * 13 + 5) % 3000 + 10 for i in range(300)]
    first = complete(live_two_slots.url, prompt, 4)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    first_token = solo(solo_engine, prompt, 4).token_ids[0]
    follow_up = prompt + [first_token + 1]  # diverges right after the prompt
    second = complete(live_two_slots.url, follow_up, 4)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt)
    assert second["choices"][0]["text"] == solo(solo_engine, follow_up, 4).text


def test_a_request_waits_while_both_slots_are_busy(live_two_slots):
    """Three long streams on two slots: /metrics shows two running and one queued; closing the
    streams cancels them all."""
    responses = []
    try:
        for k in range(3):
            responses.append(requests.post(live_two_slots.url + "/v1/completions", json=dict(
                prompt=[(i * (k + 2)) % 3000 + 10 for i in range(20)], max_tokens=3500,
                temperature=0, ignore_eos=True, stream=True), stream=True, timeout=60))
        deadline = time.monotonic() + 20
        while (metric_value(live_two_slots, "strata_requests_running"),
               metric_value(live_two_slots, "strata_requests_queued")) != (2, 1):
            assert time.monotonic() < deadline, "never saw two running and one queued"
            time.sleep(0.01)
    finally:
        for response in responses:
            response.close()
    deadline = time.monotonic() + 30
    while (metric_value(live_two_slots, "strata_requests_running"),
           metric_value(live_two_slots, "strata_requests_queued")) != (0, 0):
        assert time.monotonic() < deadline, "the cancelled streams kept running"
        time.sleep(0.05)


def test_cli_slot_options(model_path):
    from click.testing import CliRunner

    from strata.cli import main

    runner = CliRunner()
    args = ["run", "--raw", "-m", str(model_path), "-n", "6", "--temp", "0", "-c", "256",
            "The slots read this prompt"]
    plain = runner.invoke(main, args)
    assert plain.exit_code == 0, plain.output
    slotted = runner.invoke(main, args + ["--parallel", "2", "--read-chunk", "3",
                                          "--conversation-cache-mib", "0"])
    assert slotted.exit_code == 0, slotted.output
    assert slotted.stdout == plain.stdout
    for command in (["run", "x"], ["serve"]):
        bad = runner.invoke(main, command + ["--parallel", "9", "-m", str(model_path)])
        assert bad.exit_code == 2
        assert "'--parallel'" in bad.output and "9 is not in the range 1<=x<=8" in bad.output
