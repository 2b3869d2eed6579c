"""No work on padding in Qwen2 (issue 5.1): the decoder runs on the batch's real tokens only.

Two swaps:

1. ``Qwen2Model.forward``: for a right-padded training batch (the only kind trl's collator makes
   here: ``attention_mask`` rows of ones then zeros) it gathers the N real tokens into one packed
   row [1, N] (solution/padding.py), embeds them, computes RoPE's cos/sin at each token's own
   position (0..len-1 of its row, as stock's arange does for right padding), runs every decoder
   layer on [1, N, H] with an ``Unpadded`` description in place of the attention mask, applies
   the final norm and scatters the result back to [batch, seqlen, H] (zeros at pad positions).
   The CausalLM head patch (qwen2_lm_head_loss) can take the packed rows directly
   (``capture_packed_hidden``), so the LM head skips the pads as well. Any other call (eval,
   generation, a cache, position_ids given, left padding, hidden states or
   attentions requested, gradient checkpointing, sliding-window layers, attention dropout,
   another attention implementation) runs the stock forward unchanged. A batch without padding
   (rows of equal length, every row truncated at max_length, one row) is a right-padded batch
   with zero pads: it takes the same packed path.
2. ``AttentionInterface._global_mapping["sdpa"]``: when the mask argument is an ``Unpadded``,
   attention runs on the packed rows by default: PyTorch's memory-efficient kernel in its
   variable-length mode (``cu_seqlens``, causal within each row; solution/kernels/attn_varlen.py),
   K/V repeated to the 12 query heads by our layout kernel. With SOLUTION_ATTN_VARLEN=0, q/k/v go
   back to the padded [batch, heads, seqlen, dim] layout (zeros at pads), the same SDPA call as
   stock runs with ``is_causal=True``, and the real rows of the output are kept. Either way, with
   right padding a real query at position t attends to keys 0..t of its row, all real: the set of
   keys is stock's, so the values are the same up to the attention kernel's rounding (masked
   entries are skipped instead of set to -inf). Any other call goes to the stock function.

Refused (check()) unless the installed Qwen2Model.forward and sdpa_attention_forward are the
sources mirrored here or reviewed as equivalent (sha256, solution/patches/_sources.py: transformers
5.16.1-5.23.0).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import weakref

import torch

from solution.kernels import attn_layout, attn_triton, attn_varlen
from solution.patches._sources import cache_given, drop_cache_args, unexpected_source

NAME = "qwen2_unpad"


# Set by the LM-head patch around its call of the decoder: a list that receives
# (packed final hidden states [1, N, H], Unpadded) when the decoder ran unpadded.
_PACKED_SINK: contextvars.ContextVar[list | None] = contextvars.ContextVar("qwen2_unpad_sink", default=None)


@contextlib.contextmanager
def capture_packed_hidden():
    """Within this block, an unpadded Qwen2Model forward also appends (packed hidden, Unpadded)
    to the yielded list, for a caller that can use the packed rows (the fused LM head)."""
    sink: list = []
    token = _PACKED_SINK.set(sink)
    try:
        yield sink
    finally:
        _PACKED_SINK.reset(token)


def check() -> str | None:
    try:
        from transformers.integrations import sdpa_attention
        from transformers.modeling_utils import AttentionInterface
        from transformers.models.qwen2 import modeling_qwen2
    except Exception as exc:  # noqa: BLE001 - transformers missing or broken
        return f"transformers' Qwen2 / attention interface not importable ({type(exc).__name__}: {exc})"
    reason = (unexpected_source("transformers.Qwen2Model.forward", modeling_qwen2.Qwen2Model.forward)
              or unexpected_source("transformers.sdpa_attention_forward", sdpa_attention.sdpa_attention_forward))
    if reason is not None:
        return reason
    if AttentionInterface._global_mapping.get("sdpa") is not sdpa_attention.sdpa_attention_forward:
        return "the 'sdpa' attention function is already replaced by someone else"
    return None


def _kernel_device_ok(device: torch.device) -> bool:
    from solution.env import interpreter_enabled

    return device.type == "cuda" or (device.type == "cpu" and interpreter_enabled())


def _has_neftune_hook(module: torch.nn.Module) -> bool:
    """NEFTune's embedding hook scales its noise by the sequence shape: packed rows would change it."""
    return any("neftune" in getattr(h, "__name__", "") for h in module._forward_hooks.values())


