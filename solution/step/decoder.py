"""The packed decoder body (the step's layer 4): which training forwards run on the real tokens
only (``plan``) and the Qwen2Model forward body that does it (``unpadded_forward``).

For a right-padded training batch (the only kind trl's collator makes here: ``attention_mask``
rows of ones then zeros; a batch without padding is one with zero pads) ``unpadded_forward``
gathers the N real tokens into one packed row [1, N] (packing.py), embeds them, computes RoPE's
cos/sin at each token's own position (0..len-1 of its row, as stock's arange does for right
padding), runs every decoder layer on [1, N, H] with an ``Unpadded`` description in place of the
attention mask (replayed from CUDA graphs where cuda_graphs.py decides they pay, else eagerly),
applies the final norm and scatters the result back to [batch, seqlen, H] (zeros at pad
positions). The CausalLM head patch (patches/qwen2_lm_head_loss.py) can take the packed rows
directly (``capture_packed_hidden``), so the LM head skips the pads as well. Any other call (eval,
generation, a cache, position_ids given, left padding, hidden states or attentions requested,
checkpointed layers with hooks, sliding-window layers, attention dropout, another attention
implementation, NEFTune, a dropout our LoRA kernel does not own, a model spread over several
devices or offloaded by accelerate) gets None from ``plan``: the stock forward runs unchanged.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import weakref

import torch

from solution import state
from solution.hooks import has_hooks
from solution.say import say_once
from solution.kernels._device import cuda_or_runs_here
from solution.patches._sources import cache_given, checkpointing_body
from solution.step import cuda_graphs, graph_decision, packing
from solution.step import layer as layer_node

# Set by the LM-head patch around its call of the decoder: a list that receives
# (packed final hidden states [1, N, H], Unpadded) when the decoder ran unpadded.
_PACKED_SINK: contextvars.ContextVar[list | None] = contextvars.ContextVar("solution_packed_sink", default=None)


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


def _has_neftune_hook(module: torch.nn.Module) -> bool:
    """NEFTune's embedding hook scales its noise by the sequence shape: packed rows would change it."""
    return any("neftune" in getattr(h, "__name__", "") for h in module._forward_hooks.values())


def _dropouts_ok(model) -> bool:
    """Every dropout with p > 0 in the decoder is a LoRA dropout of a peft bnb 4-bit layer whose
    forward is ours (solution/patches/peft_lora_bnb.py -> lora_nf4.lora_dropout draws the mask over
    the padded shape). Any other dropout would draw over the packed rows: other random numbers than
    stock's, so such a model keeps the padded path."""
    try:
        from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit
    except Exception:  # noqa: BLE001 - peft / bnb absent
        LoraLinear4bit = ()
    handled = set()
    ours = getattr(getattr(LoraLinear4bit, "forward", None), "_solution_lora_dropout", False)
    for mod in model.modules():
        if ours and isinstance(mod, LoraLinear4bit):
            handled.update(id(d) for d in mod.lora_dropout.modules())
    return not any(isinstance(mod, torch.nn.Dropout) and mod.p > 0 and id(mod) not in handled
                   for mod in model.modules())


def _on_one_device(model) -> bool:
    """Every parameter and buffer of the decoder on one device, and no accelerate hook
    (``_hf_hook``) on any of its modules. ``device_map="auto"`` over several visible GPUs (Kaggle's
    "GPU T4 x2") spreads the layers over them, and CPU / disk offload loads weights at each
    forward: accelerate then wraps each layer's forward to move its inputs or weights, while the
    packed step's row description, attention and CUDA graphs live on the input's device. Such a
    model keeps the stock forward (the per-layer patches still decide call by call). A one-device
    map adds no hooks (accelerate's dispatch_model)."""
    devices = {t.device for t in itertools.chain(model.parameters(), model.buffers())}
    return len(devices) <= 1 and not any(hasattr(m, "_hf_hook") for m in model.modules())


_MODEL_OK: "weakref.WeakKeyDictionary" = state.kept(weakref.WeakKeyDictionary())


def _model_ok(model) -> bool:
    """``_dropouts_ok`` and ``_on_one_device``: what the model's modules allow, asked once per
    model (each walks every module; plan() runs every step)."""
    ok = _MODEL_OK.get(model)
    if ok is None:
        ok = _MODEL_OK[model] = _dropouts_ok(model) and _on_one_device(model)
    return ok


def _checkpointing_ok(model) -> bool:
    """Gradient checkpointing, where it is on, can run on the packed rows: each checkpointed layer
    has the checkpoint function transformers set (``_gradient_checkpointing_func``), no module
    hooks and no forward set on the instance (``_run_checkpointed`` and the node call the class's
    forward themselves inside the checkpoint, so a hook or an instance-level wrapper, such as a
    profiler's or ``mock.patch.object(layer, "forward", wraps=...)``, would not run where stock
    runs it: in the forward and again in the recompute). Otherwise the stock forward, said once."""
    layers = model.layers[: model.config.num_hidden_layers]
    for layer in layers:
        if not layer_node.checkpointed(layer):
            continue
        if "forward" in layer.__dict__ or has_hooks(layer):
            say_once("a checkpointed decoder layer has hooks or a forward of its own (a wrapper): the model runs "
                     "stock's forward (no packed step), so that they run in the forward and in the recompute")
            return False
        if not callable(getattr(layer, "_gradient_checkpointing_func", None)):
            return False
    return True


