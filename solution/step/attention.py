"""Attention over packed rows (the step's layer 2): ``sdpa_unpadded`` and the switches that
choose its kernel.

When the attention mask argument is an ``Unpadded`` (solution/step/packing.py), attention runs
on the packed rows: PyTorch's memory-efficient kernel in its variable-length mode
(``cu_seqlens``, causal within each row; solution/kernels/attn_varlen.py), K/V repeated to the 12
query heads by our layout kernel. Where that kernel refuses (``varlen_works``: said once), or for
inputs it does not take, q/k/v go back to the padded [batch, heads, seqlen, dim] layout (zeros at
pads), the same SDPA call as stock runs with ``is_causal=True``, and the real rows of the output
are kept: this also turns off the decoder-layer node and the CUDA graphs (both need the packed
rows). Either way, with right padding a
real query at position t attends to keys 0..t of its row, all real: the set of keys is stock's,
so the values are the same up to the attention kernel's rounding (masked entries are skipped
instead of set to -inf). patches/qwen2_unpad.py routes transformers' "sdpa" entry here.
"""
from __future__ import annotations


import torch

from solution import state
from solution.say import say
from solution.kernels import attn_layout, attn_varlen
from solution.step import packing
from solution.step.packing import packed_layout


def sdpa_unpadded(module, query, key, value, info, dropout=0.0, scaling=None, **kwargs):
    """Attention of packed rows: query [1, Hq, N, D], key/value [1, Hkv, N, D] -> [1, N, Hq, D]
    (the layout stock's sdpa_attention_forward returns). On the packed rows themselves (PyTorch's
    variable-length kernel) where it runs, else through the padded layout (our layout kernels, or
    torch's ops for dtypes the layout kernels do not take)."""
    from transformers.integrations.sdpa_attention import repeat_kv

    dtype = _sdpa_input_dtype(query, key, value)
    if dtype is not None:
        if (varlen_enabled() and dropout == 0.0 and attn_varlen.supported(query) and info.cu_seqlens is not None
                and varlen_works(query.device, dtype, query.shape[-1])):
            try:
                return _sdpa_varlen(module, query, key, value, info, scaling, dtype)
            except torch.cuda.OutOfMemoryError:
                raise  # not a refusal of the kernel: the padded layout would need more memory
            except RuntimeError as exc:  # e.g. a PyTorch build or GPU without the varlen mode
                if _in_graph(info):
                    raise  # a failed CUDA-graph capture, not a refusal of the kernel: the runner falls back
                _varlen_failed(exc)
        return _sdpa_unpadded_kernels(module, query, key, value, info, dropout, scaling, dtype)
    b, s = info.batch, info.seqlen
    _refuse_padded_layout(info)

    def to_padded(t):  # [1, h, N, D] -> [b, h, s, D] (a transposed view of [b, s, h, D], like stock's)
        rows = packing.pad_rows(t.squeeze(0).transpose(0, 1), info)
        return rows.view(b, s, t.shape[1], t.shape[3]).transpose(1, 2)

    q, k, v = to_padded(query), to_padded(key), to_padded(value)
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=dropout,
                                                           scale=scaling, is_causal=True)
    out = out.transpose(1, 2).reshape(b * s, -1)
    out = packing.unpad_rows(out, info)
    return out.view(1, out.shape[0], query.shape[1], query.shape[3]), None


def varlen_enabled() -> bool:
    """Variable-length attention on the packed rows (solution/kernels/attn_varlen.py) instead of
    the padded layout: true until the kernel refused this machine (``_varlen_failed``). While it
    holds, attention reads each packed row's extent from ``cu_seqlens``, so an extra packed row (a
    filler: packing.make_unpadded's ``extra``) attends only to itself; on the padded layout a
    filler row would share positions with real tokens (the CUDA graphs ask this)."""
    return _VARLEN_FAILED is None


_VARLEN_FAILED: str | None = None


_PREFLIGHT: dict = state.kept({})  # (device, dtype, head_dim) -> the kernel ran forward and backward there


@state.on_clear
def _forget_refusal() -> None:
    """revert(): a later apply() asks the variable-length kernel again."""
    global _VARLEN_FAILED
    _VARLEN_FAILED = None


