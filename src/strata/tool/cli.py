"""`strata-tool`: maintenance commands."""
import click


@click.group()
def main():
    """Strata maintenance tool."""
