"""No work on padding in Qwen2: wires the packed training step (solution/step/) into
transformers. Two swaps:

1. ``Qwen2Model.forward``: a training forward that ``step.decoder.plan`` accepts (every
   right-padded batch, also one with no padding) runs ``step.decoder.unpadded_forward`` on the
   real tokens only; anything else runs the stock forward unchanged.
2. ``AttentionInterface._global_mapping["sdpa"]``: when the mask argument is an ``Unpadded``,
   ``step.attention.sdpa_unpadded`` (attention over the packed rows); any other call goes to the
   stock function.

Refused (check()) unless the installed Qwen2Model.forward and sdpa_attention_forward are the
sources mirrored in solution/step/ or reviewed as equivalent (sha256, solution/patches/_sources.py).
"""
from __future__ import annotations

import functools

from solution.patches._sources import drop_cache_args, unexpected_source
from solution.step import attention, decoder
from solution.step.packing import Unpadded

NAME = "qwen2_unpad"
# What else this patch carries: apply()'s line says it when the patch is skipped.
ALSO_OFF_WHEN_SKIPPED = ("the packed step (no work on padding), and with it variable-length attention, the attention "
                         "layout kernels and the decoder CUDA graphs")


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
    # transformers' private registry of attention functions (the one the "sdpa" entry is read from)
    if not isinstance(getattr(AttentionInterface, "_global_mapping", None), dict):
        return "transformers' AttentionInterface has no _global_mapping registry"
    if AttentionInterface._global_mapping.get("sdpa") is not sdpa_attention.sdpa_attention_forward:
        return "the 'sdpa' attention function is already replaced by someone else"
    return None


def _make_model_forward(stock_forward):
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, use_cache=None,
                **kwargs):
        info = decoder.plan(self, input_ids, attention_mask, position_ids, inputs_embeds, use_cache, kwargs)
        if info is None:
            return stock_forward(self, input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=position_ids, inputs_embeds=inputs_embeds, use_cache=use_cache,
                                 **kwargs)
        drop_cache_args(kwargs)  # None here (checked by plan)
        return decoder.unpadded_forward(self, input_ids, info, kwargs)

    functools.update_wrapper(forward, stock_forward)
    return forward


def _make_sdpa(stock_sdpa):
    def sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs):
        if isinstance(attention_mask, Unpadded):
            return attention.sdpa_unpadded(module, query, key, value, attention_mask, *args, **kwargs)
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
    return ("Qwen2Model.forward runs every right-padded training batch (also one without padding) on its "
            "real tokens only (solution/step/); stock for anything else")
