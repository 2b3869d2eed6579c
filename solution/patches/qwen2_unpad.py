"""No work on padding (docs/no_padding.md): ``Qwen2Model.forward`` runs a training forward that
``step.decoder.plan`` accepts through ``step.decoder.unpadded_forward``; anything else: the stock forward.
Refused (check()) unless the installed forward is a reviewed source (sha256, solution/patches/_sources.py).
"""
from __future__ import annotations

import functools

from solution.patches._sources import drop_cache_args, unexpected_source
from solution.step import decoder

NAME = "qwen2_unpad"
# What else this patch carries: apply()'s line says it when the patch is skipped.
ALSO_OFF_WHEN_SKIPPED = ("the packed step (no work on padding), and with it the decoder-layer node, variable-length "
                         "attention and the decoder CUDA graphs")


def check() -> str | None:
    try:
        from transformers.models.qwen2 import modeling_qwen2
    except Exception as exc:  # noqa: BLE001 - transformers missing or broken
        return f"transformers' Qwen2 is not importable ({type(exc).__name__}: {exc})"
    return unexpected_source("transformers.Qwen2Model.forward", modeling_qwen2.Qwen2Model.forward)


def _make_model_forward(stock_forward):
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, use_cache=None,
                **kwargs):
        info = decoder.plan(self, input_ids, attention_mask, position_ids, inputs_embeds, use_cache, kwargs)
        if info is None:
            return stock_forward(self, input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=position_ids, inputs_embeds=inputs_embeds, use_cache=use_cache,
                                 **kwargs)
        drop_cache_args(kwargs)  # None here (checked by plan)
        out = decoder.unpadded_forward(self, input_ids, info, kwargs)
        if out is not None:
            return out
        return stock_forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)

    functools.update_wrapper(forward, stock_forward)
    return forward


def install(swaps) -> str:
    from transformers.models.qwen2 import modeling_qwen2

    cls = modeling_qwen2.Qwen2Model
    swaps.set(cls, "forward", _make_model_forward(cls.forward))
    return ("Qwen2Model.forward runs every right-padded training batch (also one without padding) on its "
            "real tokens only (solution/step/); stock for anything else")
