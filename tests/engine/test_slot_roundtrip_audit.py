"""Slot files (llama.cpp's slot save / restore / erase) and conversation files, round trip by
round trip on the CPU: a conversation saved and restored, into another slot, into its own
slot after other requests, or into a new engine, continues with the tokens and logprobs of the
conversation never saved; a qwen3next file restores at its end or at a checkpoint, never at a
state of another length; a file of another model, KV format or context, or a damaged one, is
refused by name with the slot unchanged; erase, save over a name and busy slots."""
from __future__ import annotations

import json
import struct

import pytest

from strata import Engine, EngineConfig, SamplingParams
from strata.engine.kv_file import SUFFIX, read_kv_header, write_kv_file
from strata.engine.slot_files import SlotFiles
from strata.errors import RequestError

pytestmark = pytest.mark.usefixtures("one_kernel_thread")

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)
FIRST = [(7 * i) % 900 + 20 for i in range(32)]
OTHERS = ([(11 * i) % 900 + 30 for i in range(24)], [(5 * i) % 900 + 40 for i in range(20)])


@pytest.fixture(scope="module")
def models(tiny_model_path, hybrid_path, tmp_path_factory):
    """name -> model path: the engine tests' qwen3moe and qwen3next, and synths of other
    weights, quants and architectures."""
    from strata.tool.synth import synth_model

    folder = tmp_path_factory.mktemp("audit-models")
    paths = {"qwen3moe": tiny_model_path, "qwen3next": hybrid_path}
    for name, shape, weights, seed in (("q8_0", "tiny", "q8_0", 3), ("q4_0", "tiny", "q4_0", 3),
                                       ("qwen2moe", "tiny-qwen2moe", "f32", 3),
                                       ("reseeded", "tiny", "f32", 4)):
        paths[name] = folder / f"{name}.gguf"
        synth_model(paths[name], shape=shape, weight_type=weights, seed=seed)
    return paths


def new_engine(path, **options) -> Engine:
    """Two slots and no parked conversations in RAM: a restored slot's cells come from its
    file alone."""
    settings = dict(n_ctx=128, parallel=2, threads=1, conversation_cache_mib=0)
    return Engine(EngineConfig(path, **{**settings, **options}))


def turn(engine, prompt):
    """(token ids, logprobs with their alternatives, cached tokens) of a greedy reply."""
    events = list(engine.generate(prompt, GREEDY))
    return ([e.token_id for e in events], [e.logprob for e in events],
            events[-1].stats.num_cached_tokens)


def reference(path, **options):
    """The conversation never saved: its first reply, the next turn's prompt, and that turn."""
    with new_engine(path, **options) as engine:
        first = turn(engine, FIRST)
        following = FIRST + first[0] + [7, 8, 9]
        return first, following, turn(engine, following)


def slot_of(engine) -> int:
    return engine.scheduler.last_slot_index


def slot_tokens(engine, index):
    return tuple(engine.scheduler.table.tokens(index)), engine.scheduler.kvs[index].num_tokens


CASES = [("qwen3moe", {}), ("qwen3next", {}), ("q8_0", {}), ("q4_0", {}), ("qwen2moe", {}),
         ("qwen3moe", {"kv_type": "f16"}), ("qwen3next", {"kv_type": "f16"})]
CASE_IDS = [name + ("-kv-f16" if options else "") for name, options in CASES]


@pytest.mark.parametrize("name, options", CASES, ids=CASE_IDS)
def test_a_restored_slot_continues_as_the_conversation_never_saved(models, tmp_path, name,
                                                                   options):
    first, following, want = reference(models[name], **options)
    with new_engine(models[name], **options) as engine:
        files = SlotFiles(tmp_path, engine)
        assert turn(engine, FIRST) == first
        saved = slot_of(engine)
        assert files.save(saved, "agent")["n_saved"] == len(FIRST) + len(first[0]) - 1
        assert engine.scheduler.erase_slot(saved) == len(FIRST) + 3
        # into the other slot
        other = 1 - saved
        assert files.restore(other, "agent")["n_restored"] == want[2]
        assert turn(engine, following) == want and slot_of(engine) == other
        # into its own slot, after other requests took both slots
        handles = [engine.submit(prompt, GREEDY) for prompt in OTHERS]
        while engine.step():
            pass
        assert {h.slot_index for h in handles} == {0, 1}
        files.restore(saved, "agent")
        assert turn(engine, following) == want and slot_of(engine) == saved


