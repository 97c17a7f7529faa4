"""llama.cpp's GET /props and GET /slots on a live server of two slots: the engine's own
settings, each slot's request while the engine thread is held between windows, and the tokens
an idle slot keeps; --no-slots answers 501 and a loading model 503."""
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from click.testing import CliRunner

import strata
from conftest import start_live_server
from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.sampling import SamplingParams
from strata.server.app import ServerConfig, create_app
from strata.server.command import serve

N_CTX_TOKENS = 512
NUM_SLOTS = 2


class StepGate:
    """Holds the engine thread before each window until the test lets one through, so the
    slots keep still while /slots is read."""

    def __init__(self, engine):
        self._step = engine.step
        self._permits = threading.Semaphore(0)
        self.is_open = False
        engine.step = self.step

    def step(self):
        if not self.is_open:
            self._permits.acquire()
        return self._step()

    def allow(self, num_windows: int) -> None:
        for _ in range(num_windows):
            self._permits.release()

    def open(self) -> None:
        self.is_open = True
        self.allow(NUM_SLOTS)  # a window already waiting


@pytest.fixture(scope="module")
def engine(model_path):
    return Engine(EngineConfig(model_path, n_ctx=N_CTX_TOKENS, threads=2, parallel=NUM_SLOTS))


@pytest.fixture(scope="module")
def live_slots(engine):
    server = start_live_server(engine, ServerConfig(model_id="tiny-slots"))
    yield server
    server.stop()


def get(live, path):
    return requests.get(live.url + path, timeout=30)


def slots(live):
    reply = get(live, "/slots")
    assert reply.status_code == 200, reply.text
    return reply.json()


def wait_for_slots(live, is_done, timeout_s=20.0):
    """/slots once `is_done(slots)` holds (the engine thread moves on its own time)."""
    deadline = time.monotonic() + timeout_s
    while True:
        current = slots(live)
        if is_done(current) or time.monotonic() > deadline:
            return current
        time.sleep(0.02)


