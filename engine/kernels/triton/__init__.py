"""Triton kernels for the GPU."""
