"""Scaled GEMMs: the dispatch per device (torch's kernels, Triton, the exact CPU upcast)."""
