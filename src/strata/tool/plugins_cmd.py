"""`strata-tool plugins`: the loaded plugins and the implementation each hook resolves to."""
from __future__ import annotations

import click

from strata.errors import StrataError


@click.command()
@click.option("--no-autoload", is_flag=True,
              help="List only the built-in defaults (as with STRATA_DISABLE_PLUGIN_AUTOLOAD=1).")
def plugins(no_autoload):
    """List loaded plugins and which implementation each hook resolves to."""
    from strata.plugins import describe_hooks, describe_plugins, get_plugin_manager

    try:
        pm = get_plugin_manager(autoload=False if no_autoload else None)
    except StrataError as exc:
        click.echo(f"error: {exc}", err=True)
        raise SystemExit(2)
    click.echo("plugins:")
    for name, origin in describe_plugins(pm):
        click.echo(f"  {name:<24} {origin}")
    click.echo("hooks:")
    for hook_name, resolution in describe_hooks(pm):
        click.echo(f"  {hook_name:<24} {resolution}")


if __name__ == "__main__":
    plugins()
