"""The CUDA backend: the whole model on one GPU (PyCUDA context and memory, `.cu` kernels
launched through the driver API, decode windows replayed as CUDA graphs)."""
from strata.backends.cuda.kv import CudaKV
from strata.backends.cuda.model import CudaModel
from strata.backends.cuda.runtime import is_available, unavailable_reason

__all__ = ["CudaKV", "CudaModel", "is_available", "unavailable_reason"]
