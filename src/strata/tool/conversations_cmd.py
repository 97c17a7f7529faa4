"""`strata-tool conversations`: the conversation files in a folder (`--conversation-cache-dir`,
or `--slot-save-path`): each one's tokens, size, last use and model, and `--clear` to delete
them (only one model's with `--model`)."""
from __future__ import annotations

import time
from pathlib import Path

import click

from strata.errors import StrataError


@click.command()
@click.argument("folder", default="auto", metavar="[DIR|auto]")
@click.option("--model", "model_path", default=None, type=click.Path(dir_okay=False),
              help="Mark the files of this GGUF model (and with --clear, delete only those).")
@click.option("--clear", is_flag=True, help="Delete the files listed.")
def conversations(folder, model_path, clear):
    """List the conversation files in DIR (auto: Strata's cache folder's conversations/)."""
    from strata.engine.conversation_disk import model_fingerprint
    from strata.engine.kv_file import KVFileError, read_kv_header
    from strata.model.gguf_file import GGUFModel
    from strata.user_cache import cache_dir

    path = cache_dir() / "conversations" if folder == "auto" else Path(folder).expanduser()
    if folder == "auto" and not path.exists():  # no server has written any here yet
        click.echo(f"0 conversation files in {path} (none written yet: `strata serve "
                   "--conversation-cache-dir auto` writes them there)")
        return
    if not path.is_dir():
        click.echo(f"error: {str(path)!r} is not a folder; give the --conversation-cache-dir "
                   "or --slot-save-path folder of a server", err=True)
        raise SystemExit(2)
    fingerprint = None
    if model_path is not None:
        try:
            with GGUFModel.open(model_path) as model:
                fingerprint = model_fingerprint(model)
        except (StrataError, OSError) as exc:
            click.echo(f"error: {exc}", err=True)
            raise SystemExit(2)
    rows, total, skipped, undeleted = [], 0, 0, []
    for file in sorted(p for p in path.iterdir() if p.is_file()):
        try:
            header = read_kv_header(file)
            stat = file.stat()
        except (KVFileError, FileNotFoundError):
            # not one of ours, or cut short (the server skips it too), or since evicted by it
            skipped += 1
            continue
        mine = fingerprint is None or header.get("model") == fingerprint
        if clear and not mine:
            continue
        if clear:
            try:
                file.unlink(missing_ok=True)  # a running server may have evicted it meanwhile
            except OSError as exc:
                undeleted.append(f"error: cannot delete {file}: {exc.strerror or exc}")
                continue
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(stat.st_mtime))
        whose = "" if fingerprint is None else ("  this model" if mine else "  another model")
        rows.append(f"{file.name:<48} {header['num_tokens']:>8} tokens {stat.st_size / 2**30:7.2f}"
                    f" GiB  used {used}  model {str(header.get('model', '?'))[:12]}{whose}")
        total += stat.st_size
    for row in rows:
        click.echo(row)
    verb = "deleted from" if clear else "in"
    click.echo(f"{len(rows)} conversation files {verb} {path} ({total / 2**30:.2f} GiB)"
               + (f"; {skipped} other files left alone" if skipped else ""))
    if undeleted:
        click.echo("\n".join(undeleted), err=True)
        raise SystemExit(2)
