"""How `strata-tool` commands end on input they cannot use: one line on stderr naming what was
wrong, and click's exit status for bad input (no traceback)."""
from __future__ import annotations

import click

from strata.errors import StrataError

# Exit status for input the command cannot use (bad file, bad option value), as click uses it.
EXIT_BAD_INPUT = 2


def fail(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    raise SystemExit(EXIT_BAD_INPUT)


def read_or_fail(read, path):
    """`read(path)`, or the end of the command naming the file and what was wrong with it."""
    try:
        return read(path)
    except StrataError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot read {path}: {exc.strerror or exc}")
