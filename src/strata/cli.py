"""`strata`: run, serve, bench."""
import click


@click.group()
def main():
    """Strata: Mixture-of-Experts inference."""
