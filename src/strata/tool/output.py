"""The files `strata-tool` writes: checked before the work starts, written under a temporary
name beside them and renamed when whole, so a failed or interrupted command leaves no file that
looks valid, and an earlier file under the name survives it (a whole new one replaces it)."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

from strata.errors import ConfigError


def output_target(out: str | os.PathLike, inputs=()) -> Path:
    """The file to write for OUT: OUT itself, or the file it links to (a link stays a link).
    ConfigError if OUT is a folder, exists as something other than a regular file (the rename
    would replace a device or a pipe with a plain file), or is one of the `inputs` files."""
    target = Path(os.path.realpath(out))
    if target.is_dir():
        raise ConfigError(f"{out} is a folder; give the path of a file to write")
    if target.exists() and not target.is_file():
        raise ConfigError(f"{out} exists and is not a regular file (a device, pipe or socket); "
                          "writing there would replace it: give the path of a file")
    for path in inputs:
        if target.exists() and os.path.exists(path) and target.samefile(path):
            raise ConfigError(f"{out} is also an input ({path}); give the output another path")
    return target


@contextlib.contextmanager
def replacing(target: Path):
    """Yield a path beside `target` to write (created empty here, so an unwritable folder fails
    before the work, as an OSError); it becomes `target` when the block ends normally and is
    deleted when it raises or is interrupted."""
    partial = target.with_name(target.name + ".partial")
    open(partial, "wb").close()
    try:
        yield partial
        os.replace(partial, target)
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink()
        raise
