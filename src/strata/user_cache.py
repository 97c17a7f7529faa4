"""The user's cache folder: what Strata measures or learns about a model on this machine and
keeps between runs (the calibrated PCIe share, stored routing profiles)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$STRATA_CACHE_DIR, else $XDG_CACHE_HOME/strata, else ~/.cache/strata."""
    if os.environ.get("STRATA_CACHE_DIR"):
        return Path(os.environ["STRATA_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "strata"
