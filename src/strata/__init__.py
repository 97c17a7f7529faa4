"""Strata: an inference server for Mixture-of-Experts models larger than the GPU."""

__version__ = "0.1.0"
