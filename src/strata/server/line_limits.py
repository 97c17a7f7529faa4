"""Where an editor's completion ends early, as llama.cpp's `/infill` options say: a new line
indented less than `n_indent` (the block the cursor is in has ended), or the first line break
after `t_max_predict_ms` of generating."""
from __future__ import annotations

import time
from collections.abc import Callable

INDENT = " \t"


class LineLimits:
    """Feed the generated text piece by piece; `feed` returns what may be sent now. After a
    line break the next line's indentation is held until its first other character shows
    whether the line belongs; one indented less than `min_indent` is dropped whole (the line
    break before it is kept) and ends the completion. The first line is never checked: it
    continues the cursor's line."""

    def __init__(self, min_indent: int = 0, max_predict_ms: int = 0,
                 clock: Callable[[], float] = time.monotonic):
        self.min_indent = min_indent
        self.max_predict_ms = max_predict_ms
        self._clock = clock
        self._start_s: float | None = None
        self._held = ""  # the current line's indentation, not sent yet
        self._is_indent_open = False  # the current line has shown only indentation so far
        self.has_new_line = False
        self.is_cut = False  # the completion ended here (the generation should stop)
        self.cut_reason = ""  # which limit ended it

    def feed(self, text: str) -> str:
        if self.is_cut:
            return ""
        if self._start_s is None:
            self._start_s = self._clock()
        out = []
        for ch in text:
            if ch == "\n":
                out.append(self._held + ch)  # a blank line says nothing of the block
                self._held = ""
                self.has_new_line = True
                self._is_indent_open = self.min_indent > 0
            elif self._is_indent_open and ch in INDENT:
                self._held += ch
            elif self._is_indent_open:
                self._is_indent_open = False
                if len(self._held) < self.min_indent:
                    self._held = ""
                    self.is_cut = True
                    self.cut_reason = f"a line indented less than n_indent = {self.min_indent}"
                    break
                out.append(self._held + ch)
                self._held = ""
            else:
                out.append(ch)
        if not self.is_cut and self.has_new_line and self.max_predict_ms > 0:
            if (self._clock() - self._start_s) * 1000.0 > self.max_predict_ms:
                self.is_cut = True
                self.cut_reason = f"a line break after t_max_predict_ms = {self.max_predict_ms}"
        return "".join(out)

    def finish(self) -> str:
        """What is still held when the generation ended by itself (a last line's indentation)."""
        held, self._held = ("" if self.is_cut else self._held), ""
        return held
