"""Command-line options shared by `strata run` and `strata serve`: the slots and prompt reading."""
from __future__ import annotations

import click

from strata.config import MAX_PARALLEL


def slot_options(command):
    """Add --parallel, --read-chunk and --conversation-cache-mib (passed as `parallel`,
    `read_chunk` and `conversation_cache_mib`)."""
    command = click.option(
        "--conversation-cache-mib", default=2048.0, show_default=True,
        type=click.FloatRange(min=0),
        help="Host RAM for KV of conversations moved out of their slot (0: none kept).")(command)
    command = click.option(
        "--read-chunk", default=512, show_default=True, type=click.IntRange(min=1),
        help="Prompt tokens read per window; other slots decode between chunks.")(command)
    command = click.option(
        "--parallel", "-np", default=1, show_default=True,
        type=click.IntRange(1, MAX_PARALLEL),
        help="Slots: requests decoded together in one forward pass.")(command)
    return command