_DROPOUTS_OK: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _dropouts_ok(model) -> bool:
    """Every dropout with p > 0 in the decoder is a LoRA dropout of a peft bnb 4-bit layer whose
    forward is ours (solution/patches/peft_lora_bnb.py -> lora_nf4.lora_dropout draws the mask over
    the padded shape). Any other dropout would draw over the packed rows: other random numbers than
    stock's, so such a model keeps the padded path. (Cached per model.)"""
    ok = _DROPOUTS_OK.get(model)
    if ok is None:
        try:
            from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit
        except Exception:  # noqa: BLE001 - peft / bnb absent
            LoraLinear4bit = ()
        handled = set()
        ours = getattr(getattr(LoraLinear4bit, "forward", None), "_solution_lora_dropout", False)
        for mod in model.modules():
            if ours and isinstance(mod, LoraLinear4bit):
                handled.update(id(d) for d in mod.lora_dropout.modules())
        ok = not any(isinstance(mod, torch.nn.Dropout) and mod.p > 0 and id(mod) not in handled
                     for mod in model.modules())
        _DROPOUTS_OK[model] = ok
    return ok


def _plan(model, input_ids, attention_mask, position_ids, inputs_embeds, use_cache, kwargs):
    """The Unpadded description when this call can run packed, else None (stock forward). The KV
    cache argument, if any, is in kwargs (``past_key_values`` or, from transformers 5.24, ``cache``)."""
    from solution import padding

    cfg = model.config
    if not (model.training and torch.is_grad_enabled()):
        return None
    if cache_given(kwargs) or use_cache or (use_cache is None and getattr(cfg, "use_cache", False)):
        return None  # a cache given, or one stock would build and return
    if (input_ids is None or inputs_embeds is not None or position_ids is not None
            or not isinstance(attention_mask, torch.Tensor) or input_ids.dim() != 2
            or attention_mask.shape != input_ids.shape or not _kernel_device_ok(input_ids.device)):
        return None
    if (kwargs.get("output_hidden_states") or kwargs.get("output_attentions") or kwargs.get("return_dict") is False
            or getattr(cfg, "output_hidden_states", False) or getattr(cfg, "output_attentions", False)
            or kwargs.get("is_causal", getattr(cfg, "is_causal", None)) is False):
        return None
    if (model.gradient_checkpointing or model.has_sliding_layers or cfg._attn_implementation != "sdpa"
            or getattr(cfg, "attention_dropout", 0.0) != 0.0 or _has_neftune_hook(model.embed_tokens)
            or not _dropouts_ok(model)):
        return None
    lengths = padding.right_padded_lengths(attention_mask)
    if lengths is None or min(lengths) < 1:
        return None  # not right padding (left padding, holes, not 0/1), or an empty row
    # Any right-padded batch, also one with no padding at all (rows of equal length, rows truncated
    # at max_length, a batch of one row): the packed layout with cu_seqlens is exact for all of them,
    # so every training batch takes the same path (packed kernels, CUDA graphs).
    return padding.make_unpadded(lengths, input_ids.shape[1], input_ids.device)


