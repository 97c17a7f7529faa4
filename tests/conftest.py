"""Shared fixtures. GPU tests are marked `cuda` and skip without a driver."""
import os

import pytest

os.environ.setdefault("STRATA_DISABLE_PLUGIN_AUTOLOAD", "1")


def _has_cuda() -> bool:
    try:
        import pycuda.driver as drv

        drv.init()
        return drv.Device.count() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if any("cuda" in item.keywords for item in items) and not _has_cuda():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU with a driver")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)