def varlen_works(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Variable-length attention runs here: ``varlen_enabled`` and, on CUDA, the private ATen ops'
    schemas as reviewed (``attn_varlen.schema_refusal``) and a tiny forward and backward of the
    kernel once per device, dtype and head dim (``attn_varlen.preflight``). Where
    PyTorch's kernel refuses (never seen on the H200; a T4 was never measured), this says so once
    and turns to the padded layout for good (``_varlen_failed``) before any step depends on it: the
    decoder-layer node calls the kernel with no fallback of its own, and a refusal in a backward
    could not be caught. Not run inside a CUDA graph capture (a failed capture falls back and the
    next eager step asks), nor without CUDA (the CPU runs the row-by-row reference)."""
    if not varlen_enabled():
        return False
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return True
    key = (device, dtype, head_dim)
    ok = _PREFLIGHT.get(key)
    if ok is None:
        # the private ATen ops' schemas first (the kernel is called positionally), then a run
        refusal = attn_varlen.schema_refusal() or attn_varlen.preflight(device, dtype, head_dim)
        ok = _PREFLIGHT[key] = refusal is None
        if refusal is not None:
            _varlen_failed(refusal)
    return ok


def _varlen_failed(exc: Exception) -> None:
    """The variable-length kernel refused this machine's inputs (it was measured on an H200 taking
    the T4's paths, never on a real T4): say so once, and use the padded layout from now on (the
    same values up to the attention kernel's rounding)."""
    global _VARLEN_FAILED
    if _VARLEN_FAILED is None:
        first_line = (str(exc).splitlines() or [""])[0][:200]
        _VARLEN_FAILED = f"{type(exc).__name__}: {first_line}"
        say(f"variable-length attention failed ({_VARLEN_FAILED}); attention runs on the padded "
            "layout from now on")


def _sdpa_varlen(module, query, key, value, info, scaling, dtype):
    """sdpa_unpadded without padding: q / k / v laid out as [1, N, heads, D] (KV heads repeated,
    cast to SDPA's dtype) by the layout kernels on the packed layout, then variable-length causal
    attention, row by row in one launch. Returns [1, N, Hq, D] like stock."""
    # the [1, H, N, D] views of [1, N, H, D] memory: transposed back for the kernel
    q, k, v = (t.transpose(1, 2) for t in _layout_qkv(module, query, key, value, packed_layout(info), dtype))
    if scaling is None:
        scaling = query.shape[-1] ** -0.5  # SDPA's default
    return attn_varlen.varlen_causal_attention(q, k, v, info, scaling), None


def _sdpa_input_dtype(query, key, value):
    """The dtype SDPA computes in for these inputs (autocast's cast, or the inputs' own dtype),
    when our layout kernels handle it (fp16 / fp32 in and out); None -> the torch ops path."""
    dev = query.device.type
    if torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)  # SDPA is on autocast's lower-precision list
    elif query.dtype == key.dtype == value.dtype:
        dtype = query.dtype
    else:
        return None  # stock SDPA would raise on mixed dtypes: let it
    ok = (torch.float16, torch.float32)
    if dtype not in ok or not all(attn_layout.supported(t) and t.dtype in ok for t in (query, key, value)):
        return None
    return dtype


def _layout_qkv(module, query, key, value, layout, dtype):
    """q, k, v ([1, heads, N, D] packed) laid out by ``layout`` (the padded batch, or the packed
    rows' own) as [batch, Hq, seqlen, D] views, KV heads repeated, cast to ``dtype``: one launch each.
    ``squeeze(0)``, a view both ways: ``t[0]``'s backward wrote each gradient into a zero-filled
    full-size tensor (a fill and a copy per input, 0.36 ms a step on the H200)."""
    groups = getattr(module, "num_key_value_groups", 1)
    return tuple(attn_layout.pad_heads(t.squeeze(0).transpose(0, 1), layout, rep, dtype)
                 for t, rep in ((query, 1), (key, groups), (value, groups)))


def _in_graph(info) -> bool:
    """Layers captured into a CUDA graph (solution/step/cuda_graphs.py) or being captured: only the
    packed-row attention paths (cu_seqlens, a fixed row bound) are valid there."""
    return info.max_len_bound is not None or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _refuse_padded_layout(info) -> None:
    """Inside a CUDA graph the padded layout's idx / src would be captured once: wrong for the next
    batch of the bucket (raising makes the graph runner fall back to the eager layers). A filler
    row (a graph bucket's) would share padded positions with the real tokens it copies, and take
    their gradients in backward: never computed so (the graphs refuse the padded layout; this is
    the last guard)."""
    if _in_graph(info):
        raise RuntimeError("attention on the padded layout cannot run inside a decoder CUDA graph")
    if info.has_filler:
        raise RuntimeError("attention on the padded layout cannot take a token bucket's filler row "
                           "(it would share positions with real tokens)")


def _sdpa_unpadded_kernels(module, query, key, value, info, dropout, scaling, dtype):
    """sdpa_unpadded with the layout moves in our kernels: one launch pads q, one pads and repeats
    k, one v (cast in the same pass to ``dtype``, the cast autocast would make for SDPA), one
    gathers the output's real rows."""
    _refuse_padded_layout(info)
    q, k, v = _layout_qkv(module, query, key, value, info, dtype)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=dropout,
                                                           scale=scaling, is_causal=True)
    return attn_layout.unpad_heads(out, info).unsqueeze(0), None