def _unpadded_forward(model, input_ids, info, kwargs):
    """Stock Qwen2Model.forward's body on the packed real tokens (no cache, no masks to build)."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    from solution import padding

    from solution import decoder_graphs

    # the layers replayed from CUDA graphs ($SOLUTION_CUDA_GRAPHS=1, solution/decoder_graphs.py), or eagerly
    hidden_states = decoder_graphs.decoder_forward(model, input_ids, info, kwargs)
    if hidden_states is None:
        ids = padding.unpad_rows(input_ids.reshape(-1), info).unsqueeze(0)  # [1, N]
        hidden_states = model.embed_tokens(ids)
        position_ids = info.positions.unsqueeze(0)
        position_embeddings = model.rotary_emb(hidden_states, position_ids)
        # timed while $SOLUTION_CUDA_GRAPHS=auto is still measuring whether graphs pay here
        with padding.running_unpadded(info), decoder_graphs.eager_timing(model, input_ids.device):
            for decoder_layer in model.layers[: model.config.num_hidden_layers]:
                hidden_states = decoder_layer(
                    hidden_states,
                    attention_mask=info,
                    position_embeddings=position_embeddings,
                    position_ids=position_ids,
                    use_cache=False,
                    **kwargs,
                )
    hidden_states = model.norm(hidden_states)
    sink = _PACKED_SINK.get()
    if sink is not None:
        sink.append((hidden_states, info))
    padded = padding.pad_rows(hidden_states[0], info).view(info.batch, info.seqlen, -1)
    return BaseModelOutputWithPast(last_hidden_state=padded)  # no cache


def _make_model_forward(stock_forward):
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, use_cache=None,
                **kwargs):
        info = _plan(self, input_ids, attention_mask, position_ids, inputs_embeds, use_cache, kwargs)
        if info is None:
            return stock_forward(self, input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=position_ids, inputs_embeds=inputs_embeds, use_cache=use_cache,
                                 **kwargs)
        drop_cache_args(kwargs)  # None here (checked by _plan)
        return _unpadded_forward(self, input_ids, info, kwargs)

    functools.update_wrapper(forward, stock_forward)
    return forward


def sdpa_unpadded(module, query, key, value, info, dropout=0.0, scaling=None, **kwargs):
    """Attention of packed rows: query [1, Hq, N, D], key/value [1, Hkv, N, D] -> [1, N, Hq, D]
    (the layout stock's sdpa_attention_forward returns). By default on the packed rows themselves
    (PyTorch's variable-length kernel; our Triton kernel with $SOLUTION_ATTN_TRITON=1), else
    through the padded layout (our layout kernels, or torch's ops with the layout kernels off)."""
    from transformers.integrations.sdpa_attention import repeat_kv

    from solution import padding

    if layout_kernels_enabled():
        dtype = _sdpa_input_dtype(query, key, value)
        if dtype is not None:
            if (attn_triton.enabled() and dropout == 0.0 and info.cu_seqlens is not None
                    and attn_triton.supported(query.shape[-1], query.shape[1], key.shape[1], dtype, query.device)):
                return _sdpa_triton(query, key, value, info, scaling)
            if varlen_enabled() and dropout == 0.0 and attn_varlen.supported(query) and info.cu_seqlens is not None:
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
    _refuse_padded_layout_in_graph(info)

    def to_padded(t):  # [1, h, N, D] -> [b, h, s, D] (a transposed view of [b, s, h, D], like stock's)
        rows = padding.pad_rows(t[0].transpose(0, 1), info)
        return rows.view(b, s, t.shape[1], t.shape[3]).transpose(1, 2)

    q, k, v = to_padded(query), to_padded(key), to_padded(value)
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=dropout,
                                                           scale=scaling, is_causal=True)
    out = out.transpose(1, 2).reshape(b * s, -1)
    out = padding.unpad_rows(out, info)
    return out.view(1, out.shape[0], query.shape[1], query.shape[3]), None


LAYOUT_KERNELS_ENV = "SOLUTION_ATTN_LAYOUT_KERNELS"
VARLEN_ENV = "SOLUTION_ATTN_VARLEN"


def varlen_enabled() -> bool:
    """Variable-length attention on the packed rows (solution/kernels/attn_varlen.py) instead of
    the padded layout. On by default since the H200 measurement of 2026-11-30 (~03:2x UTC): attention
    kernels 0.246 -> 0.180 s and GPU time 1.637 -> 1.558 s over steps 3-64, peak allocated 5.52 ->
    5.40 GiB, loss within 1.0e-5 (docs/kernels/attn_varlen.md); $SOLUTION_ATTN_VARLEN=0 keeps the
    padded layout. Needs the layout kernels (it repeats KV heads with them)."""
    return _VARLEN_FAILED is None and os.environ.get(VARLEN_ENV, "1") != "0"


_VARLEN_FAILED: str | None = None


def _varlen_failed(exc: Exception) -> None:
    """The variable-length kernel refused this machine's inputs (it was measured on an H200 taking
    the T4's paths, never on a real T4): say so once, and use the padded layout from now on (the
    same values up to the attention kernel's rounding)."""
    global _VARLEN_FAILED
    if _VARLEN_FAILED is None:
        first_line = (str(exc).splitlines() or [""])[0][:200]
        _VARLEN_FAILED = f"{type(exc).__name__}: {first_line}"
        print(f"[solution] variable-length attention failed ({_VARLEN_FAILED}); attention runs on the padded "
              "layout from now on", flush=True)


def _sdpa_varlen(module, query, key, value, info, scaling, dtype):
    """sdpa_unpadded without padding: q / k / v laid out as [1, N, heads, D] (KV heads repeated,
    cast to SDPA's dtype) by the layout kernels on the packed layout, then variable-length causal
    attention, row by row in one launch. Returns [1, N, Hq, D] like stock."""
    from solution.padding import packed_layout

    # the [1, H, N, D] views of [1, N, H, D] memory: transposed back for the kernel
    q, k, v = (t.transpose(1, 2) for t in _layout_qkv(module, query, key, value, packed_layout(info), dtype))
    if scaling is None:
        scaling = query.shape[-1] ** -0.5  # SDPA's default
    return attn_varlen.varlen_causal_attention(q, k, v, info, scaling), None


def _sdpa_triton(query, key, value, info, scaling):
    """sdpa_unpadded on our own Triton attention (solution/kernels/attn_triton.py, off by default,
    $SOLUTION_ATTN_TRITON=1): q / k / v cast to fp16 on the packed layout by the layout kernel
    (KV heads NOT repeated: the kernel reads KV head h // groups), causal within each row.
    Returns [1, N, Hq, D] like stock."""
    from solution.padding import packed_layout

    layout = packed_layout(info)
    # [1, H, N, D] views of [1, N, H, D] memory -> [N, H, D]
    q, k, v = (attn_layout.pad_heads(t[0].transpose(0, 1), layout, 1, torch.float16).transpose(1, 2)[0]
               for t in (query, key, value))
    if scaling is None:
        scaling = query.shape[-1] ** -0.5  # SDPA's default
    out = attn_triton.triton_varlen_attention(q, k, v, info.cu_seqlens, info.max_len, scaling)
    return out.unsqueeze(0), None


def layout_kernels_enabled() -> bool:
    """Our Triton pad/unpad kernels around attention (solution/kernels/attn_layout.py) instead of
    torch's index ops. On by default since the H200 measurement of 2026-11-30 01:5x UTC (GPU time
    2.21 -> 2.04 s over steps 3-64, peak allocated 7.46 -> 7.10 GiB, loss within 1.6e-5:
    docs/kernels/attn_layout.md); $SOLUTION_ATTN_LAYOUT_KERNELS=0 keeps torch's index ops."""
    return os.environ.get(LAYOUT_KERNELS_ENV, "1") != "0"


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
    rows' own) as [batch, Hq, seqlen, D] views, KV heads repeated, cast to ``dtype``: one launch each."""
    groups = getattr(module, "num_key_value_groups", 1)
    return tuple(attn_layout.pad_heads(t[0].transpose(0, 1), layout, rep, dtype)
                 for t, rep in ((query, 1), (key, groups), (value, groups)))


def _in_graph(info) -> bool:
    """Layers captured into a CUDA graph (solution/decoder_graphs.py) or being captured: only the
    packed-row attention paths (cu_seqlens, a fixed row bound) are valid there."""
    return info.max_len_bound is not None or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _refuse_padded_layout_in_graph(info) -> None:
    """The padded layout's idx / src would be captured once: wrong for the next batch of the bucket.
    Raising makes the graph runner fall back to the eager layers."""
    if _in_graph(info):
        raise RuntimeError("attention on the padded layout cannot run inside a decoder CUDA graph")


def _sdpa_unpadded_kernels(module, query, key, value, info, dropout, scaling, dtype):
    """sdpa_unpadded with the layout moves in our kernels: one launch pads q, one pads and repeats
    k, one v (cast in the same pass to ``dtype``, the cast autocast would make for SDPA), one
    gathers the output's real rows."""
    _refuse_padded_layout_in_graph(info)
    q, k, v = _layout_qkv(module, query, key, value, info, dtype)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=dropout,
                                                           scale=scaling, is_causal=True)
    return attn_layout.unpad_heads(out, info).unsqueeze(0), None


def _make_sdpa(stock_sdpa):
    from solution.padding import Unpadded

    def sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs):
        if isinstance(attention_mask, Unpadded):
            return sdpa_unpadded(module, query, key, value, attention_mask, *args, **kwargs)
        return stock_sdpa(module, query, key, value, attention_mask, *args, **kwargs)

    functools.update_wrapper(sdpa_attention_forward, stock_sdpa)
    return sdpa_attention_forward


def install(swaps) -> str:
    from transformers.modeling_utils import AttentionInterface
    from transformers.models.qwen2 import modeling_qwen2

    cls = modeling_qwen2.Qwen2Model
    swaps.set(cls, "forward", _make_model_forward(cls.forward))
    mapping = AttentionInterface._global_mapping
    swaps.set_item(mapping, "sdpa", _make_sdpa(mapping["sdpa"]))
    return ("Qwen2Model.forward runs right-padded training batches on their real tokens only "
            "(attention through the padded layout); stock for anything else")
