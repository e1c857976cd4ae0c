"""Kernels behind the jax_core implementations.

Triton kernels here import only `triton` (never jax-triton or torch), so they can be launched by
jax-triton on a GPU and by tests under Triton's interpreter (TRITON_INTERPRET=1) on the CPU.
"""
