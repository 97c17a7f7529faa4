"""What the log tells an operator at the default level: one request id across the server's and
the engine's lines, the slot a request took and why, prompt tokens reused against read (equal
to the response's usage), a long prompt's progress without a line per chunk, refused requests
with their reason, and the start-up line."""
import logging
import re
import signal
import subprocess

import pytest
import requests
from live_server import start_live_server

from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.sampling import SamplingParams
from strata.server.app import ServerConfig

N_CTX_TOKENS = 512
READ_CHUNK_TOKENS = 16


@pytest.fixture(scope="module")
def logged(model_path):
    engine = Engine(EngineConfig(model_path, n_ctx=N_CTX_TOKENS, threads=2,
                                 prompt_chunk_tokens=READ_CHUNK_TOKENS))
    server = start_live_server(engine, ServerConfig(model_id="tiny-server"))
    yield server
    server.stop()


def chat(live, messages, max_tokens=4):
    response = requests.post(live.url + "/v1/chat/completions", timeout=60, json={
        "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


def request_ids(caplog, pattern: str) -> dict[str, re.Match]:
    """The INFO lines matching `pattern` (its first group: the request id), by request id."""
    found = {}
    for record in caplog.records:
        match = re.search(pattern, record.getMessage())
        if match and record.levelno == logging.INFO:
            found[match.group(1)] = match
    return found


def test_a_second_turn_names_one_request_and_its_reused_tokens(logged, caplog):
    caplog.set_level(logging.INFO, logger="strata")
    messages = [{"role": "system", "content": "You help. " * 10},
                {"role": "user", "content": "first question"}]
    first = chat(logged, messages)
    messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "second question"}]
    caplog.clear()
    usage = chat(logged, messages)["usage"]
    num_reused = usage["prompt_tokens_details"]["cached_tokens"]
    assert num_reused > 0
    placed = request_ids(caplog, r"request (\S+): slot (\d+) .*\((\d+) tokens reused\)")
    read = request_ids(caplog, r"request (\S+): prompt (\d+) tokens = (\d+) reused \+ (\d+) read")
    ended = request_ids(caplog, r"request (\S+): prompt (\d+) tokens \((\d+) reused\), "
                                r"generated (\d+).*finish (\w+)")
    # the engine's lines and the server's name the request alike
    [request_id] = ended
    assert set(placed) == set(read) == {request_id}
    assert int(placed[request_id].group(3)) == num_reused
    assert [int(n) for n in read[request_id].groups()[1:]] == [
        usage["prompt_tokens"], num_reused, usage["prompt_tokens"] - num_reused]
    assert [int(n) for n in ended[request_id].groups()[1:4]] == [
        usage["prompt_tokens"], num_reused, usage["completion_tokens"]]
    assert ended[request_id].group(5) == "length"


