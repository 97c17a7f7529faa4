"""Strata: an inference server for Mixture-of-Experts models larger than the GPU."""

__version__ = "0.1.0"

import os as _os

# The native kernels own the cores (OpenMP). numpy's OpenBLAS threads, used only for attention
# products, keep spinning after each call and take those cores from the kernels: measured on
# 2 cores, prompt 512 went from 94.6 to 145 tokens/s with one BLAS thread. A user's own setting
# wins; this must run before numpy is first imported to take effect.
_os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from strata.config import EngineConfig  # noqa: E402
from strata.engine.sampling import SamplingParams  # noqa: E402
from strata.hookspecs import hookimpl  # noqa: E402


def __getattr__(name: str):
    # The engine pulls in the native kernels; load it only when asked for.
    if name == "Engine":
        from strata.engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'strata' has no attribute {name!r}")


__all__ = ["Engine", "EngineConfig", "SamplingParams", "hookimpl", "__version__"]
