"""`strata-tool pack MODEL OUT`: write a model's expert pack (experts contiguous and aligned)."""
from __future__ import annotations

import click

from strata.errors import StrataError
from strata.tool.output import output_target


@click.command()
@click.argument("model_path", metavar="MODEL", type=click.Path(dir_okay=False))
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--quiet", is_flag=True, help="No progress bar.")
def pack(model_path, out, quiet):
    """Write the expert pack of the GGUF model MODEL to OUT: each (layer, expert)'s gate, up
    and down blocks contiguous and 4096-aligned, with an index (serve it with the model). An
    existing OUT is replaced once the new pack is whole."""
    from strata.experts.pack import ExpertPack, write_pack
    from strata.model.gguf_file import GGUFModel

    try:
        target = output_target(out)
        with GGUFModel.open(model_path) as model:
            nbytes = write_pack(model, target, progress=not quiet)
            packed = ExpertPack.open(target, model)  # read back: the header, index and size
            description = packed.describe()
            packed.close()
    except StrataError as exc:
        click.echo(f"error: {exc}", err=True)
        raise SystemExit(2)
    except OSError as exc:
        click.echo(f"error: cannot pack {model_path} into {out}: {exc.strerror or exc}",
                   err=True)
        raise SystemExit(2)
    click.echo(f"wrote {out}: {nbytes} bytes ({nbytes / 2**20:.1f} MiB), {description}")
