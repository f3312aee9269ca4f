"""Conveyor's own kernels: C++ for the CPU, Triton for the GPU."""
