"""Shared setup of the CPU-backend tests."""
import pytest


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_kernel_thread):
    """One kernel thread by default (tests/conftest.py); tests of the threaded path set their
    own count."""
