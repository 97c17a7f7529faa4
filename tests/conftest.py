"""Shared fixtures. GPU tests are marked `cuda` and skip without a driver."""
import functools
import gc
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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test not marked `cuda` is a CPU test. On a machine with a GPU, `--device auto` (the
    engine's default) would take the GPU: 54 such tests failed on the device's H100 host
    (session 96), with the GPU's last bits against the CPU's and PyCUDA's objects collected in
    later tests. Here auto finds no GPU, in this process (the backend's probe) and in the
    servers and commands the test starts (CUDA_VISIBLE_DEVICES=""). This wraps the test's
    whole protocol, not only its function-scoped fixtures: a module's server fixture is built
    in its first test's setup (session 97: with an autouse fixture doing it, 12 failures and
    errors were left, in modules with such servers and in tests that ran after them)."""
    if not _has_cuda():
        yield
        return
    if "cuda" in item.keywords:
        yield
        # what the GPU test left in reference cycles (a CudaModel and its page-locked buffers)
        # is freed now, in this thread, with its context; left to a later collection it was
        # freed in whichever thread ran one (session 98: test_device_memory_offline's cycle
        # collected in an "io-thread" took a CudaModel with it, and PyCUDA's "out-of-thread
        # context could not be cleaned up" failed that test)
        gc.collect()
        return
    from strata.backends import cuda

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUDA_VISIBLE_DEVICES", "")
        # the name the engine (backends/select.py) and calibrate ask; runtime's own stays real
        # for the tests of the probe itself (test_cuda_offline.py)
        patch.setattr(cuda, "unavailable_reason", lambda: "tests not marked cuda run on the CPU")
        yield


def pytest_collection_modifyitems(config, items):
    if any("cuda" in item.keywords for item in items) and not _has_cuda():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU with a driver")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)
