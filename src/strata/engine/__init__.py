"""Requests, sequences, the KV cache, sampling and the generation loop."""
