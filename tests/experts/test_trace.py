"""Routing traces: writer/reader round trip, merge, damaged files, skew summary."""
import numpy as np
import pytest
from routing_helpers import make_trace

from strata.errors import ModelFormatError
from strata.experts import trace as trace_module
from strata.experts.trace import (RECORD_DTYPE, TraceWriter, format_skew_summary, merge_traces,
                                  read_trace, skew_summary, write_trace)


def _as_tuples(trace):
    return [tuple(int(v) for v in r) for r in trace.records]


def test_writer_records_distinct_experts_with_row_counts(tmp_path):
    path = tmp_path / "t.trace"
    with TraceWriter(path, n_layers=2, n_experts=5, extra={"model": "x"}) as writer:
        writer.record(0, 1, np.array([[3, 1], [1, 4]]))  # [T=2, K=2]
        writer.record(0, 0, np.array([[0, 2]]))
        writer.record(1, 0, np.array([[2, 0], [2, 4], [0, 2]]))
    trace = read_trace(path)
    assert (trace.n_layers, trace.n_experts, trace.extra) == (2, 5, {"model": "x"})
    assert _as_tuples(trace) == [(0, 0, 0, 1), (0, 0, 2, 1), (0, 1, 1, 2), (0, 1, 3, 1),
                                 (0, 1, 4, 1), (1, 0, 0, 2), (1, 0, 2, 3), (1, 0, 4, 1)]
    assert trace.num_windows == 2
    assert trace.accesses_per_expert().tolist() == [[2, 0, 2, 0, 1], [0, 1, 0, 1, 1]]
    assert trace.rows_per_expert().tolist() == [[3, 0, 4, 0, 1], [0, 2, 0, 1, 1]]


def test_writer_flushes_whole_records_while_open(tmp_path, monkeypatch):
    monkeypatch.setattr(trace_module, "_FLUSH_RECORDS", 4)
    path = tmp_path / "t.trace"
    writer = TraceWriter(path, 1, 8)
    try:
        for window in range(3):
            writer.record(window, 0, np.array([[window, window + 1]]))
        # The second call reached the threshold of 4 records: those are on disk, whole.
        assert len(read_trace(path).records) == 4
    finally:
        writer.close()
    writer.close()  # closing twice is harmless
    assert len(read_trace(path).records) == 6


def test_writer_rejects_out_of_range_ids(tmp_path):
    with TraceWriter(tmp_path / "t.trace", 2, 4) as writer:
        with pytest.raises(ValueError, match="0..3"):
            writer.record(0, 0, np.array([[1, 4]]))
        with pytest.raises(ValueError, match="layer 2"):
            writer.record(0, 2, np.array([[1]]))


def test_write_trace_round_trip(tmp_path):
    trace = make_trace(2, 3, [[{0: 2, 2: 1}, [1]], [[], {0: 5}], [[2], []]])
    write_trace(tmp_path / "t.trace", trace)
    again = read_trace(tmp_path / "t.trace")
    assert _as_tuples(again) == _as_tuples(trace)
    assert again.num_windows == 3


def test_merge_renumbers_windows_in_order():
    first = make_trace(1, 4, [[[0]], [[1, 2]]])
    second = make_trace(1, 4, [[[3]], [[]], [[0]]])
    merged = merge_traces([first, second])
    assert _as_tuples(merged) == [(0, 0, 0, 1), (1, 0, 1, 1), (1, 0, 2, 1), (2, 0, 3, 1),
                                  (4, 0, 0, 1)]
    assert merged.num_windows == 5
    with pytest.raises(ModelFormatError, match="only traces of one model merge"):
        merge_traces([first, make_trace(1, 5, [[[0]]])])


def test_damaged_files_are_refused(tmp_path):
    bad = tmp_path / "bad.trace"
    bad.write_bytes(b"GGUF" + bytes(40))
    with pytest.raises(ModelFormatError, match="not a Strata routing trace"):
        read_trace(bad)
    good = tmp_path / "good.trace"
    write_trace(good, make_trace(1, 2, [[[0, 1]]]))
    cut = tmp_path / "cut.trace"
    cut.write_bytes(good.read_bytes()[:-5])
    with pytest.raises(ModelFormatError, match="partial record"):
        read_trace(cut)
    wrong = tmp_path / "wrong.trace"
    data = bytearray(good.read_bytes())
    data[8] = 9  # version
    wrong.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match="version 9"):
        read_trace(wrong)


