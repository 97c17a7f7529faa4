"""The server's stop path while requests run: a stream still read gets an error event and
[DONE], a whole answer a 503 (never a 200 that passes the cut answer off as finished), and a
request (or slot action) that comes after the stop a 503 at once, not a wait for an engine
that is gone; and a stop waits for the window it came in to end, so the conversations are
still written."""
import json
import threading
import time

import pytest
import requests

from live_server import metric_value, start_live_server
from strata import hookimpl
from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.plugins import get_plugin_manager
from strata.server.app import ServerConfig


@pytest.fixture
def server(model_path, tmp_path):
    engine = Engine(EngineConfig(model_path, n_ctx=4096, threads=2, parallel=2))
    live = start_live_server(engine, ServerConfig(model_id="tiny-server", keepalive_s=0.02,
                                                  slot_save_path=tmp_path))
    yield live
    live.stop()


def long_request(stream: bool) -> dict:
    return dict(prompt=[11, 12, 13], max_tokens=4000, temperature=0, ignore_eos=True,
                stream=stream)


def test_requests_running_at_the_stop_end_with_a_shutting_down_error(server):
    whole = {}

    def ask_whole():
        whole["response"] = requests.post(server.url + "/v1/completions",
                                          json=long_request(False), timeout=60)

    thread = threading.Thread(target=ask_whole)
    thread.start()
    stream = requests.post(server.url + "/v1/completions", json=long_request(True),
                           stream=True, timeout=60)
    lines = stream.iter_lines()
    first = next(line for line in lines if line.startswith(b"data: {"))
    assert json.loads(first[len("data: "):])["choices"][0]["finish_reason"] is None
    deadline = time.monotonic() + 30
    while metric_value(server, "strata_requests_running") != 2:
        assert time.monotonic() < deadline, "the whole-answer request never started"
        time.sleep(0.01)
    server.state.close()  # the stop path: the engine stops while both generate
    frames = [first] + [line for line in lines if line.startswith(b"data: ")]
    assert frames[-1] == b"data: [DONE]"
    error = json.loads(frames[-2][len("data: "):])["error"]
    assert error["code"] == "shutting_down", error
    assert not any(b'"finish_reason": "length"' in f for f in frames)
    thread.join(60)
    response = whole["response"]
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "shutting_down"
    # the cut answers' tokens were read and generated all the same: the counters have them
    assert metric_value(server, "strata_prompt_tokens_total") == 6
    num_streamed = sum(b'"text"' in frame for frame in frames)
    assert metric_value(server, "strata_generated_tokens_total") >= num_streamed > 0
    # both are counted as the 503 they ended with, the stream too (its status line said 200)
    stream.close()
    deadline = time.monotonic() + 30
    while True:
        try:
            counted = metric_value(server, "strata_requests_total", endpoint="/v1/completions",
                                   status="503")
        except KeyError:
            counted = 0
        if counted == 2:
            break
        assert time.monotonic() < deadline, f"counted {counted} of 2 as 503"
        time.sleep(0.02)
    with pytest.raises(KeyError):
        metric_value(server, "strata_requests_total", endpoint="/v1/completions",
                     status="200")


def test_a_request_after_the_stop_is_refused_at_once(server):
    server.state.close()
    for stream in (False, True):
        # (the timeout only keeps a failing run from hanging: the answer comes at once)
        response = requests.post(server.url + "/v1/completions", timeout=60,
                                 json=long_request(stream))
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "shutting_down"
    response = requests.post(server.url + "/slots/0?action=erase", timeout=60)
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "shutting_down"
    health = requests.get(server.url + "/health", timeout=60)
    assert (health.status_code, health.json()) == (503, {"status": "shutting_down"})


class WindowGate:
    """An observer that, once armed, holds the engine thread at the end of a window until the
    gate opens: a window that outlasts the stop's timeout."""

    def __init__(self):
        self.armed, self.reached, self.gate = (threading.Event(), threading.Event(),
                                               threading.Event())

    @hookimpl
    def strata_window_done(self, stats):
        if self.armed.is_set():
            self.reached.set()
            self.gate.wait()


def test_a_stop_during_a_long_window_still_writes_the_conversations(model_path, tmp_path):
    """The window running when the stop comes ends (it cannot be cut), then the engine closes
    and writes every conversation to --conversation-cache-dir, however long the window took:
    the stop's timeout only bounds a wait for a model still loading."""
    plugins = get_plugin_manager(autoload=False)
    window = WindowGate()
    plugins.register(window)
    folder = tmp_path / "conversations"
    engine = Engine(EngineConfig(model_path, n_ctx=4096, threads=2,
                                 conversation_cache_dir=folder), plugin_manager=plugins)
    live = start_live_server(engine, ServerConfig(model_id="tiny-server", keepalive_s=0.02))
    worker = live.state.worker
    thread = worker._thread
    real_join = thread.join

    def join(timeout=None):
        if timeout is None:  # the stop waits for the window without a bound: it may end now
            window.gate.set()
        return real_join(timeout)

    window.armed.set()  # the request's first window holds the engine thread
    asking = threading.Thread(target=requests.post, args=(live.url + "/v1/completions",),
                              kwargs=dict(json=long_request(False), timeout=60))
    try:
        asking.start()
        assert window.reached.wait(60)
        thread.join = join
        worker.stop(timeout_s=0)  # (a window longer than the timeout)
        assert not thread.is_alive(), "the stop returned while the engine still ran"
        assert list(folder.glob("*.strata-kv")), "the conversation was not written"
    finally:
        window.gate.set()
        asking.join(60)
        live.stop()