def test_a_long_prompt_shows_its_progress_a_quarter_at_a_time(logged, caplog):
    caplog.set_level(logging.DEBUG, logger="strata")
    usage = chat(logged, [{"role": "user", "content": "many words " * 60}])["usage"]
    num_read = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
    num_chunks = -(-num_read // READ_CHUNK_TOKENS)
    assert num_chunks >= 8
    progress = [r for r in caplog.records if "reading the prompt" in r.getMessage()]
    assert len(progress) == num_chunks - 1  # each chunk but the last, at one level or another
    shown = [r.getMessage() for r in progress if r.levelno == logging.INFO]
    assert 1 <= len(shown) <= 3
    for quarter, message in enumerate(shown, 1):
        done, total = map(int, re.search(r"(\d+) of (\d+) tokens", message).groups())
        assert total == num_read and done * 4 >= quarter * total


def test_a_refused_request_is_logged_with_its_reason(logged, caplog):
    caplog.set_level(logging.INFO, logger="strata")
    response = requests.post(logged.url + "/v1/chat/completions", timeout=10, json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": -3})
    assert response.status_code == 400
    [line] = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert "/v1/chat/completions" in line and "400" in line and "'max_tokens' is -3" in line


def test_a_slot_taken_from_another_conversation_says_what_it_held(model_path, caplog):
    engine = Engine(EngineConfig(model_path, n_ctx=N_CTX_TOKENS, threads=2, parallel=1))
    try:
        params = SamplingParams(max_tokens=2, temperature=0)
        engine.generate_text([5, 6, 7, 8], params)
        caplog.set_level(logging.INFO, logger="strata")
        engine.generate_text([9, 10, 11], params)
        messages = [r.getMessage() for r in caplog.records]
        [parked] = [re.search(r"slot 0: parked (\d+) tokens", m) for m in messages
                    if "parked" in m]
        [placed] = [re.search(r"slot 0 rebuilt: no cached prefix; its (\d+) earlier", m)
                    for m in messages if ": slot 0 " in m]
        assert int(parked.group(1)) == int(placed.group(1)) == 5  # 4 prompt + 1 decoded in KV
    finally:
        engine.close()


def test_the_startup_line_says_what_runs_where(model_path, caplog):
    caplog.set_level(logging.INFO, logger="strata")
    engine = Engine(EngineConfig(model_path, n_ctx=N_CTX_TOKENS, threads=2, parallel=2))
    try:
        [line] = [r.getMessage() for r in caplog.records
                  if r.getMessage().startswith(f"model {model_path.name}:")]
        spec = engine.spec
        kv_mib = sum(kv.nbytes for kv in engine.scheduler.kvs) / 2**20
        for part in (spec.arch, f"{spec.n_layers} layers", f"{spec.n_experts} experts",
                     "cpu, 2 threads", f"2 slots x {N_CTX_TOKENS} tokens", f"{kv_mib:.1f} MiB"):
            assert part in line
    finally:
        engine.close()


def serve_one(model_path, folder, run: int, prompt: list[int], *options: str):
    """`strata serve` on `folder`'s conversation files: one completion of `prompt`, then
    SIGTERM; (its usage, the log it wrote)."""
    from live_server import wait_until_healthy
    from test_serve_signals import SERVE, free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = folder / f"serve-{run}.log"  # a file, not a pipe: a full pipe blocks the server
    with open(log_path, "w") as log_file:
        server = subprocess.Popen([*SERVE, "-m", str(model_path), "--port", str(port), "-t", "2",
                                   "-c", str(N_CTX_TOKENS), "--read-chunk",
                                   str(READ_CHUNK_TOKENS), "--conversation-cache-dir",
                                   str(folder / "conversations"), *options], stderr=log_file)
    try:
        wait_until_healthy(server, url)
        response = requests.post(url + "/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 3, "temperature": 0})
        assert response.status_code == 200
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0
        return response.json()["usage"], log_path.read_text()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_verbose_serve_logs_each_chunk_and_a_restart_its_conversation_file(model_path,
                                                                           tmp_path):
    prompt = list(range(10, 110))
    usage, log_text = serve_one(model_path, tmp_path, 1, prompt, "-v")
    chunks = re.findall(r"strata\.engine (\w+) request \S+: reading the prompt: (\d+) of 100",
                        log_text)
    assert [int(n) for _, n in chunks] == list(range(16, 100, 16))  # every chunk but the last
    assert {level for level, _ in chunks} == {"INFO", "DEBUG"}
    # at the stop: the conversation's cells went to a file (all but the last token, not read)
    [written] = re.findall(r"conversation files: wrote (\d+) tokens", log_text)
    assert int(written) == usage["prompt_tokens"] + usage["completion_tokens"] - 1
    # the next server reads it back for the same prompt: all of it there, all but one reused
    usage, log_text = serve_one(model_path, tmp_path, 2, prompt)
    assert "DEBUG" not in log_text
    num_reused = usage["prompt_tokens_details"]["cached_tokens"]
    assert num_reused == len(prompt) - 1
    [there] = re.findall(r"request (\S+) waits for its conversation file \((\d+) of its (\d+) "
                         r"prompt tokens", log_text)
    assert (int(there[1]), int(there[2])) == (len(prompt), len(prompt))
    [placed] = re.findall(r"request (\S+): slot 0 restored .*\((\d+) tokens reused\)",
                          log_text)
    assert placed == (there[0], str(num_reused))
