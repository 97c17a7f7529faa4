"""The kernels keep a window's big buffers between windows on glibc (matmul.c,
st_keep_freed_memory), unless the environment sets glibc's malloc thresholds itself."""
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
PROBE = ("import strata._native.kernels as k, numpy as np; print(k.malloc_tuned); "
         # a buffer between the default thresholds and ours, freed and asked for again
         "a = np.ones(8 << 20); del a; b = np.ones(8 << 20); print(float(b.sum()))")


def _probe(**env):
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env},
                         capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_the_kernels_keep_freed_memory_by_default():
    assert _probe() == ["True", str(float(8 << 20))]


@pytest.mark.parametrize("env", [{"MALLOC_TRIM_THRESHOLD_": "1048576"},
                                 {"MALLOC_MMAP_THRESHOLD_": "1048576"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1048576"}])
def test_a_process_that_sets_the_thresholds_keeps_its_own(env):
    assert _probe(**env)[0] == "False"
