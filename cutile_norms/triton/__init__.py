"""Triton kernels: the fallback for AMD GPUs and for NVIDIA GPUs without cuTile / CuTe DSL."""