def wait_for(is_done, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not is_done():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def queued_jobs(live) -> float:
    for line in get(live, "/metrics").text.splitlines():
        if line.startswith("strata_requests_queued "):
            return float(line.split()[1])
    raise KeyError("strata_requests_queued")


def complete(live, prompt, max_tokens, **extra):
    reply = requests.post(live.url + "/v1/completions", timeout=60, json=dict(
        prompt=prompt, max_tokens=max_tokens, ignore_eos=True, **extra))
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_props_are_the_engines_settings(live_slots, engine):
    props = get(live_slots, "/props").json()
    defaults = props["default_generation_settings"]
    assert defaults["n_ctx"] == engine.n_ctx == N_CTX_TOKENS
    assert defaults["is_processing"] is False
    plain = SamplingParams()
    params = defaults["params"]
    assert params["n_predict"] == params["max_tokens"] == -1  # the room the context leaves
    assert (params["temperature"], params["top_k"], params["top_p"], params["min_p"]) == (
        plain.temperature, plain.top_k, plain.top_p, plain.min_p)
    assert (params["repeat_penalty"], params["presence_penalty"],
            params["frequency_penalty"]) == (1.0, 0.0, 0.0)
    assert params["stop"] == [] and params["ignore_eos"] is False
    assert props["total_slots"] == NUM_SLOTS
    assert props["model_path"] == str(engine.config.model_path)
    assert props["model_alias"] == "tiny-slots"
    assert props["chat_template"] == engine.chat_template.source
    tokenizer = engine.tokenizer
    assert props["eos_token"] == tokenizer.token_text(tokenizer.eos_id)
    assert props["bos_token"] == ("" if tokenizer.bos_id is None else
                                  tokenizer.token_text(tokenizer.bos_id))
    assert props["modalities"] == {"vision": False, "audio": False}
    assert props["build_info"] == f"strata {strata.__version__}"
    assert props["endpoint_slots"] is True


def test_idle_slots(live_slots, engine):
    current = slots(live_slots)
    assert [s["id"] for s in current] == list(range(NUM_SLOTS))
    for slot in current:
        assert slot["n_ctx"] == engine.n_ctx
        assert (slot["is_processing"], slot["id_task"], slot["speculative"]) == (False, -1, False)
        assert "params" not in slot and "next_token" not in slot
    assert get(live_slots, "/slots?fail_on_no_slot=1").status_code == 200


def test_busy_slots_show_their_requests(live_slots, engine):
    prompts = [[(7 * i) % 900 + 10 for i in range(40)], [(11 * i) % 900 + 10 for i in range(25)]]
    max_tokens = 9
    gate = StepGate(engine)
    pool = ThreadPoolExecutor(NUM_SLOTS)
    try:
        first = pool.submit(complete, live_slots, prompts[0], max_tokens, temperature=0.5,
                            top_k=7, seed=11, stop=["zz"], logprobs=3)
        # placed on submit, before any window: its prompt not read yet
        busy = wait_for_slots(live_slots, lambda s: s[0]["is_processing"])
        assert busy[0]["n_prompt_tokens"] == len(prompts[0])
        assert busy[0]["n_prompt_tokens_processed"] == 0
        # an array of one object, as llama.cpp's /slots (its clients read next_token[0])
        assert busy[0]["next_token"] == [{"has_next_token": True, "n_remain": max_tokens,
                                          "n_decoded": 0}]
        assert get(live_slots, "/slots?fail_on_no_slot=1").status_code == 200  # one is free
        second = pool.submit(complete, live_slots, prompts[1], max_tokens)
        wait_for(lambda: queued_jobs(live_slots) == 1)
        # one window reads the first prompt (and gives its first token); the engine thread
        # places the second request after it, and both wait before the next window
        gate.allow(1)
        busy = wait_for_slots(live_slots, lambda s: all(x["is_processing"] for x in s))
        assert busy[0]["n_prompt_tokens_processed"] == len(prompts[0])
        assert busy[0]["n_kv_tokens"] == len(prompts[0])
        assert busy[0]["next_token"] == [{"has_next_token": True,
                                          "n_remain": max_tokens - 1, "n_decoded": 1}]
        params = busy[0]["params"]
        assert (params["temperature"], params["top_k"], params["seed"]) == (0.5, 7, 11)
        assert (params["stop"], params["ignore_eos"], params["n_predict"]) == (
            ["zz"], True, max_tokens)
        assert (params["n_probs"], busy[1]["params"]["n_probs"]) == (3, 0)
        assert busy[0]["id_task"] >= 1 and busy[1]["id_task"] == busy[0]["id_task"] + 1
        assert busy[1]["n_prompt_tokens"] == len(prompts[1])
        assert busy[1]["params"]["seed"] == 0xFFFFFFFF  # none given: a random one
        full = get(live_slots, "/slots?fail_on_no_slot=1")
        assert full.status_code == 503
        assert full.json()["error"]["type"] == "unavailable_error"
        assert get(live_slots, "/slots?fail_on_no_slot=0").status_code == 200
        gate.open()
        answers = [first.result(60), second.result(60)]
    finally:
        gate.open()
        pool.shutdown(wait=True)
    idle = wait_for_slots(live_slots, lambda s: not any(x["is_processing"] for x in s))
    for slot, answer in zip(idle, answers):
        assert (slot["is_processing"], slot["id_task"]) == (False, -1)
        usage = answer["usage"]
        assert usage["completion_tokens"] == max_tokens
        # the KV holds the prompt and every token read back: all but the last one generated
        assert slot["n_kv_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] - 1


def test_bad_and_odd_queries(live_slots):
    assert get(live_slots, "/slots?fail_on_no_slot=").status_code == 200
    reply = requests.post(live_slots.url + "/props", json={}, timeout=30)
    assert reply.status_code == 405
    reply = get(live_slots, "/nowhere")
    assert "/props, /slots" in reply.json()["error"]["message"]


def test_no_slots_answers_501(model_path):
    engine = Engine(EngineConfig(model_path, n_ctx=N_CTX_TOKENS, threads=2))
    live = start_live_server(engine, ServerConfig(is_slots_endpoint_on=False))
    try:
        reply = get(live, "/slots")
        assert reply.status_code == 501
        error = reply.json()["error"]
        assert error["type"] == "not_supported_error" and "--no-slots" in error["message"]
        props = get(live, "/props").json()
        assert props["endpoint_slots"] is False and props["total_slots"] == 1
    finally:
        live.stop()


def test_serve_has_the_slots_switch():
    help_text = CliRunner().invoke(serve, ["--help"]).output
    assert "--slots / --no-slots" in help_text


def test_loading_model_answers_503(model_path):
    release = threading.Event()

    def load():
        release.wait(30)
        return Engine(EngineConfig(model_path, n_ctx=N_CTX_TOKENS, threads=2))

    app = create_app(load, ServerConfig())
    try:
        client = app.test_client()
        for path in ("/props", "/slots"):
            reply = client.get(path)
            assert reply.status_code == 503, path
            assert reply.json["error"]["code"] == "model_loading"
        release.set()
        assert app.extensions["strata"].worker.wait_loaded(30)
        assert client.get("/props").json["total_slots"] == 1
        assert client.get("/slots").status_code == 200
    finally:
        release.set()
        app.extensions["strata"].close()
