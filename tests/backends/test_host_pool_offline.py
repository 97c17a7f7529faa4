"""host_pool.PinnedPool without a GPU driver: a lease is refused (the park copies through
memory of its own), once logged."""
import logging

from strata.backends.cuda.host_pool import PinnedPool


def test_without_a_driver_a_lease_is_refused_and_logged_once(caplog):
    pool = PinnedPool(rt=None)
    with caplog.at_level(logging.INFO, "strata.backends.cuda.host_pool"):
        assert pool.lease(1 << 20) is None and pool.lease(1 << 20) is None
    assert caplog.text.count("refused") == 1
    assert pool.idle_bytes == pool.leased_bytes == 0
