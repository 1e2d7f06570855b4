"""Kernels: torch references (`ref`) and, on GPUs, Triton fast paths chosen once by `backend`."""

from dsv41.kernels.ref import sparse_attn_ref

sparse_attn = sparse_attn_ref

__all__ = ["sparse_attn", "sparse_attn_ref"]