@pytest.mark.parametrize("name, options", CASES[:2] + CASES[5:6], ids=CASE_IDS[:2] + CASE_IDS[5:6])
def test_a_new_engine_restores_a_slot_file_and_reuses_its_tokens(models, tmp_path, name,
                                                                 options):
    first, following, want = reference(models[name], **options)
    with new_engine(models[name], **options) as engine:
        turn(engine, FIRST)
        SlotFiles(tmp_path, engine).save(slot_of(engine), "agent")
    with new_engine(models[name], **options) as engine:
        n = SlotFiles(tmp_path, engine).restore(1, "agent")["n_restored"]
        got = turn(engine, following)
    assert n == len(FIRST) + 3 and got[2] == want[2] == n
    assert got == want


@pytest.mark.parametrize("name", ["qwen3moe", "qwen3next"])
def test_a_conversation_file_continues_as_the_conversation_never_parked(models, tmp_path,
                                                                        name):
    first, following, want = reference(models[name])
    with new_engine(models[name], conversation_cache_mib=64,
                    conversation_cache_dir=tmp_path) as engine:
        turn(engine, FIRST)  # in its slot at the stop: written to a file
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 1
    with new_engine(models[name], conversation_cache_mib=64,
                    conversation_cache_dir=tmp_path) as engine:
        assert turn(engine, following) == want


# ---- qwen3next: a state exists at the file's end and checkpoints only ----------------------
def hybrid_file(path, folder, **options):
    """Save the first turn's slot of a qwen3next engine; (first reply, file header)."""
    with new_engine(path, **options) as engine:
        first = turn(engine, FIRST)
        SlotFiles(folder, engine).save(slot_of(engine), "agent")
    return first, read_kv_header(folder / "agent")


def hybrid_turn(path, prompt, restore_from=None, **options):
    """(slot 0's checkpoints before it, the turn of `prompt`) after FIRST's turn: in the
    engine that read FIRST, or, with `restore_from`, in a new engine restoring that folder's
    file."""
    with new_engine(path, parallel=1, **options) as engine:
        if restore_from is None:
            turn(engine, FIRST)
        else:
            SlotFiles(restore_from, engine).restore(0, "agent")
        return engine.scheduler.kvs[0].state.positions(), turn(engine, prompt)


@pytest.mark.parametrize("checkpoints", [8, 0])
def test_a_hybrid_file_is_reused_at_its_end_or_a_checkpoint_only(models, tmp_path,
                                                                 checkpoints):
    path = models["qwen3next"]
    first, header = hybrid_file(path, tmp_path, ctx_checkpoints=checkpoints)
    end = len(FIRST) + 3
    # the checkpoint taken with all but the prompt's last token read goes into the file
    points = [len(FIRST) - 1, end] if checkpoints else [end]
    assert header["reuse_points"] == points
    stored = header["tree"]["tuple"][2]["tuple"][2]["dict"]  # (keys, values, state)'s
    assert [position["int"] for position, _ in stored] == points[:-1]  # {position: state}
    reply = first[0]
    prompts = [FIRST + reply[:2] + [5, 6],  # shares 34 of its 35: the checkpoint, or nothing
               FIRST[:20] + [9, 9, 9],  # shares 20, below the checkpoint: read again
               FIRST + reply[:3] + [1, 2]]  # the whole file: its end
    for prompt, num_reused in zip(prompts, [len(FIRST) - 1 if checkpoints else 0, 0, end]):
        positions, got = hybrid_turn(path, prompt, tmp_path, ctx_checkpoints=checkpoints)
        # the file's checkpoint, and one at its end where it was restored
        assert positions == (tuple(points) if checkpoints else ())
        assert got[2] == num_reused
        assert got == hybrid_turn(path, prompt, ctx_checkpoints=checkpoints)[1]


