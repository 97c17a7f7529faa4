"""Compute backends: the CPU (numpy + native kernels) and CUDA (PyCUDA)."""
