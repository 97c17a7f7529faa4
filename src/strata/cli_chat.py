"""`strata run`'s conversation mode (-cnv): a chat whose history stays in the engine's KV, so
each turn reads only its new tokens; plus the reply printing it shares with a single prompt."""
from __future__ import annotations

import signal
import sys
import threading

import click

from strata.errors import StrataError

MARKER = "> "
CONTINUATION = ". "  # after a line that ended in a backslash
COMMANDS = {"/exit": "end the conversation (as Ctrl-D does)", "/quit": "the same as /exit",
            "/clear": "start a new conversation (the --system message stays)",
            "/help": "list these commands"}
COMMANDS_HELP = ("/exit or /quit ends it, /clear starts a new conversation, /help lists the "
                 "commands")
DIM, PLAIN = "\x1b[2m", "\x1b[0m"


class ReplyPrinter:
    """Prints a reply's text as it streams. `thinking`: "show" prints it as the model wrote
    it, a `<think>` block included (dimmed on a terminal); "hide" leaves the block out."""

    def __init__(self, thinking: str, starts_in_reasoning: bool):
        from strata.server.output_parser import OutputParser

        self.thinking = thinking
        self.is_dim_ok = sys.stdout.isatty()
        self._parser = OutputParser(starts_in_reasoning=starts_in_reasoning, parse_tools=False)
        self._is_dim = False
        if thinking == "show" and starts_in_reasoning:
            self._set_dim(True)

    def _set_dim(self, dim: bool) -> None:
        if self.is_dim_ok and dim != self._is_dim:
            click.echo(DIM if dim else PLAIN, nl=False)
            self._is_dim = dim

    def push(self, text: str) -> None:
        if not text:
            return
        if self.thinking == "show":
            click.echo(text, nl=False)
            if self.is_dim_ok:  # the parser's events are dropped: it only tells the state
                self._parser.feed(text)
                self._set_dim(self._parser.is_in_reasoning)
        else:
            self._echo_content(self._parser.feed(text))
        sys.stdout.flush()

    def finish(self) -> None:
        if self.thinking == "hide":
            self._echo_content(self._parser.finish())
        self._set_dim(False)
        click.echo("")

    @staticmethod
    def _echo_content(deltas) -> None:
        from strata.server.output_parser import ContentDelta

        for delta in deltas:
            if isinstance(delta, ContentDelta):
                click.echo(delta.text, nl=False)


def speed_line(stats, show_reuse: bool = False) -> str:
    """`strata run`'s speed line: prompt tokens read, and those reused from the KV of an
    earlier turn (always in a conversation; elsewhere where any were); then the decode."""
    read, reused = stats.num_prompt_tokens_computed, stats.num_cached_tokens
    prompt = f"prompt: {read} tokens"
    if show_reuse or reused:
        prompt += f" read, {reused} reused,"
    return f"{prompt} at {stats.prompt_tokens_per_s:.2f} tokens/s, decode: " + decode_text(stats)


def decode_text(stats) -> str:
    """The decode part of `strata run`'s last line: the tokens the decode windows gave and
    their rate (the rate's own count: the first generated token comes from the prompt's
    logits, in the prompt's time)."""
    generated, decoded = stats.num_generated_tokens, stats.num_decode_tokens
    if not decoded:
        return (f"{generated} token{'' if generated == 1 else 's'} (from the prompt's logits; "
                "no decode window ran)")
    return (f"{decoded} token{'' if decoded == 1 else 's'} at {stats.decode_tokens_per_s:.2f} "
            f"tokens/s ({generated} generated, the first from the prompt's logits)")


class StopOnInterrupt:
    """While entered, Ctrl-C only asks the reply to stop (`is_set`): the engine finishes the
    window it is in, so its KV and caches stay whole for the next turn."""

    def __init__(self):
        self.is_set = False
        self._old = None

    def _ask(self, signum, frame) -> None:
        self.is_set = True

    def __enter__(self) -> "StopOnInterrupt":
        self.is_set = False
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._ask)
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None


