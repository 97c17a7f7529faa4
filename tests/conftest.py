"""Shared fixtures. GPU tests are marked `cuda` and skip without a driver."""
import functools
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


@functools.cache
def _has_cuda() -> bool:
    try:
        import pycuda.driver as drv

        drv.init()
        return drv.Device.count() > 0
    except Exception:
        return False


@pytest.fixture(autouse=True)
def _unmarked_tests_run_on_the_cpu(request, monkeypatch):
    """A test not marked `cuda` is a CPU test. On a machine with a GPU, `--device auto` (the
    engine's default) would take the GPU, and 54 such tests failed on the device's H100 host
    (session 96; likely its last bits against the CPU's, and 14 workers sharing its memory).
    Here auto finds no GPU, in this process (the backend's probe) and in the servers and
    commands the test starts (CUDA_VISIBLE_DEVICES="")."""
    if "cuda" not in request.node.keywords and _has_cuda():
        from strata.backends import cuda

        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        monkeypatch.setattr(cuda, "unavailable_reason",
                            lambda: "tests not marked cuda run on the CPU")
    yield


def pytest_collection_modifyitems(config, items):
    if any("cuda" in item.keywords for item in items) and not _has_cuda():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU with a driver")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)