def _layer_forward(layer):
    """The layer class's forward without transformers' checkpointing wrapper (``checkpointing_body``:
    from 5.23 ``forward`` itself is wrapped, around the stock body or our decoder-layer patch's
    mirror). Only that one wrapper is taken off: our own patch's mirror also carries a
    ``__wrapped__`` (the stock body) and must stay."""
    forward = type(layer).forward
    return checkpointing_body(forward) or forward


def _run_checkpointed(layer, info, hidden_states, kwargs):
    """One decoder layer under transformers' gradient checkpointing, on packed rows: the
    checkpoint function transformers set (its own use_reentrant, RNG preservation, ...) over the
    layer's forward, inside ``running_unpadded(info)``. The recompute runs in backward, outside
    the decoder loop's context: without it LoRA dropout would redraw its mask over the packed
    shape instead of stock's padded one (other random numbers than the forward's)."""
    forward = _layer_forward(layer)

    def run(h, **kw):
        with packing.running_unpadded(info):
            return forward(layer, h, **kw)

    return layer._gradient_checkpointing_func(functools.partial(run, **kwargs), hidden_states)


def _run_node(layer, hidden_states, node, info):
    """The layer through the decoder-layer node (``layer_node.run_layer``: its own checkpointing
    where transformers' checkpoint function is torch's plain one); a checkpointed layer whose
    checkpoint function the node does not reproduce runs the node under that function (as the module
    would run); None when the node does not take this layer (the caller calls the module)."""

    def under_checkpoint_function(layer_plan):
        def run(h):  # the forward, and again in backward (the recompute), under the packed batch
            with packing.running_unpadded(info):
                return layer_node.apply_node(layer_plan, h, node)

        return layer._gradient_checkpointing_func(run, hidden_states)

    return layer_node.run_layer(layer, hidden_states, node, other_checkpoint=under_checkpoint_function)


def plan(model, input_ids, attention_mask, position_ids, inputs_embeds, use_cache, kwargs):
    """The Unpadded description when this call can run packed, else None (stock forward). The KV
    cache argument, if any, is in kwargs (``past_key_values`` or, from transformers 5.24, ``cache``)."""
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
    if (not _checkpointing_ok(model) or model.has_sliding_layers or cfg._attn_implementation != "sdpa"
            or getattr(cfg, "attention_dropout", 0.0) != 0.0 or _has_neftune_hook(model.embed_tokens)
            or not _model_ok(model)):
        return None
    lengths = packing.right_padded_lengths(attention_mask)
    if lengths is None or min(lengths) < 1:
        return None  # not right padding (left padding, holes, not 0/1), or an empty row
    # Any right-padded batch, also one with no padding at all (rows of equal length, rows truncated
    # at max_length, a batch of one row): the packed layout with cu_seqlens is exact for all of them,
    # so every training batch takes the same path (packed kernels, CUDA graphs).
    return packing.make_unpadded(lengths, input_ids.shape[1], input_ids.device)


def unpadded_forward(model, input_ids, info, kwargs):
    """Stock Qwen2Model.forward's body on the packed real tokens (no cache, no masks to build)."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    # the layers replayed from CUDA graphs (solution/step/cuda_graphs.py), or eagerly
    hidden_states = cuda_graphs.decoder_forward(model, input_ids, info, kwargs)
    if hidden_states is None:
        ids = packing.unpad_rows(input_ids.reshape(-1), info).unsqueeze(0)  # [1, N]
        hidden_states = model.embed_tokens(ids)
        position_ids = info.positions.unsqueeze(0)
        position_embeddings = model.rotary_emb(hidden_states, position_ids)
        layers = model.layers[: model.config.num_hidden_layers]
        # while $SOLUTION_CUDA_GRAPHS=auto measures whether graphs pay: the forward of the second
        # half of the layers is timed
        timer = graph_decision.eager_timer(model, input_ids.device)
        # each layer as one autograd node (step/layer.py) where it mirrors the modules exactly
        node = None if cuda_graphs.arguments_refusal(kwargs) else layer_node.step_context(
            *position_embeddings, info, hidden_states)
        with packing.running_unpadded(info):
            for i, decoder_layer in enumerate(layers):
                if timer is not None and i == len(layers) // 2:
                    timer.start()
                out = None if node is None else _run_node(decoder_layer, hidden_states, node, info)
                if out is not None:
                    hidden_states = out
                    continue
                layer_kwargs = dict(attention_mask=info, position_embeddings=position_embeddings,
                                    position_ids=position_ids, use_cache=False, **kwargs)
                if layer_node.checkpointed(decoder_layer):
                    hidden_states = _run_checkpointed(decoder_layer, info, hidden_states, layer_kwargs)
                else:
                    hidden_states = decoder_layer(hidden_states, **layer_kwargs)
        if timer is not None:
            timer.stop()
    hidden_states = model.norm(hidden_states)
    sink = _PACKED_SINK.get()
    if sink is not None:
        sink.append((hidden_states, info))
    padded = packing.pad_rows(hidden_states[0], info).view(info.batch, info.seqlen, -1)
    return BaseModelOutputWithPast(last_hidden_state=padded)  # no cache
