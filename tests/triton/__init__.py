"""Triton kernels (cutile_norms/triton/)."""
