"""Fixtures the native kernel tests share."""
import pytest

from strata._native import kernels


@pytest.fixture
def one_thread():
    """The kernels on one thread for the test (modules opt in with `usefixtures`)."""
    before = kernels.get_num_threads()
    kernels.set_num_threads(1)
    yield
    kernels.set_num_threads(before)
