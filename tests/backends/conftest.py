"""Shared setup of the CPU-backend tests."""
import pytest

from strata._native import kernels


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One kernel thread by default (fast and steady on a busy shared machine); tests of the
    threaded path set their own count."""
    before = kernels.get_num_threads()
    kernels.set_num_threads(1)
    yield
    kernels.set_num_threads(before)
