"""CuTe DSL kernels (`cutlass.cute`): the tma_smem_cached mode."""