def test_a_restored_slot_keeps_no_more_checkpoints_than_its_engine(models, tmp_path):
    """A file of a server keeping checkpoints, restored where --ctx-checkpoints is 0: the
    slot kept the file's checkpoint for good (a state of the whole recurrent stack each,
    ~80 MB at Qwen3-Next-80B's shape, that the option was set to spare)."""
    path = models["qwen3next"]
    first, _ = hybrid_file(path, tmp_path)
    prompt = FIRST + first[0][:2] + [5, 6]
    positions, got = hybrid_turn(path, prompt, tmp_path, ctx_checkpoints=0)
    assert positions == ()
    assert got == hybrid_turn(path, prompt, ctx_checkpoints=0)[1] and got[2] == 0


# ---- files that do not fit: refused by name, the slot as it was ------------------------------
def assert_refused_and_unchanged(engine, files, index, filename, match):
    """Restoring `filename` into slot `index` fails naming `match`; the slot holds what it
    held and the engine answers the slot's next turn as before."""
    before = slot_tokens(engine, index)
    with pytest.raises(RequestError, match=match):
        files.restore(index, filename)
    assert slot_tokens(engine, index) == before


@pytest.fixture()
def serving(models, tmp_path):
    """A qwen3moe engine whose slot 0 holds FIRST's turn, its slot files in tmp_path, and
    what its next turn must give."""
    first, following, want = reference(models["qwen3moe"])
    with new_engine(models["qwen3moe"]) as engine:
        assert turn(engine, FIRST) == first and slot_of(engine) == 0
        yield engine, SlotFiles(tmp_path, engine), following, want


@pytest.mark.parametrize("other, options, match", [
    ("reseeded", {}, r"another model \(reseeded.gguf \(qwen3moe\)\), not of this server's "
                     r"tiny-f32.gguf \(qwen3moe\)"),  # same shape, other weights
    ("q8_0", {}, r"another model \(q8_0.gguf \(qwen3moe\)\)"),
    ("qwen2moe", {}, r"another model \(qwen2moe.gguf \(qwen2moe\)\)"),
    ("qwen3next", {}, r"another model \(tiny-qwen3next.gguf \(qwen3next\)\)"),
    ("qwen3moe", {"kv_type": "f16"}, r"another KV format \(cells=\[\('', '<f2'\)\] in the "
                                     r"file, cells=\[\('', '<f4'\)\] here\).*\(--kv\)"),
], ids=["weights", "quant", "arch", "hybrid", "kv-type"])
def test_a_file_of_another_model_or_kv_format_is_refused(models, serving, tmp_path, other,
                                                         options, match):
    engine, files, following, want = serving
    with new_engine(models[other], **options) as foreign:
        turn(foreign, FIRST)
        SlotFiles(tmp_path, foreign).save(slot_of(foreign), "foreign")
    assert_refused_and_unchanged(engine, files, 0, "foreign", match)
    assert turn(engine, following) == want


def cut(path, num_bytes):
    data = path.read_bytes()
    path.write_bytes(data[:num_bytes])


def edit_header(path, change):
    """Rewrite the JSON header of the file at `path` through `change(header)`, its length
    and the data's place kept (the header is padded to its old length)."""
    data = bytearray(path.read_bytes())
    size = struct.unpack_from("<I", data, 12)[0]
    header = json.loads(data[16:16 + size])
    change(header)
    text = json.dumps(header).encode()
    assert len(text) <= size
    data[16:16 + size] = text + b" " * (size - len(text))
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, match", [
    (lambda p: cut(p, 10), "too short"),
    (lambda p: cut(p, 100), "truncated or corrupt"),
    (lambda p: cut(p, p.stat().st_size - 1), "truncated"),
    (lambda p: p.write_bytes(b"GGUF" + p.read_bytes()[4:]), "not a Strata conversation file"),
    (lambda p: p.write_bytes(p.read_bytes()[:8] + b"\x09" + p.read_bytes()[9:]),
     "format version 9"),
    (lambda p: p.write_bytes(p.read_bytes()[:40] + b"\x00" + p.read_bytes()[41:]),
     "corrupt header"),
    (lambda p: edit_header(p, lambda h: h.update(num_tokens=h["num_tokens"] + 1)),
     "token count disagrees"),
    (lambda p: edit_header(p, lambda h: h.update(reuse_points=[-3])),
     "reuse points .* are not token counts"),
    (lambda p: edit_header(p, lambda h: h.update(kv_nbytes=-1)), "kv_nbytes -1 is negative"),
], ids=["cut-10", "cut-100", "cut-1-short", "magic", "version", "json", "num-tokens",
        "reuse-points", "kv-nbytes"])
