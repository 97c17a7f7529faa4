"""`strata run`'s conversation mode (-cnv, cli_chat.py): turns that reuse the KV of the turns
before, /clear, the context filling up, its refusals, and a terminal session through a pty."""
from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys

import pytest
from click.testing import CliRunner

from strata.cli import main
from strata.cli_chat import ReplyPrinter

SPEED = re.compile(r"^prompt: (\d+) tokens read, (\d+) reused, at ")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from strata.tool.synth import synth_model

    path = tmp_path_factory.mktemp("cnv") / "tiny.gguf"
    synth_model(path, shape="tiny", weight_type="f32", seed=5)
    return str(path)


def chat_length(path: str, messages: list[dict]) -> int:
    """Tokens of the chat prompt `messages` make in the model's template."""
    from strata.model.chat import ChatTemplate
    from strata.model.gguf_file import GGUFModel
    from strata.model.tokenizer import Tokenizer

    with GGUFModel.open(path) as m:
        tokenizer = Tokenizer.from_gguf_metadata(m.metadata)
        template = ChatTemplate.from_gguf_metadata(m.metadata, tokenizer)
    text = template.render(messages, add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special=False))


def speeds(stderr: str) -> list[tuple[int, int]]:
    """(read, reused) of each turn's speed line."""
    return [(int(m[1]), int(m[2])) for m in map(SPEED.match, stderr.splitlines()) if m]


def chat(tiny, turns: list[str], *flags: str):
    return CliRunner().invoke(main, ["run", "--model", tiny, "-cnv", "--temp", "0", *flags],
                              input="".join(t + "\n" for t in turns))


def test_the_second_turn_reuses_the_first_and_clear_starts_again(tiny):
    res = chat(tiny, ["Hello", "And then?", "/clear", "Hello"], "-n", "12")
    assert res.exit_code == 0, res.output
    assert "Traceback" not in res.output
    first = chat_length(tiny, [{"role": "user", "content": "Hello"}])
    (read1, reused1), (read2, reused2), (read3, reused3) = speeds(res.stderr)
    assert (read1, reused1) == (first, 0)
    # the first prompt and the reply's tokens (the last one generated is never read back)
    assert first < reused2 <= first + 12 - 1
    assert read2 > 0
    assert "(a new conversation)" in res.stderr
    # /clear: the same first turn again, all but the token whose logits it needs reused
    assert (read3, reused3) == (1, first - 1)


