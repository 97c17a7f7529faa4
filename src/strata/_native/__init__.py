"""Compiled kernels: quantised dot products and the window loop (C with SIMD, Cython wrappers)."""
