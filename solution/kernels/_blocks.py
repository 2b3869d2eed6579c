"""Masked-only-at-the-end loads and stores for the element-wise kernels (Triton helpers).

The kernels' sizes are not specialized (``do_not_specialize``: the precompile pins one
specialization per signature), so Triton cannot prove that a block's mask ``offs < n`` is whole and
compiles every masked access to one element per instruction. A block that lies inside the tensor
needs no mask: its unmasked accesses of a contiguous, 16-byte-aligned block compile to 128-bit
ones. The kernels call their body twice under ``if start + BLOCK <= n`` (MASKED False, every block
but the last) / else (MASKED True); both are compiled, the values are the same.
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
