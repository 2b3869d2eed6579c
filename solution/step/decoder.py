"""The packed decoder body (the step's layer 5; docs/no_padding.md): ``plan`` decides which training forwards
run on the real tokens only (None: stock forward), ``unpadded_forward`` is the Qwen2Model body that does it:
the N real tokens as one row [1, N], RoPE at each token's position in its row, every layer through the
decoder-layer node (replayed from CUDA graphs where they pay), the final norm, and the result scattered back
to [batch, seqlen, H] (zeros at pads); the LM head patch may take the packed rows (``capture_packed_hidden``).
"""
from __future__ import annotations

import contextlib
import contextvars
import itertools
import weakref

import torch

from solution import state
from solution.kernels._device import cuda_or_runs_here
from solution.patches._sources import cache_given
from solution.step import cuda_graphs, graph_decision, packing
from solution.step import layer as layer_node

# Set by the LM-head patch around its decoder call: receives (packed final hidden [1, N, H], Unpadded).
_PACKED_SINK: contextvars.ContextVar[list | None] = contextvars.ContextVar("solution_packed_sink", default=None)


@contextlib.contextmanager
def capture_packed_hidden():
    """Within this block an unpadded Qwen2Model forward appends (packed hidden, Unpadded) to the yielded list."""
    sink: list = []
    token = _PACKED_SINK.set(sink)
    try:
        yield sink
    finally:
        _PACKED_SINK.reset(token)


def _has_neftune_hook(module: torch.nn.Module) -> bool:
    """NEFTune's embedding hook scales its noise by the sequence shape: packed rows would change it."""
    return any("neftune" in getattr(h, "__name__", "") for h in module._forward_hooks.values())


def _dropouts_ok(model) -> bool:
    """Every dropout with p > 0 is a LoRA dropout of a peft bnb 4-bit layer (drawn over the padded shape as
    stock does); any other would draw other random numbers over the packed rows."""
    try:
        from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit
    except Exception:  # noqa: BLE001 - peft / bnb absent
        return not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
    handled = {id(d) for mod in model.modules() if isinstance(mod, LoraLinear4bit) for d in mod.lora_dropout.modules()}
    return not any(isinstance(mod, torch.nn.Dropout) and mod.p > 0 and id(mod) not in handled
                   for mod in model.modules())


def _on_one_device(model) -> bool:
    """Every parameter and buffer on one device and no accelerate hook (``_hf_hook``): ``device_map="auto"``
    over several GPUs, or CPU / disk offload, wraps each layer's forward to move inputs or weights, while the
    packed step lives on the input's device (a one-device map adds no hooks)."""
    devices = {t.device for t in itertools.chain(model.parameters(), model.buffers())}
    return len(devices) <= 1 and not any(hasattr(m, "_hf_hook") for m in model.modules())


_MODEL_OK: "weakref.WeakKeyDictionary" = state.kept(weakref.WeakKeyDictionary())


def _model_ok(model) -> bool:
    """``_dropouts_ok`` and ``_on_one_device``, asked once per model (each walks every module)."""
    ok = _MODEL_OK.get(model)
    if ok is None:
        ok = _MODEL_OK[model] = _dropouts_ok(model) and _on_one_device(model)
    return ok


def _run_node(layer, plan, hidden_states, node):
    """The layer through the node (``layer_node.run_layer``); under a checkpoint function the node does not
    reproduce, the node runs under that function (as stock's layer would)."""

    def under_checkpoint_function(layer_plan):
        def run(h):  # the forward, and again in backward (the recompute)
            return layer_node.apply_node(layer_plan, h, node)

        return layer._gradient_checkpointing_func(run, hidden_states)

    return layer_node.run_layer(layer, plan, hidden_states, node, other_checkpoint=under_checkpoint_function)


def plan(model, input_ids, attention_mask, position_ids, inputs_embeds, use_cache, kwargs):
    """The Unpadded description when this call can run packed, else None (stock forward)."""
    cfg = model.config
    if not (model.training and torch.is_grad_enabled()):
        return None
    if cache_given(kwargs) or use_cache or (use_cache is None and getattr(cfg, "use_cache", False)):
        return None  # a cache given, or one stock would build and return
    if (input_ids is None or inputs_embeds is not None or position_ids is not None
            or not isinstance(attention_mask, torch.Tensor) or input_ids.dim() != 2
            or attention_mask.shape != input_ids.shape or not cuda_or_runs_here(input_ids.device)):
        return None
    if (kwargs.get("output_hidden_states") or kwargs.get("output_attentions") or kwargs.get("return_dict") is False
            or getattr(cfg, "output_hidden_states", False) or getattr(cfg, "output_attentions", False)
            or kwargs.get("is_causal", getattr(cfg, "is_causal", None)) is False):
        return None
    if (model.has_sliding_layers or cfg._attn_implementation != "sdpa"
            or getattr(cfg, "attention_dropout", 0.0) != 0.0 or _has_neftune_hook(model.embed_tokens)
            or not _model_ok(model)):
        return None
    lengths = packing.right_padded_lengths(attention_mask)
    if lengths is None or min(lengths) < 1:
        return None  # not right padding (left padding, holes, not 0/1), or an empty row
    # any right-padded batch, also one without padding: the packed layout is exact for all of them
    return packing.make_unpadded(lengths, input_ids.shape[1], input_ids.device)


def unpadded_forward(model, input_ids, info, kwargs):
    """Stock Qwen2Model.forward's body on the packed real tokens, or None when the node does not take every
    layer this step (nothing random was drawn and no layer ran)."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    # the layers replayed from CUDA graphs (solution/step/cuda_graphs.py), or eagerly
    hidden_states = cuda_graphs.decoder_forward(model, input_ids, info, kwargs)
    if hidden_states is None:
        ids = packing.unpad_rows(input_ids.reshape(-1), info).unsqueeze(0)  # [1, N]
        hidden_states = model.embed_tokens(ids)
        position_ids = info.positions.unsqueeze(0)
        cos, sin = model.rotary_emb(hidden_states, position_ids)
        layers = model.layers[: model.config.num_hidden_layers]
        node = None if cuda_graphs.arguments_refusal(kwargs) else layer_node.step_context(cos, sin, info, hidden_states)
        plans = layer_node.plans(layers, hidden_states, node)
        if plans is None:
            return None
        # while "auto" measures whether graphs pay, the second half of the layers is timed
        timer = graph_decision.eager_timer(model, input_ids.device)
        for i, (decoder_layer, layer_plan) in enumerate(zip(layers, plans)):
            if timer is not None and i == len(layers) // 2:
                timer.start()
            hidden_states = _run_node(decoder_layer, layer_plan, hidden_states, node)
        if timer is not None:
            timer.stop()
    hidden_states = model.norm(hidden_states)
    sink = _PACKED_SINK.get()
    if sink is not None:
        sink.append((hidden_states, info))
    padded = packing.pad_rows(hidden_states[0], info).view(info.batch, info.seqlen, -1)
    return BaseModelOutputWithPast(last_hidden_state=padded)  # no cache
