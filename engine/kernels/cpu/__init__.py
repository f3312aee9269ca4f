"""The CPU kernels: C++ sources built on first use, their Python entry points, the linear layers
over packed weights, and memory tuning."""
