"""Our own causal attention for packed variable-length rows with grouped KV heads, in Triton:
the candidate that issue 5.3 asks to measure against PyTorch's kernel. Off by default
(``SOLUTION_ATTN_TRITON=1`` turns it on) until a GPU measurement says it wins.

1. What it replaces. On the default path (``SOLUTION_ATTN_VARLEN``, solution/kernels/attn_varlen.py)
   attention is PyTorch's memory-efficient kernel in its variable-length mode, fed by our layout
   kernel, which also repeats the 2 KV heads to the 12 query heads (6 copies of K and V) and
   casts to fp16. H200 profile of 2026-11-30 03:38 UTC, steps 3-64: attention forward 0.040 s,
   backward 0.140 s (PyTorch's ``fmha_cutlassB``), plus the repeat / cast launches.

2. Why that could be beaten. The repeated K/V are 6x the memory traffic of the real ones, and the
   backward of the repeat sums 6 gradient copies. PyTorch's kernel is the T4-era CUTLASS kernel
   (sm_80 code paths), and its backward may split the key dimension and sum with atomics (not
   reproducible run to run). The kernel here reads each KV head where the query heads are
   (head h uses KV head h // groups), never copies it, and computes dK / dV of a KV head by
   looping over its query heads inside one program: no atomics, bitwise reproducible.

3. What it does. The rows of the batch are packed: row b owns tokens cu_seqlens[b] ..
   cu_seqlens[b+1]-1, and a token attends to the tokens of its own row up to itself.
   - forward (``_attn_fwd_kernel``): one program per (block of BLOCK_M queries, row, query head);
     it walks the key blocks up to the causal limit keeping a running max and running sum (the
     "online softmax": rescale what was accumulated whenever the max grows), and writes the
     output (fp16) and the log-sum-exp of every query (fp32, base 2) for the backward;
   - backward: ``_attn_bwd_delta_kernel`` computes delta = rowsum(dO * O);
     ``_attn_bwd_dkdv_kernel``: one program per (block of BLOCK_N keys, row, KV head) recomputes
     the probabilities P = exp2(S - lse) of every query head of its group and every query that can
     see those keys, and sums dV = P^T dO and dK = scale * dS^T Q with dS = P * (dO V^T - delta);
     ``_attn_bwd_dq_kernel``: one program per (block of queries, row, query head) sums
     dQ = scale * dS K over the keys it sees.
   Matrix products are ``tl.dot`` on fp16 operands with fp32 accumulation; P and dS are rounded to
   fp16 before their products (as flash-style kernels do), the softmax statistics stay fp32.

4. Correctness risks. The result is not PyTorch's bits: another summation order and P / dS
   rounded to fp16, so it agrees with an fp64 reference to fp16 accuracy, as PyTorch's kernel does
   (tests/test_attn_triton.py: forward and all three gradients against fp64 on random inputs,
   rows of length 1, lengths that are not multiples of the blocks, 1 and 2 query heads per KV
   head, in the CPU interpreter; the same at the model's shape on a GPU). fp16 only (the T4 path);
   fp32 / bf16 inputs and attention dropout keep PyTorch's kernel. On a T4 with Triton >= 3.3,
   ``tl.dot`` runs without tensor cores (field notes), which likely makes this slower there than
   PyTorch's kernel even if it wins on the H200: the choice must be measured per machine.
   Shared memory: the T4's 64 KB fits the sm_75 configurations (smaller backward blocks), checked
   by solution/kernels/sm75_check.py.

5. How it was measured. H200 taking the T4's paths, 2026-11-30: GPU tests pass; whole training
   (``VARIANTS="default triton=SOLUTION_ATTN_TRITON=1" bash scripts/gpu_run.sh variants``), steps
   3-64: GPU time 1.531 s against 1.488 s with PyTorch's kernel, peak 5.17 against 5.40 GiB. Slower,
   so off by default (docs/kernels/attn_triton.md, section 5).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from solution.env import flag, interpreter_enabled
from solution.kernels._launches import cdiv, launch

ENV = "SOLUTION_ATTN_TRITON"
LOG2E = 1.4426950408889634


def enabled() -> bool:
    """Off by default until measured on a GPU; $SOLUTION_ATTN_TRITON=1 turns it on."""
    return flag(ENV)


def supported(head_dim: int, q_heads: int, kv_heads: int, dtype: torch.dtype, device: torch.device) -> bool:
    """fp16 (the T4 path), head dim a power of two in 16..128, query heads a multiple of KV heads,
    on a device our kernels run on."""
    on_kernel_device = (device.type == "cuda" and not interpreter_enabled()) or (
        device.type == "cpu" and interpreter_enabled())
    return (on_kernel_device and dtype == torch.float16 and 16 <= head_dim <= 128
            and head_dim & (head_dim - 1) == 0 and kv_heads > 0 and q_heads % kv_heads == 0)


def _configs(device: torch.device) -> dict:
    """Block sizes: (BLOCK_M, BLOCK_N, num_warps) of the forward, dK/dV and dQ kernels."""
    if device.type != "cuda":
        return {"fwd": (16, 16, 1), "dkdv": (16, 16, 1), "dq": (16, 16, 1)}
    return _cuda_configs(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_configs(index: int) -> dict:
    """_configs on CUDA device ``index``: the capability is asked once per device, not per call."""
    if torch.cuda.get_device_capability(index) < (8, 0):  # T4: 64 KB of shared memory per block
        return {"fwd": (64, 32, 4), "dkdv": (32, 32, 4), "dq": (32, 32, 4)}
    # Not tuned (measured once on the H200, 2026-11-30: GPU time close to PyTorch's kernel). dK/dV: one program per (key block, row, KV head) is only
    # 2 KV heads x 4 rows x 512 / BLOCK_N programs, so its key blocks are 32 wide (128 programs for a
    # row of 512, about one per H200 SM) rather than 64 (64 programs). dQ keeps a [64, 128] fp32
    # accumulator next to the Q / dO tiles: 8 warps to leave registers for the rest.
    return {"fwd": (64, 64, 4), "dkdv": (64, 32, 4), "dq": (64, 64, 8)}


@triton.jit
def _row_span(cu_ptr, row):
    """(first token, length) of packed row ``row``."""
    start = tl.load(cu_ptr + row)
    return start, tl.load(cu_ptr + row + 1) - start


@triton.jit
def _tile_ptrs(ptr, tok, head, s_n, s_h, D: tl.constexpr):
    """Pointers to the [len(tok), D] tile of tokens ``tok`` (int64) of head ``head``."""
    return ptr + tok[:, None] * s_n + head * s_h + tl.arange(0, D)[None, :]


@triton.jit
def _load_tile(ptr, tok, head, s_n, s_h, ok, D: tl.constexpr):
    return tl.load(_tile_ptrs(ptr, tok, head, s_n, s_h, D), mask=ok[:, None], other=0.0)


@triton.jit
def _block(b0, start, length, BLOCK: tl.constexpr):
    """(positions within the row, in-row mask, int64 token indices) of the block starting at b0."""
    offs = b0 + tl.arange(0, BLOCK)
    return offs, offs < length, (start + offs).to(tl.int64)


@triton.jit
def _row_stats(lse_ptr, delta_ptr, h, n_total, tok, ok):
    """(lse, delta) of head h at tokens ``tok`` (fp32; 0 outside the row)."""
    base = h.to(tl.int64) * n_total + tok
    return tl.load(lse_ptr + base, mask=ok, other=0.0), tl.load(delta_ptr + base, mask=ok, other=0.0)


@triton.jit
def _bwd_tile(q, k, v, do, lse, delta, offs_m, offs_n, m_ok, n_ok, scale_log2):
    """(P, dS) of one [M, N] tile: P = exp2(S - lse) where a query sees a key (0 elsewhere),
    dS = P * (dO V^T - delta), the gradient of the (natural-log) logits."""
    s = tl.dot(q, tl.trans(k)) * scale_log2
    seen = (offs_n[None, :] <= offs_m[:, None]) & n_ok[None, :] & m_ok[:, None]
    p = tl.where(seen, tl.math.exp2(s - lse[:, None]), 0.0)
    return p, p * (tl.dot(do, tl.trans(v)) - delta[:, None])


@triton.jit
def _attn_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, cu_ptr, scale_log2, n_total,
                     sq_n, sq_h, sk_n, sk_h, so_n, so_h,
                     GROUPS: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     KV_BLOCKS: tl.constexpr):
    """One block of BLOCK_M queries of one row and one query head. KV_BLOCKS: key blocks of the
    longest row (rounded up to a power of two); blocks past this row's causal limit are skipped
    (a loop with a constant trip count: Triton's CPU interpreter cannot run loops whose bounds are
    computed in the kernel)."""
    mblk = tl.program_id(0)
    h = tl.program_id(2)
    start, length = _row_span(cu_ptr, tl.program_id(1))
    if mblk * BLOCK_M < length:
        kvh = h // GROUPS
        offs_m, m_ok, tok_m = _block(mblk * BLOCK_M, start, length, BLOCK_M)  # this program's queries
        q = _load_tile(q_ptr, tok_m, h, sq_n, sq_h, m_ok, D)
        run_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        run_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        kv_end = tl.minimum((mblk + 1) * BLOCK_M, length)  # causal: no key after the last query
        for i in range(KV_BLOCKS):
            n0 = i * BLOCK_N
            if n0 < kv_end:
                offs_n, n_ok, tok_n = _block(n0, start, length, BLOCK_N)
                k = _load_tile(k_ptr, tok_n, kvh, sk_n, sk_h, n_ok, D)
                s = tl.dot(q, tl.trans(k)) * scale_log2  # [M, N], base-2 logits
                s = tl.where((offs_n[None, :] <= offs_m[:, None]) & n_ok[None, :], s, float("-inf"))
                # key 0 is seen by every query, so the max is finite from the first block on
                new_max = tl.maximum(run_max, tl.max(s, 1))
                rescale = tl.math.exp2(run_max - new_max)
                p = tl.math.exp2(s - new_max[:, None])
                run_sum = run_sum * rescale + tl.sum(p, 1)
                v = _load_tile(v_ptr, tok_n, kvh, sk_n, sk_h, n_ok, D)
                acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
                run_max = new_max
        out = acc / run_sum[:, None]
        tl.store(_tile_ptrs(o_ptr, tok_m, h, so_n, so_h, D), out.to(o_ptr.dtype.element_ty), mask=m_ok[:, None])
        tl.store(lse_ptr + h.to(tl.int64) * n_total + tok_m, run_max + tl.math.log2(run_sum), mask=m_ok)


@triton.jit
def _attn_bwd_delta_kernel(o_ptr, do_ptr, delta_ptr, n_total, so_n, so_h, sdo_n, sdo_h,
                           D: tl.constexpr, BLOCK: tl.constexpr):
    """delta[h, t] = sum_d dO[t, h, d] * O[t, h, d] (fp32) for BLOCK tokens of one head."""
    h = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_total
    tok = offs.to(tl.int64)
    o = _load_tile(o_ptr, tok, h, so_n, so_h, ok, D)
    do = _load_tile(do_ptr, tok, h, sdo_n, sdo_h, ok, D)
    tl.store(delta_ptr + h.to(tl.int64) * n_total + tok, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=ok)


@triton.jit
def _attn_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, cu_ptr,
                          scale, scale_log2, n_total, sq_n, sq_h, sk_n, sk_h, sdo_n, sdo_h,
                          GROUPS: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          Q_BLOCKS: tl.constexpr):
    """dK, dV of BLOCK_N keys of one row and one KV head, summed over the GROUPS query heads that
    read this KV head and over every query that sees these keys (no atomics)."""
    nblk = tl.program_id(0)
    kvh = tl.program_id(2)
    start, length = _row_span(cu_ptr, tl.program_id(1))
    if nblk * BLOCK_N < length:
        offs_n, n_ok, tok_n = _block(nblk * BLOCK_N, start, length, BLOCK_N)
        k = _load_tile(k_ptr, tok_n, kvh, sk_n, sk_h, n_ok, D)
        v = _load_tile(v_ptr, tok_n, kvh, sk_n, sk_h, n_ok, D)
        dk = tl.zeros([BLOCK_N, D], tl.float32)
        dv = tl.zeros([BLOCK_N, D], tl.float32)
        first_m = (nblk * BLOCK_N // BLOCK_M) * BLOCK_M  # the first query block that sees these keys
        for g in tl.static_range(GROUPS):
            h = kvh * GROUPS + g
            for i in range(Q_BLOCKS):
                m0 = i * BLOCK_M
                if (m0 >= first_m) & (m0 < length):
                    offs_m, m_ok, tok_m = _block(m0, start, length, BLOCK_M)
                    q = _load_tile(q_ptr, tok_m, h, sq_n, sq_h, m_ok, D)
                    do = _load_tile(do_ptr, tok_m, h, sdo_n, sdo_h, m_ok, D)
                    lse, delta = _row_stats(lse_ptr, delta_ptr, h, n_total, tok_m, m_ok)
                    p, ds = _bwd_tile(q, k, v, do, lse, delta, offs_m, offs_n, m_ok, n_ok, scale_log2)
                    dv += tl.dot(tl.trans(p.to(do.dtype)), do)
                    dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
        tl.store(_tile_ptrs(dk_ptr, tok_n, kvh, sk_n, sk_h, D), (dk * scale).to(dk_ptr.dtype.element_ty),
                 mask=n_ok[:, None])
        tl.store(_tile_ptrs(dv_ptr, tok_n, kvh, sk_n, sk_h, D), dv.to(dv_ptr.dtype.element_ty), mask=n_ok[:, None])


@triton.jit
def _attn_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, cu_ptr,
                        scale, scale_log2, n_total, sq_n, sq_h, sk_n, sk_h, sdo_n, sdo_h,
                        GROUPS: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        KV_BLOCKS: tl.constexpr):
    """dQ of BLOCK_M queries of one row and one query head, over the keys they see."""
    mblk = tl.program_id(0)
    h = tl.program_id(2)
    start, length = _row_span(cu_ptr, tl.program_id(1))
    if mblk * BLOCK_M < length:
        kvh = h // GROUPS
        offs_m, m_ok, tok_m = _block(mblk * BLOCK_M, start, length, BLOCK_M)
        q = _load_tile(q_ptr, tok_m, h, sq_n, sq_h, m_ok, D)
        do = _load_tile(do_ptr, tok_m, h, sdo_n, sdo_h, m_ok, D)
        lse, delta = _row_stats(lse_ptr, delta_ptr, h, n_total, tok_m, m_ok)
        dq = tl.zeros([BLOCK_M, D], tl.float32)
        kv_end = tl.minimum((mblk + 1) * BLOCK_M, length)
        for i in range(KV_BLOCKS):
            n0 = i * BLOCK_N
            if n0 < kv_end:
                offs_n, n_ok, tok_n = _block(n0, start, length, BLOCK_N)
                k = _load_tile(k_ptr, tok_n, kvh, sk_n, sk_h, n_ok, D)
                v = _load_tile(v_ptr, tok_n, kvh, sk_n, sk_h, n_ok, D)
                _, ds = _bwd_tile(q, k, v, do, lse, delta, offs_m, offs_n, m_ok, n_ok, scale_log2)
                dq += tl.dot(ds.to(k.dtype), k)
        tl.store(_tile_ptrs(dq_ptr, tok_m, h, sq_n, sq_h, D), (dq * scale).to(dq_ptr.dtype.element_ty),
                 mask=m_ok[:, None])


def _blocks(max_len: int, block: int) -> int:
    """Blocks of ``block`` covering the longest row, its length rounded up to a power of two (so
    that a run compiles a few variants, not one per length: 6 for rows of 16..512 tokens)."""
    return cdiv(1 << max(max_len - 1, 0).bit_length(), block) if max_len > 0 else 0


def _check(q, k, v):
    if not (q.dim() == k.dim() == v.dim() == 3 and k.shape == v.shape and q.shape[0] == k.shape[0]
            and q.shape[2] == k.shape[2] and q.shape[1] % k.shape[1] == 0):
        raise ValueError(f"attn_triton: want q [N, Hq, D], k / v [N, Hkv, D], Hq a multiple of Hkv; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not all(t.stride(-1) == 1 for t in (q, k, v)) or k.stride() != v.stride():
        raise ValueError("attn_triton: the last dimension must be contiguous and k, v laid out alike")


class TritonVarlenAttention(torch.autograd.Function):
    """q [N, Hq, D], k / v [N, Hkv, D] (fp16, packed rows) -> out [N, Hq, D] fp16."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_len, scale):
        _check(q, k, v)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # no copies for the packed layout's tensors
        n, hq, d = q.shape
        groups = hq // k.shape[1]
        rows = cu_seqlens.numel() - 1
        out = torch.empty_like(q)
        lse = torch.empty((hq, n), dtype=torch.float32, device=q.device)
        cfg = _configs(q.device)
        bm, bn, warps = cfg["fwd"]
        if n:
            launch(_attn_fwd_kernel, (cdiv(max_len, bm), rows, hq), "_attn_fwd_kernel",
                   q, k, v, out, lse, cu_seqlens, scale * LOG2E, n, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                   out.stride(0), out.stride(1), GROUPS=groups, D=d, BLOCK_M=bm, BLOCK_N=bn,
                   KV_BLOCKS=_blocks(max_len, bn), num_warps=warps, num_stages=1)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.max_len, ctx.scale, ctx.groups = max_len, scale, groups
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        dout = dout.to(q.dtype)
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        n, hq, d = q.shape
        rows = cu_seqlens.numel() - 1
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        if n:
            cfg = _configs(q.device)
            delta = torch.empty((hq, n), dtype=torch.float32, device=q.device)
            block = 64 if q.device.type == "cuda" else 16
            launch(_attn_bwd_delta_kernel, (cdiv(n, block), hq), "_attn_bwd_delta_kernel",
                   out, dout, delta, n, out.stride(0), out.stride(1), dout.stride(0), dout.stride(1),
                   D=d, BLOCK=block, num_warps=4 if q.device.type == "cuda" else 1)
            strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), dout.stride(0), dout.stride(1))
            bm, bn, warps = cfg["dkdv"]
            launch(_attn_bwd_dkdv_kernel, (cdiv(ctx.max_len, bn), rows, k.shape[1]), "_attn_bwd_dkdv_kernel",
                   q, k, v, dout, lse, delta, dk, dv, cu_seqlens, ctx.scale, ctx.scale * LOG2E, n, *strides,
                   GROUPS=ctx.groups, D=d, BLOCK_M=bm, BLOCK_N=bn, Q_BLOCKS=_blocks(ctx.max_len, bm),
                   num_warps=warps, num_stages=1)
            bm, bn, warps = cfg["dq"]
            launch(_attn_bwd_dq_kernel, (cdiv(ctx.max_len, bm), rows, hq), "_attn_bwd_dq_kernel",
                   q, k, v, dout, lse, delta, dq, cu_seqlens, ctx.scale, ctx.scale * LOG2E, n, *strides,
                   GROUPS=ctx.groups, D=d, BLOCK_M=bm, BLOCK_N=bn, KV_BLOCKS=_blocks(ctx.max_len, bn),
                   num_warps=warps, num_stages=1)
        return dq, dk, dv, None, None, None


