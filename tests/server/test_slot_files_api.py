"""llama.cpp's slot actions (--slot-save-path): an idle slot's KV saved to a file, erased and
restored, after which the conversation's next turn reads only its new tokens and answers as a
fresh engine does; every bad request is a clear 4xx/501 and the server keeps serving."""
import threading
import time

import pytest
import requests

from conftest import N_CTX_TOKENS, start_live_server
from strata.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.kv_file import write_kv_file
from strata.engine.sampling import SamplingParams
from strata.server.app import ServerConfig
from test_slots_api import StepGate

PROMPT = [(13 * i) % 900 + 10 for i in range(70)]


@pytest.fixture(scope="module")
def engine(model_path):
    return Engine(EngineConfig(model_path, n_ctx=N_CTX_TOKENS, threads=2, parallel=2))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("slots")


@pytest.fixture(scope="module")
def live(engine, folder):
    server = start_live_server(engine, ServerConfig(model_id="tiny", slot_save_path=str(folder)))
    yield server
    server.stop()


def complete(live, prompt, max_tokens=6):
    reply = requests.post(live.url + "/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    return reply.json()


def action(live, slot, what, **body):
    return requests.post(f"{live.url}/slots/{slot}?action={what}", json=body, timeout=60)


def slot_tokens(live, slot):
    return requests.get(live.url + "/slots", timeout=30).json()[slot]["n_kv_tokens"]


def test_save_erase_restore_continues_the_conversation(live, engine, folder, model_path):
    first = complete(live, PROMPT)
    slot = next(s["id"] for s in requests.get(live.url + "/slots", timeout=30).json()
                if s["n_kv_tokens"])
    held = slot_tokens(live, slot)
    saved = action(live, slot, "save", filename="agent.bin")
    assert saved.status_code == 200, saved.text
    body = saved.json()
    assert (body["id_slot"], body["filename"], body["n_saved"]) == (slot, "agent.bin", held)
    assert body["n_written"] == (folder / "agent.bin").stat().st_size
    assert body["timings"]["save_ms"] > 0
    erased = action(live, slot, "erase").json()
    assert erased == {"id_slot": slot, "n_erased": held} and slot_tokens(live, slot) == 0
    restored = action(live, slot, "restore", filename="agent.bin")
    assert restored.status_code == 200, restored.text
    assert restored.json()["n_restored"] == held and restored.json()["n_read"] == \
        body["n_written"] and slot_tokens(live, slot) == held
    # the next turn: the prompt, the reply and more tokens, as token ids
    reply_ids = engine.tokenize(first["choices"][0]["text"], add_special=False)
    following = PROMPT + reply_ids + [11, 12, 13]
    second = complete(live, following)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(PROMPT)
    with Engine(EngineConfig(model_path, n_ctx=N_CTX_TOKENS, threads=2)) as fresh:
        want = fresh.generate_text(following, SamplingParams(
            temperature=0.0, max_tokens=6, ignore_eos=True)).text
    assert second["choices"][0]["text"] == want


def test_restoring_over_a_slots_conversation_parks_it(live, engine):
    complete(live, PROMPT[:40])
    slot = engine.scheduler.last_slot_index
    action(live, slot, "save", filename="short.bin")
    other = [(7 * i) % 900 + 10 for i in range(50)]
    complete(live, other)
    slot = engine.scheduler.last_slot_index
    assert action(live, slot, "restore", filename="short.bin").status_code == 200
    # the conversation that slot held comes back from the parked ones
    again = complete(live, other + [5])
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(other)


@pytest.mark.parametrize("slot, what, body, status, words", [
    (0, "fly", {"filename": "a.bin"}, 400, "Unknown slot action"),
    (0, "save", {}, 400, "filename"),
    (0, "save", {"filename": "../a.bin"}, 400, "plain file name"),
    (0, "save", {"filename": "a/b"}, 400, "plain file name"),
    (0, "save", {"filename": ".."}, 400, "plain file name"),
    (0, "save", {"filename": 7}, 400, "non-empty string"),
    (0, "save", {"filename": "x" * 300}, 400, "longer than"),
    (0, "restore", {"filename": "none.bin"}, 400, "no slot file"),
    (9, "save", {"filename": "a.bin"}, 400, "no slot 9"),
])
def test_bad_slot_actions_are_named(live, slot, what, body, status, words):
    reply = action(live, slot, what, **body)
    assert reply.status_code == status and words in reply.json()["error"]["message"], reply.text
    assert complete(live, [1, 2, 3], 2)["usage"]["completion_tokens"] == 2


def test_foreign_and_corrupt_files_are_refused(live, folder):
    write_kv_file(folder / "other.bin", [1, 2], (None,), {"model": "another", "kv_format": "x"})
    reply = action(live, 0, "restore", filename="other.bin")
    assert reply.status_code == 400 and "another model" in reply.text
    (folder / "junk.bin").write_bytes(b"GGUF" + bytes(100))
    reply = action(live, 0, "restore", filename="junk.bin")
    assert reply.status_code == 400 and "cannot be read" in reply.text
    assert str(folder) not in reply.text  # the server's folder is not told
    reply = requests.post(f"{live.url}/slots/0?action=save", data=b"{nope", timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_json"


def test_a_save_that_cannot_be_written_says_why(live, engine, folder, tmp_path):
    """A name that is a folder is the request's fault (400); a folder gone from under the
    server is its own (500), named either way (both were a bare 500 "internal_error")."""
    from strata.engine.slot_files import SlotFiles
    from strata.errors import StrataError

    (folder / "taken.bin").mkdir()
    reply = action(live, 0, "save", filename="taken.bin")
    assert reply.status_code == 400 and "is a folder" in reply.json()["error"]["message"]
    assert complete(live, [1, 2, 3], 2)["usage"]["completion_tokens"] == 2
    gone = tmp_path / "gone"
    gone.mkdir()
    files = SlotFiles(gone, engine)
    gone.rmdir()
    with pytest.raises(StrataError, match="could not be written in --slot-save-path: No such "
                                          "file or directory"):
        files.save(0, "a.bin")


def test_a_save_path_gone_before_the_first_action_is_named(model_path, tmp_path):
    """--slot-save-path removed after the start: save and restore are a 500 naming the
    folder (it was a bare 500 "internal_error" and a traceback), erase needs no folder."""
    gone = tmp_path / "slots"
    gone.mkdir()
    server = start_live_server(Engine(EngineConfig(model_path, n_ctx=N_CTX_TOKENS, threads=2)),
                               ServerConfig(model_id="tiny", slot_save_path=str(gone)))
    try:
        complete(server, PROMPT[:10], 2)
        gone.rmdir()
        for what in ("save", "restore"):
            reply = action(server, 0, what, filename="a.bin")
            assert reply.status_code == 500, reply.text
            error = reply.json()["error"]
            assert error["code"] == "server_error" and "is not a folder" in error["message"]
        reply = action(server, 0, "erase")  # the prompt and the reply's first token
        assert reply.status_code == 200 and reply.json() == {"id_slot": 0, "n_erased": 11}
        assert complete(server, [1, 2, 3], 2)["usage"]["completion_tokens"] == 2
    finally:
        server.stop()


def test_a_busy_slot_is_a_conflict(model_path, folder):
    engine = Engine(EngineConfig(model_path, n_ctx=N_CTX_TOKENS, threads=2))
    gate = StepGate(engine)
    server = start_live_server(engine, ServerConfig(model_id="tiny",
                                                    slot_save_path=str(folder)))
    try:
        done = {}
        gen = threading.Thread(target=lambda: done.setdefault("gen", complete(server, PROMPT)))
        gen.start()
        deadline = time.monotonic() + 30
        while not engine.scheduler.num_running:  # placed; the gate holds its first window
            assert time.monotonic() < deadline
            time.sleep(0.01)
        saver = threading.Thread(target=lambda: done.setdefault(
            "save", action(server, 0, "save", filename="busy.bin")))
        saver.start()
        gate.allow(1)  # the window runs, then the engine thread takes the call
        saver.join(30)
        gate.open()
        gen.join(60)
        assert done["save"].status_code == 409, done["save"].text
        assert "processing a request" in done["save"].json()["error"]["message"]
        assert done["gen"]["usage"]["completion_tokens"] == 6
    finally:
        gate.open()
        server.stop()


def test_without_a_save_path_slot_actions_are_off(live_long):
    reply = action(live_long, 0, "save", filename="a.bin")
    assert reply.status_code == 501 and "--slot-save-path" in reply.text