def test_a_damaged_file_is_refused_by_name(serving, tmp_path, damage, match):
    engine, files, following, want = serving
    files.save(0, "damaged")
    damage(tmp_path / "damaged")
    assert_refused_and_unchanged(engine, files, 0, "damaged", match)
    assert turn(engine, following) == want


def test_a_file_with_this_models_fingerprint_but_other_cells_is_refused(models, serving,
                                                                        tmp_path):
    """A file whose header claims this model and KV format (edited, or a bug) but holds
    another model's cells: the arrays are checked against the slot's KV."""
    engine, files, following, want = serving
    with new_engine(models["qwen3next"]) as foreign:
        turn(foreign, FIRST)
        tokens, value, points, nbytes = foreign.scheduler.export_slot(slot_of(foreign))
    write_kv_file(tmp_path / "posing", tokens, value,
                  {**files.meta(), "reuse_points": points, "kv_nbytes": nbytes})
    assert_refused_and_unchanged(engine, files, 0, "posing", "cannot be restored: its keys")
    assert turn(engine, following) == want


@pytest.mark.parametrize("name", ["qwen3moe", "qwen3next"])
def test_a_file_of_another_context_size_restores_when_its_tokens_fit(models, tmp_path, name):
    path = models[name]
    first, following, want = reference(path, n_ctx=48)
    with new_engine(path, n_ctx=128) as engine:
        turn(engine, FIRST)
        SlotFiles(tmp_path, engine).save(slot_of(engine), "agent")
    with new_engine(path, n_ctx=48) as engine:
        assert SlotFiles(tmp_path, engine).restore(0, "agent")["n_restored"] == want[2]
        assert turn(engine, following) == want


@pytest.mark.parametrize("name", ["qwen3moe", "qwen3next"])
def test_a_file_longer_than_the_context_is_refused(models, tmp_path, name):
    """It restored the prefix that fits without a word (qwen3next: none of it, after
    parking what the slot held), answering 200 with fewer tokens than the file has."""
    path = models[name]
    with new_engine(path, n_ctx=128) as engine:
        turn(engine, FIRST)
        SlotFiles(tmp_path, engine).save(slot_of(engine), "agent")
    short = [3, 4, 5, 6]
    with new_engine(path, n_ctx=24, parallel=1) as engine:
        want = turn(engine, short)
        files = SlotFiles(tmp_path, engine)
        assert_refused_and_unchanged(engine, files, 0, "agent",
                                     r"holds 35 tokens, more than this server's context of "
                                     r"24 tokens \(--ctx-size\)")
        again = turn(engine, short)  # the slot's own tokens (a qwen3next: its checkpoint)
        assert again[0] == want[0] and again[2] == len(short) - 1


# ---- erase, a name saved twice, busy slots -------------------------------------------------
def test_erase_keeps_the_file_and_a_restore_brings_the_slot_back(serving):
    engine, files, following, want = serving
    held = slot_tokens(engine, 0)
    files.save(0, "agent")
    assert engine.scheduler.erase_slot(0) == len(held[0])
    assert slot_tokens(engine, 0) == ((), 0)
    assert files.restore(0, "agent")["n_restored"] == len(held[0])
    assert slot_tokens(engine, 0) == held
    assert turn(engine, following) == want