def triton_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_len: int, scale: float) -> torch.Tensor:
    """Causal attention within each packed row (rows from ``cu_seqlens``, int32 [rows + 1]),
    query head h reading KV head h // (Hq / Hkv). q [N, Hq, D], k / v [N, Hkv, D] fp16 with a
    contiguous last dimension (k and v with the same strides). Returns [N, Hq, D] fp16."""
    return TritonVarlenAttention.apply(q, k, v, cu_seqlens, max_len, scale)


def sm75_specs():
    """The sm_75 launch configurations (T4 block sizes), head dim 128, 6 query heads per KV head."""
    bm, bn, warps = 64, 32, 4
    common = {"cu_ptr": "*i32", "n_total": "i32", "scale_log2": "fp32"}
    strides = {name: "i32" for name in ("sq_n", "sq_h", "sk_n", "sk_h")}
    yield {"name": f"attn_fwd D128 G6 {bm}x{bn} w{warps}", "fn": _attn_fwd_kernel, "num_warps": warps,
           "signature": {"q_ptr": "*fp16", "k_ptr": "*fp16", "v_ptr": "*fp16", "o_ptr": "*fp16", "lse_ptr": "*fp32",
                         **common, **strides, "so_n": "i32", "so_h": "i32",
                         "GROUPS": "constexpr", "D": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
                         "KV_BLOCKS": "constexpr"},
           "constexprs": {"GROUPS": 6, "D": 128, "BLOCK_M": bm, "BLOCK_N": bn, "KV_BLOCKS": 16}}
    yield {"name": "attn_bwd_delta D128 B64 w4", "fn": _attn_bwd_delta_kernel, "num_warps": 4,
           "signature": {"o_ptr": "*fp16", "do_ptr": "*fp16", "delta_ptr": "*fp32", "n_total": "i32",
                         "so_n": "i32", "so_h": "i32", "sdo_n": "i32", "sdo_h": "i32",
                         "D": "constexpr", "BLOCK": "constexpr"},
           "constexprs": {"D": 128, "BLOCK": 64}}
    bwd_sig = {"q_ptr": "*fp16", "k_ptr": "*fp16", "v_ptr": "*fp16", "do_ptr": "*fp16", "lse_ptr": "*fp32",
               "delta_ptr": "*fp32", **common, "scale": "fp32", **strides, "sdo_n": "i32", "sdo_h": "i32",
               "GROUPS": "constexpr", "D": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr"}
    yield {"name": "attn_bwd_dkdv D128 G6 32x32 w4", "fn": _attn_bwd_dkdv_kernel, "num_warps": 4,
           "signature": {**bwd_sig, "dk_ptr": "*fp16", "dv_ptr": "*fp16", "Q_BLOCKS": "constexpr"},
           "constexprs": {"GROUPS": 6, "D": 128, "BLOCK_M": 32, "BLOCK_N": 32, "Q_BLOCKS": 16}}
    yield {"name": "attn_bwd_dq D128 G6 32x32 w4", "fn": _attn_bwd_dq_kernel, "num_warps": 4,
           "signature": {**bwd_sig, "dq_ptr": "*fp16", "KV_BLOCKS": "constexpr"},
           "constexprs": {"GROUPS": 6, "D": 128, "BLOCK_M": 32, "BLOCK_N": 32, "KV_BLOCKS": 16}}
