"""Stop strings matched across pieces of streamed text; nothing past (or maybe part of) a stop."""
from __future__ import annotations

import pytest

from strata.engine.generate import StopStringMatcher


def feed(matcher: StopStringMatcher, pieces: list[str]) -> list[str]:
    out = []
    for p in pieces:
        out.append(matcher.push(p))
        if matcher.is_stopped:
            break
    return out


def test_no_stop_strings_passes_text_through():
    m = StopStringMatcher([])
    assert feed(m, ["ab", "c"]) == ["ab", "c"]
    assert m.flush() == ""


def test_stop_inside_one_piece_cuts_before_it():
    m = StopStringMatcher(["END"])
    assert feed(m, ["hello END world"]) == ["hello "]
    assert m.is_stopped and m.flush() == ""


def test_stop_split_across_pieces_is_held_back_then_dropped():
    m = StopStringMatcher(["END"])
    # "E" and "EN" may start the stop string: held back until known.
    assert feed(m, ["abc E", "N", "D tail"]) == ["abc ", "", ""]
    assert m.is_stopped


def test_false_start_is_released():
    m = StopStringMatcher(["END"])
    assert feed(m, ["x E", "NX", "y"]) == ["x ", "ENX", "y"]
    assert not m.is_stopped and m.matched is None


def test_held_text_is_flushed_at_the_end():
    m = StopStringMatcher(["END"])
    assert feed(m, ["abc EN"]) == ["abc "]
    assert m.flush() == "EN"


def test_earliest_of_several_stop_strings_wins():
    m = StopStringMatcher(["world", "lo w"])
    # "l" may start "lo w": held; then "lo w" is found before "world" could complete.
    assert feed(m, ["hel", "lo wor", "ld"]) == ["he", "l"]
    assert m.is_stopped and m.matched == "lo w"


def test_holds_the_longest_possible_prefix():
    m = StopStringMatcher(["abcd", "cx"])
    # "abc" could start "abcd"; "c" could start "cx": the longer hold wins.
    assert feed(m, ["zzabc"]) == ["zz"]
    assert feed(m, ["x"]) == ["ab"]  # "abcx" contains "cx": cut before it
    assert m.is_stopped and m.matched == "cx"


@pytest.mark.parametrize("split", range(1, 11))
def test_every_split_point_gives_the_same_text(split):
    text = "one <stop> two"
    m = StopStringMatcher(["<stop>"])
    out = "".join(feed(m, [text[:split], text[split:]]))
    assert out == "one " and m.is_stopped
