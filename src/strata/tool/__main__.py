"""`python -m strata.tool` runs `strata-tool` (where the console script is not on PATH)."""
from strata.tool.cli import main

main()
