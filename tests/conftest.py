"""Shared fixtures. GPU tests are marked `cuda` and skip without a driver."""
import os

import pytest

os.environ.setdefault("STRATA_DISABLE_PLUGIN_AUTOLOAD", "1")


@pytest.fixture(scope="module")
def one_kernel_thread():
    """One CPU kernel thread for the module's tests (fast and steady on a busy shared machine);
    a module asks for it with `pytestmark = pytest.mark.usefixtures("one_kernel_thread")`."""
    from strata._native import kernels

    before = kernels.get_num_threads()
    kernels.set_num_threads(1)
    yield
    kernels.set_num_threads(before)


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
