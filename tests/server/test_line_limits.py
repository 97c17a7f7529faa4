"""An editor completion's early ends (llama.cpp's n_indent and t_max_predict_ms), fed the way
the engine sends text: a piece per token, pieces split anywhere."""
import pytest

from strata.server.line_limits import LineLimits


class Clock:
    def __init__(self):
        self.now_s = 0.0

    def __call__(self):
        return self.now_s


def feed_all(limits, pieces):
    out = "".join(limits.feed(p) for p in pieces)
    return out + (limits.finish() if not limits.is_cut else "")


def test_no_limits_pass_everything():
    limits = LineLimits()
    assert feed_all(limits, ["a\n", "  b", "\n\n", "c"]) == "a\n  b\n\nc"
    assert not limits.is_cut and limits.has_new_line


@pytest.mark.parametrize("split", [1, 2, 3, 100])
def test_an_under_indented_line_ends_the_completion_and_is_dropped(split):
    text = "x + 1\n        return y\n\n    def g():\n"
    pieces = [text[i:i + split] for i in range(0, len(text), split)]
    limits = LineLimits(min_indent=8)
    assert feed_all(limits, pieces) == "x + 1\n        return y\n\n"
    assert limits.is_cut and limits.cut_reason == ("a line indented less than n_indent = 8")


def test_the_first_line_is_never_checked_and_tabs_count_one_each():
    limits = LineLimits(min_indent=2)
    assert limits.feed("x") == "x"  # the cursor's line: no indentation of its own
    assert limits.feed("\n\t") == "\n"  # held: the line's indentation is not known yet
    assert limits.feed("\ty") == "\t\ty"
    assert limits.feed("\n\tz") == "\n"
    assert limits.is_cut


def test_a_last_lines_indentation_comes_out_at_the_end():
    limits = LineLimits(min_indent=4)
    assert limits.feed("a\n  ") == "a\n"
    assert limits.finish() == "  "
    assert not limits.is_cut


def test_the_time_limit_waits_for_a_line_break():
    clock = Clock()
    limits = LineLimits(max_predict_ms=100, clock=clock)
    assert limits.feed("a") == "a"  # the clock starts at the first piece
    clock.now_s = 0.5
    assert limits.feed("b") == "b" and not limits.is_cut  # late, but no line break yet
    assert limits.feed("c\nd") == "c\nd"
    assert limits.is_cut and "t_max_predict_ms = 100" in limits.cut_reason
    assert limits.feed("more") == ""


def test_within_the_time_limit_nothing_ends():
    clock = Clock()
    limits = LineLimits(max_predict_ms=100, clock=clock)
    limits.feed("a\n")
    clock.now_s = 0.099
    assert limits.feed("b\n") == "b\n" and not limits.is_cut