@pytest.mark.parametrize("extra", [b"\xff" * 12, b'{"model": "x"', b"[1, 2]", b"xxxxxxxxxxxx"])
def test_a_damaged_header_extra_is_refused(tmp_path, extra):
    # the JSON extra between the header and the records: bytes flipped or cut, or not an object
    good = tmp_path / "good.trace"
    write_trace(good, make_trace(1, 2, [[[0, 1]]]))
    data = good.read_bytes()
    header_bytes, extra_len = 24, int.from_bytes(data[20:24], "little")
    bad = tmp_path / "bad.trace"
    bad.write_bytes(data[:20] + len(extra).to_bytes(4, "little") + extra
                    + data[header_bytes + extra_len:])
    with pytest.raises(ModelFormatError, match="bad.trace: damaged header"):
        read_trace(bad)


def test_the_trace_error_names_the_real_command(tmp_path):
    bad = tmp_path / "bad.trace"
    bad.write_bytes(b"GGUF" + bytes(40))
    with pytest.raises(ModelFormatError, match="`strata serve --dump-routing FILE`"):
        read_trace(bad)


def test_skew_summary_exact():
    # 1 layer, 10 experts; expert 0 in all 4 windows, expert 1 in windows 0-1, others once.
    trace = make_trace(1, 10, [[[0, 1, 2]], [[0, 1, 3]], [[0, 4]], [[0, 5]]])
    summary = skew_summary(trace, fractions=(0.1, 0.2))
    # 10 accesses: the top 1 expert takes 4, the top 2 take 6.
    assert summary.share_of_top == {0.1: 0.4, 0.2: 0.6}
    # Records of windows 0-2 (8): expert 0 three times and expert 1 once come back next window.
    assert summary.reuse_next_window == 4 / 8
    assert summary.mean_experts_per_window == 10 / 4
    assert summary.num_windows == 4
    lines = format_skew_summary(trace)
    assert lines[0] == "routing trace: 1 layers x 10 experts, 4 windows, 10 records"
    assert "top 10% of experts take 40.0%" in lines[1]
    assert "50.0% of routed experts are routed again" in lines[2]


def test_record_dtype_is_compact():
    assert RECORD_DTYPE.itemsize == 12


def _write_raw_trace(path, n_layers, n_experts, records, extra=b"{}", extra_len=None):
    header = trace_module._HEADER.pack(trace_module.TRACE_MAGIC, trace_module.TRACE_VERSION,
                                       n_layers, n_experts,
                                       len(extra) if extra_len is None else extra_len)
    path.write_bytes(header + extra + np.array(records, dtype=RECORD_DTYPE).tobytes())


@pytest.mark.parametrize("n_layers, n_experts", [(0, 0), (0, 4), (2, 0), (2**32 - 1, 4),
                                                 (2, 70000)])
def test_a_header_with_impossible_counts_is_refused(tmp_path, n_layers, n_experts):
    # 0 x 0 read as an empty trace (NaN skew in `inspect --routing`, a profile that could not
    # be read back); 2**32 - 1 layers made [L, E] count tables of 128 GiB
    path = tmp_path / "bad.trace"
    _write_raw_trace(path, n_layers, n_experts, [])
    with pytest.raises(ModelFormatError, match=f"bad.trace: damaged header: {n_layers} layers "
                                               f"x {n_experts} experts"):
        read_trace(path)


def test_a_header_whose_extra_runs_past_the_end_is_refused(tmp_path):
    # a cut file whose extra JSON still parsed was read as a whole, empty trace
    path = tmp_path / "cut.trace"
    _write_raw_trace(path, 2, 4, [], extra=b"{}", extra_len=500)
    with pytest.raises(ModelFormatError, match="cut.trace: damaged or truncated header"):
        read_trace(path)


def test_merging_traces_past_the_window_numbers_is_refused():
    # window numbers are u32: the second trace's windows wrapped round to 0.. silently
    late = trace_module.RoutingTrace(1, 4, np.array([(2**32 - 10, 0, 1, 1)], RECORD_DTYPE), {})
    with pytest.raises(ModelFormatError, match=r"8589934574 windows together, more than a "
                                               r"trace numbers \(4294967296\)"):
        merge_traces([late, late])
    assert merge_traces([late]).num_windows == 2**32 - 9


def test_a_trace_that_cannot_be_written_is_a_config_error(tmp_path):
    from strata.errors import ConfigError

    with pytest.raises(ConfigError, match="--dump-routing .*cannot be written"):
        TraceWriter(tmp_path / "gone" / "x.trace", 2, 4)  # its folder does not exist
