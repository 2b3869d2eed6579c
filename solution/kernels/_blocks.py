"""Masked-only-at-the-end loads and stores for the element-wise kernels. Their sizes are not
specialized (``do_not_specialize``), so Triton cannot prove a mask ``offs < n`` whole and compiles
each masked access to one element per instruction; unmasked accesses of a contiguous, 16-byte
aligned block compile to 128-bit ones. The kernels call their body under ``if start + BLOCK <= n``
(MASKED False, every block but the last) / else (MASKED True); both give the same values.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_block(ptr, mask, other, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptr, mask=mask, other=other)
    return tl.load(ptr)


@triton.jit
def store_block(ptr, value, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr, value, mask=mask)
    else:
        tl.store(ptr, value)
