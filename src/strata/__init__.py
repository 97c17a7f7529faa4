"""Strata: an inference server for Mixture-of-Experts models larger than the GPU."""

__version__ = "0.1.0"

from strata.config import EngineConfig  # noqa: E402
from strata.engine.sampling import SamplingParams  # noqa: E402


def __getattr__(name: str):
    # The engine pulls in the native kernels; load it only when asked for.
    if name == "Engine":
        from strata.engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'strata' has no attribute {name!r}")


__all__ = ["Engine", "EngineConfig", "SamplingParams", "__version__"]