def test_a_save_over_a_name_replaces_the_file_whole(serving, tmp_path):
    engine, files, following, want = serving
    files.save(0, "agent")
    turn(engine, OTHERS[0])
    other = slot_of(engine)
    held = slot_tokens(engine, other)
    files.save(other, "agent")  # over the first turn's file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["agent"]  # no .partial left
    assert files.restore(0, "agent")["n_restored"] == len(held[0])
    assert slot_tokens(engine, 0) == held
    assert read_kv_header(tmp_path / "agent")["num_tokens"] == len(held[0])


def test_a_busy_slot_refuses_every_action_and_the_others_serve_it_unchanged(models, tmp_path):
    """The rule: save, restore and erase take an idle slot only (a busy one is a
    RequestError naming it, the server's 409); an idle slot's actions between the windows
    of a busy one leave its reply as it was."""
    path = models["qwen3next"]
    with new_engine(path) as engine:
        want = turn(engine, OTHERS[0])
    with new_engine(path) as engine:
        files = SlotFiles(tmp_path, engine)
        turn(engine, FIRST)
        idle = slot_of(engine)
        handle = engine.submit(OTHERS[0], GREEDY)
        engine.step()
        engine.step()
        busy = handle.slot_index
        assert busy != idle and not handle.is_finished
        files.save(idle, "idle")
        for action in (lambda: files.save(busy, "busy"), lambda: files.restore(busy, "idle"),
                       lambda: engine.scheduler.erase_slot(busy)):
            with pytest.raises(RequestError, match=f"slot {busy} is processing a request"):
                action()
        assert not (tmp_path / "busy").exists()
        held = slot_tokens(engine, idle)
        assert engine.scheduler.erase_slot(idle) == len(held[0])
        assert files.restore(idle, "idle")["n_restored"] == len(held[0])
        events = handle.pop_events()
        while engine.step():
            events += handle.pop_events()
        events += handle.pop_events()
        got = ([e.token_id for e in events], [e.logprob for e in events],
               events[-1].stats.num_cached_tokens)
        assert handle.error is None and got == want
        assert slot_tokens(engine, idle) == held


def test_a_parked_conversation_of_a_restored_slot_is_its_own(models, tmp_path):
    """A restore parks what the slot held (RAM cache on): that conversation's next turn
    restores it from RAM and answers as if the slot had never been touched."""
    first, following, want = reference(models["qwen3moe"], parallel=1)
    with new_engine(models["qwen3moe"], parallel=1, conversation_cache_mib=64) as engine:
        files = SlotFiles(tmp_path, engine)
        turn(engine, OTHERS[0])
        files.save(0, "other")
        turn(engine, FIRST)
        files.restore(0, "other")
        assert turn(engine, following) == want


def test_an_empty_slot_saves_and_restores_as_empty(models, tmp_path):
    for name in ("qwen3moe", "qwen3next"):
        with new_engine(models[name]) as engine:
            files = SlotFiles(tmp_path, engine)
            assert files.save(1, name)["n_saved"] == 0
            turn(engine, FIRST)
            assert files.restore(slot_of(engine), name)["n_restored"] == 0
            assert slot_tokens(engine, slot_of(engine)) == ((), 0)


# ---- KV grow: an idle slot keeps its base cells ----------------------------------------------
def test_a_restore_with_kv_grow_keeps_the_whole_file_for_the_next_turn(wide, tmp_path):
    """Only the slot's 16 base cells were restored (n_restored 16 of 35): the next turn read
    the other 19 tokens again. The file is parked whole beside them, as a request's
    conversation is at its trim, and the next turn restores it with its KV grown."""
    options = dict(expert_cache=48, adapt_every=0, conversation_cache_mib=64)
    first, following, want = reference(wide, **options)
    with new_engine(wide, **options) as engine:
        turn(engine, FIRST)
        SlotFiles(tmp_path, engine).save(slot_of(engine), "agent")
    with new_engine(wide, kv_grow=16, **options) as engine:
        assert engine.scheduler.kv_lender is not None
        restored = SlotFiles(tmp_path, engine).restore(0, "agent")
        got = turn(engine, following)
    assert restored["n_restored"] == got[2] == want[2] == len(FIRST) + 3
    assert got == want