def read_turn(is_tty: bool) -> str | None:
    """The user's next turn: a line, continued over the next while it ends in a backslash (as
    llama-cli's). None to end: Ctrl-D (end of input) or Ctrl-C at the prompt."""
    lines: list[str] = []
    while True:
        try:
            if is_tty:
                line = input(CONTINUATION if lines else MARKER)
            else:
                line = sys.stdin.readline()
                if not line:
                    raise EOFError
                line = line.rstrip("\n")
        except EOFError:
            if lines:  # the continued turn is sent; the next read ends it
                return "\n".join(lines)
            return None
        except KeyboardInterrupt:
            if lines:  # drop the half-written turn, back to the prompt
                click.echo("")
                lines = []
                continue
            return None
        if line.endswith("\\"):
            lines.append(line[:-1])
            continue
        lines.append(line)
        return "\n".join(lines)


class Conversation:
    """The messages so far and one engine; `reply` runs a turn."""

    def __init__(self, engine, params, system: str | None, thinking: str):
        self.engine = engine
        self.params = params
        self.system = system
        self.thinking = thinking
        self.messages: list[dict] = []
        self.clear()

    def clear(self) -> None:
        """A new conversation; the old one's KV stays, so its system prefix is reused."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def reply(self, user_text: str) -> None:
        """Stream the reply to `user_text`, then print the turn's speed line. Ctrl-C stops the
        reply (what came stays in the history); a context too small for the conversation is
        said, not raised."""
        from strata.engine.json_constraint import opens_reasoning

        engine = self.engine
        messages = self.messages + [{"role": "user", "content": user_text}]
        tokens = engine.chat_prompt(messages)
        if len(tokens) >= engine.n_ctx:
            click.echo(f"the context is full: the conversation with this turn is {len(tokens)} "
                       f"tokens and the context holds {engine.n_ctx}; /clear starts a new "
                       "conversation (or start again with a larger --ctx-size)", err=True)
            return
        printer = ReplyPrinter(self.thinking, opens_reasoning(engine.tokenizer, tokens))
        pieces: list[str] = []
        finish = None
        with StopOnInterrupt() as stop:
            events = engine.generate(tokens, self.params)
            try:
                for ev in events:
                    pieces.append(ev.text)
                    printer.push(ev.text)
                    finish = ev.finish_reason
                    if stop.is_set:
                        break
            finally:
                events.close()  # a stopped reply: the request is cancelled, its KV kept
        printer.finish()
        self.messages = messages + [{"role": "assistant", "content": "".join(pieces)}]
        stats = engine.last_stats
        if stop.is_set and finish is None:
            click.echo("[reply stopped]", err=True)
        elif (finish == "length" and stats is not None
              and stats.num_prompt_tokens + stats.num_generated_tokens >= engine.n_ctx):
            click.echo(f"the context is full ({engine.n_ctx} tokens): the reply was cut; /clear "
                       "starts a new conversation (or start again with a larger --ctx-size)",
                       err=True)
        if stats is not None:
            click.echo(speed_line(stats, show_reuse=True), err=True)


def chat(engine, params, system: str | None, thinking: str, first_turn: str | None) -> None:
    """The conversation loop: a turn, its reply, the next, until /exit, Ctrl-D or Ctrl-C at
    the prompt (a clean exit). On a terminal the prompt shows `> `; from a pipe turns are read
    line by line without one."""
    is_tty = sys.stdin.isatty()
    if is_tty:
        try:
            import readline  # noqa: F401 (line editing and history for input())
        except ImportError:
            pass
        click.echo(f"conversation mode: {COMMANDS_HELP}; end a line with \\ to continue it; "
                   "Ctrl-C stops a reply", err=True)
    conversation = Conversation(engine, params, system, thinking)
    turn = first_turn
    while True:
        if turn is None:
            turn = read_turn(is_tty)
            if turn is None:
                if is_tty:
                    click.echo("")
                return
        command = turn.strip()
        if command in ("/exit", "/quit"):
            return
        if command == "/clear":
            conversation.clear()
            click.echo("(a new conversation)", err=True)
        elif command == "/help":
            for name, what in COMMANDS.items():
                click.echo(f"{name}: {what}", err=True)
        elif command:
            try:
                conversation.reply(turn)
            except StrataError as e:  # this turn's; the conversation goes on
                click.echo(f"error: {e}", err=True)
        turn = None