def test_the_system_message_is_in_every_turn(tiny):
    res = chat(tiny, ["Hello", "/clear", "Hello"], "-n", "4", "--system", "Be brief.")
    assert res.exit_code == 0, res.output
    first = chat_length(tiny, [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Hello"}])
    assert speeds(res.stderr) == [(first, 0), (1, first - 1)]


def test_a_trailing_backslash_continues_the_turn(tiny):
    res = chat(tiny, ["one\\", "two"], "-n", "2")
    assert res.exit_code == 0, res.output
    expected = chat_length(tiny, [{"role": "user", "content": "one\ntwo"}])
    assert speeds(res.stderr) == [(expected, 0)]


def test_a_full_context_is_said_and_clear_goes_on(tiny):
    first = chat_length(tiny, [{"role": "user", "content": "Hello"}])
    ctx = first + 10
    res = chat(tiny, ["Hello", "More", "/clear", "Hello"], "--ctx-size", str(ctx), "-n", "100")
    assert res.exit_code == 0, res.output
    assert "Traceback" not in res.output
    assert f"the context is full ({ctx} tokens): the reply was cut; /clear" in res.stderr
    said = re.search(r"the conversation with this turn is (\d+) tokens and the context holds "
                     rf"{ctx}; /clear starts a new conversation", res.stderr)
    assert said and int(said[1]) >= ctx
    # the too-long turn ran nothing: two speed lines, the second after /clear
    assert speeds(res.stderr) == [(first, 0), (1, first - 1)]


def test_raw_and_no_prompt_off_a_terminal_are_refused(tiny):
    res = CliRunner().invoke(main, ["run", "--model", tiny, "-cnv", "--raw"])
    assert res.exit_code == 2
    assert "--raw feeds one prompt without the chat template" in res.stderr
    res = CliRunner().invoke(main, ["run", "--model", tiny], input="Hello\n")
    assert res.exit_code == 2
    assert "no PROMPT given and stdin is not a terminal" in res.stderr
    assert "-cnv" in res.stderr and "Traceback" not in res.output


def test_a_prompt_with_cnv_is_the_first_turn(tiny):
    res = CliRunner().invoke(main, ["run", "--model", tiny, "--temp", "0", "-n", "3",
                                    "--conversation", "Hello"], input="/exit\nnot read\n")
    assert res.exit_code == 0, res.output
    assert speeds(res.stderr) == [(chat_length(tiny, [{"role": "user", "content": "Hello"}]), 0)]


def test_hidden_thinking_leaves_the_block_out(capsys):
    printer = ReplyPrinter("hide", starts_in_reasoning=False)
    for piece in ("<thi", "nk>\nfirst a plan", "</think>\n\n", "The answer."):
        printer.push(piece)
    printer.finish()
    assert capsys.readouterr().out == "The answer.\n"
    printer = ReplyPrinter("hide", starts_in_reasoning=True)  # the template opened the block
    for piece in ("a plan", "</think>", "Yes"):
        printer.push(piece)
    printer.finish()
    shown = ReplyPrinter("show", starts_in_reasoning=False)
    shown.push("<think>x</think>y")
    shown.finish()
    assert capsys.readouterr().out == "Yes\n<think>x</think>y\n"


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Terminal:
    """`strata run` with stdin and stdout on a pseudo-terminal, stderr on a pipe."""

    def __init__(self, args: list[str]):
        self.master, slave = pty.openpty()
        # Ctrl-C as a terminal's user has it: a test runner's worker, or a shell's background
        # job, starts with SIGINT ignored, which the child would inherit (and Python then
        # leaves it ignored)
        self.proc = subprocess.Popen([sys.executable, "-m", "strata", "run", *args],
                                     stdin=slave, stdout=slave, stderr=subprocess.PIPE,
                                     env={**os.environ, "TERM": "dumb"},
                                     preexec_fn=_default_sigint)
        os.close(slave)
        self.out = b""
        self.err = b""

    def wait_for(self, *, markers: int, turns: int, limit_s: float = 120) -> None:
        """Read both until the terminal shows `markers` prompts and stderr `turns` speed lines
        (the limit only keeps a broken run from hanging the suite)."""
        fds = [self.master, self.proc.stderr.fileno()]
        while (self.out.count(b"> ") < markers
               or len(speeds(self.err.decode(errors="replace"))) < turns):
            ready, _, _ = select.select(fds, [], [], limit_s)
            assert ready, f"waited for {markers} / {turns}; got {self.out!r} / {self.err!r}"
            for fd in ready:
                try:
                    data = os.read(fd, 4096)
                except OSError:  # the pty closes when the process ends
                    data = b""
                if not data:
                    fds.remove(fd)
                    assert fds, f"ended early: {self.out!r} {self.err!r}"
                elif fd == self.master:
                    self.out += data
                else:
                    self.err += data

    def wait_until_reading(self) -> None:
        """Until the main thread blocks waiting for the terminal. A SIGINT that comes between
        the prompt's print and that wait only sets Python's flag, and the read that follows
        does not look at it (CPython's), so a test's Ctrl-C waits for the read; a user's
        key press is never that fast."""
        wchan = f"/proc/{self.proc.pid}/wchan"
        if not os.path.exists(wchan):
            pytest.skip("needs /proc/PID/wchan to see the process wait for input")
        for _ in range(10_000):  # bounds a broken run, not a speed
            with open(wchan) as f:
                where = f.read()
            if "poll" in where or "select" in where or "tty_read" in where:
                return
            select.select([], [], [], 0.01)
        raise AssertionError(f"never waited for input (last in {where!r})")

    def type(self, text: bytes) -> None:
        os.write(self.master, text)

    def close(self) -> int:
        self.proc.stderr.close()
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # a hung chat fails its test, not the next one (as a leaked child)
            self.proc.wait()
            raise
        finally:
            os.close(self.master)


@pytest.mark.parametrize("leave", [b"\x04", b"/exit\n", "ctrl-c"])
def test_a_terminal_chat_and_a_clean_exit(tiny, leave):
    term = Terminal(["--model", tiny, "--temp", "0", "-n", "6"])  # no PROMPT: a chat
    try:
        term.wait_for(markers=1, turns=0)
        assert b"conversation mode: /exit or /quit ends it" in term.err
        term.type(b"Hello\n")
        term.wait_for(markers=2, turns=1)
        term.type(b"And then?\n")
        term.wait_for(markers=3, turns=2)
        if leave == "ctrl-c":
            term.wait_until_reading()
            term.proc.send_signal(signal.SIGINT)  # as Ctrl-C at the prompt
        else:
            term.type(leave)
    finally:
        code = term.close()
    assert code == 0, term.err.decode()
    assert b"Traceback" not in term.err
    (read1, reused1), (read2, reused2) = speeds(term.err.decode())
    assert reused1 == 0 and reused2 > read1
