"""Turns on the decoder-layer node (solution/step/layer.py): on the packed path each Qwen2 decoder
layer runs as ONE autograd node whose forward and backward are straight sequences of our kernel
calls, instead of ~13 module calls and autograd nodes a layer.

This file is the node's planner: what needs the libraries' modules (bitsandbytes' Linear4bit,
peft's LoRA layer, transformers' Qwen2 classes) is read here, once per layer, into a
``step.layer.LayerPlan``, with a cheap per-step check that it still holds.

The node computes what the patched modules compute, bit for bit, so it runs only where all of
them are installed (qwen2_rmsnorm, qwen2_decoder_layer, qwen2_rope, qwen2_mlp, bnb_linear4bit,
peft_lora_bnb; and qwen2_unpad, whose packed step calls it); any layer or step it does not mirror
exactly runs as modules, said once. ``SOLUTION_SKIP_PATCHES=qwen2_layer_node`` leaves it out
(the layers then run as modules).

Refused (check()) unless the installed ``Qwen2Attention.forward`` is one of the reviewed sources
(sha256, solution/patches/_sources.py): the node mirrors it.
"""
from __future__ import annotations

import torch

from solution.hooks import own_hooks
from solution.patches._sources import unexpected_source

NAME = "qwen2_layer_node"

# rows of the probe inputs the plan is checked with: above bitsandbytes' largest small-M row count
# (its _gemm_4bit_custom_max_m, 1536 on CUDA)
PROBE_ROWS = 4096


def check() -> str | None:
    try:
        from transformers.models.qwen2 import modeling_qwen2
    except Exception as exc:  # noqa: BLE001 - transformers missing or broken
        return f"transformers' Qwen2 is not importable ({type(exc).__name__}: {exc})"
    attn = getattr(modeling_qwen2, "Qwen2Attention", None)
    if attn is None or "forward" not in attn.__dict__:
        return "transformers has no Qwen2Attention.forward (another transformers version?)"
    reason = unexpected_source("transformers.Qwen2Attention.forward", attn.forward)
    if reason is not None:
        return reason
    # The node's own gradient checkpointing stands in for torch's checkpoint (step.layer.own_checkpoint):
    # refused, too, unless that is a reviewed source (sha256, solution/patches/_sources.py)
    from torch.utils import checkpoint as torch_checkpoint

    reason = unexpected_source("torch.utils.checkpoint.checkpoint", getattr(torch_checkpoint, "checkpoint", None))
    if reason is not None:
        return reason
    try:
        import solution.kernels.qkv_grad  # noqa: F401
        import solution.step.layer  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"the layer node is not importable ({type(exc).__name__}: {exc})"
    return None


def missing() -> str | None:
    """None when every patch whose kernels the node runs is installed; else the first one missing."""
    from transformers.models.qwen2 import modeling_qwen2 as mq

    marks = (("qwen2_rmsnorm", getattr(mq.Qwen2RMSNorm.forward, "_solution_stock", None)),
             ("qwen2_decoder_layer", getattr(mq.Qwen2DecoderLayer.forward, "_solution_stock", None)),
             ("qwen2_rope", getattr(mq.apply_rotary_pos_emb, "_solution_stock", None)),
             ("qwen2_mlp", getattr(mq.Qwen2MLP.forward, "_solution_stock", None)))
    for name, mark in marks:
        if mark is None:
            return f"the {name} patch is not installed"
    try:
        from bitsandbytes.nn import Linear4bit
        from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit
    except Exception:  # noqa: BLE001 - bnb / peft absent
        return "bitsandbytes / peft not importable"
    if getattr(Linear4bit.forward, "__wrapped__", None) is None:
        return "the bnb_linear4bit patch is not installed"
    if not getattr(LoraLinear4bit.forward, "_solution_lora_dropout", False):
        return "the peft_lora_bnb patch is not installed"
    return None


def step_ok(x) -> bool:
    """fp16 autocast for x's device, as peft's LoRA forward and SDPA read it."""
    from solution.patches.peft_lora_bnb import _autocast_fp16

    return _autocast_fp16(x.device.type)


def small_m(n: int, device_index, plan) -> bool:
    """bitsandbytes would run its own fused small-M GEMM for n rows of this weight (the modules
    leave such calls to bnb: so does the node, by running the layer as modules)."""
    from solution.patches._bnb import bnb_would_use_fused_gemm_m

    return bnb_would_use_fused_gemm_m(n, device_index, plan)


def _weight_same(module, plan) -> bool:
    """The bnb layer still holds the packed weight and quant state its plan was made for."""
    w = module._parameters.get("weight")
    return w is plan.weight_ref() and getattr(w, "quant_state", None) is plan.qs


def _lora_state(mod, dropout):
    """What peft's LoRA forward reads at each call and the plan took once."""
    active = tuple(mod.active_adapters)
    name = active[0] if len(active) == 1 else None
    a, b = mod._modules["lora_A"]._modules.get(name), mod._modules["lora_B"]._modules.get(name)
    return (mod.disable_adapters, mod.merged, active, mod.scaling.get(name), dropout.training,
            getattr(dropout, "p", 0.0), a, b, a is not None and a._parameters.get("weight"),
            b is not None and b._parameters.get("weight"))


def _validator(layer, sides, linears):
    """The per-step check of a plan: no hooks and no instance-level forwards on the layer's
    modules, the same adapter state, dropout and LoRA weights (``_lora_state``), the same packed
    weights (``_weight_same``). Attribute reads only."""
    modules = tuple(layer.modules())
    states = [(mod, dropout, _lora_state(mod, dropout)) for mod, dropout in sides]

    def valid() -> bool:
        for m in modules:
            if own_hooks(m) or "forward" in m.__dict__:
                return False
        return (all(_lora_state(mod, dropout) == st for mod, dropout, st in states)
                and all(_weight_same(mod, plan) for mod, plan in linears))

    return valid


def build(layer, x):
    """A step.layer.LayerPlan for ``layer`` on input x ([1, N, H] fp32, the packed rows), or why
    not (a string)."""
    from bitsandbytes.nn import Linear4bit
    from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit
    from transformers.models.qwen2 import modeling_qwen2 as mq

    from solution import settings
    from solution.kernels.rmsnorm import rmsnorm_supported
    from solution.patches import _bnb, peft_lora_bnb
    from solution.patches.qwen2_mlp import _silu_types
    from solution.step.layer import LayerPlan, LoraPlan

    if type(layer) is not mq.Qwen2DecoderLayer:
        return "not a Qwen2DecoderLayer"
    reason = unexpected_source("transformers.Qwen2Attention.forward", mq.Qwen2Attention.forward)
    if reason is not None:
        return reason
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not mq.Qwen2Attention or type(mlp) is not mq.Qwen2MLP:
        return "attention or MLP of another class"
    if any(own_hooks(m) or "forward" in m.__dict__ or hasattr(m, "_hf_hook") for m in layer.modules()):
        return "hooks or instance-level forwards on the layer's modules"
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if not all(type(n) is mq.Qwen2RMSNorm and n.weight.dtype == torch.float32 and rmsnorm_supported(x, n.weight)
               for n in norms):
        return "norms the kernels do not reproduce"
    if getattr(attn, "sliding_window", None) is not None or (attn.training and attn.attention_dropout):
        return "sliding window or attention dropout"
    if not isinstance(mlp.act_fn, _silu_types()):
        return "MLP activation is not SiLU"
    if x.dtype != torch.float32 or x.dim() != 3 or x.shape[0] != 1:
        return "hidden states are not fp32 packed rows"
    cur = settings.current()
    from solution.step import attention

    if not attention.varlen_enabled():
        return "attention on the padded layout"
    # Inputs shaped like the step's but with more rows than bnb's small-M rule covers: the plan
    # must not depend on this step's token count (``small_m`` asks bnb's rule every step).
    # Expanded views of one element: nothing is allocated.
    def probe(k: int, dtype):
        return torch.empty(1, dtype=dtype, device=x.device).expand(1, PROBE_ROWS, k)

    sides, linears = [], []
    for mod in (attn.q_proj, attn.v_proj):
        if type(mod) is not LoraLinear4bit:
            return "q_proj / v_proj are not peft LoRA over bnb 4-bit"
        why, spec = peft_lora_bnb.resolve(mod, probe(x.shape[-1], x.dtype), (), {})
        if why is not None:
            return why
        _, base, plan, wa, wb, dropout, scaling = spec
        sides.append(LoraPlan(plan, _bnb.linear4bit_bias(base), wa, wb, dropout, scaling))
        linears.append((base, plan))
    q, v = sides
    if (q.dropout.training, getattr(q.dropout, "p", 0.0)) != (v.dropout.training, getattr(v.dropout, "p", 0.0)):
        return "q and v with different dropouts"
    plans = {}
    for name in ("k_proj", "o_proj"):
        mod = getattr(attn, name)
        if type(mod) is not Linear4bit:
            return f"{name} is not a plain bnb Linear4bit (LoRA on it?)"
        plans[name] = _bnb.linear_plan(mod)
        why = _bnb.call_reason(plans[name], mod, probe(plans[name].k, x.dtype if name == "k_proj" else torch.float16))
        if why is not None:
            return f"{name}: {why}"
        linears.append((mod, plans[name]))
    if attn.o_proj.bias is not None:
        return "o_proj has a bias"
    mods = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if not all(type(m) is Linear4bit and m.bias is None for m in mods):
        return "MLP projections are not bias-free bnb Linear4bit"
    gate, up, down = (_bnb.linear_plan(m) for m in mods)
    if gate.reason or up.reason or down.reason or down.k != gate.n_out or up.n_out != gate.n_out:
        return "MLP weights our NF4 path does not take"
    linears += list(zip(mods, (gate, up, down)))
    cfg = attn.config
    n_heads, n_kv, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim
    if (q.plan.n_out != n_heads * head_dim or v.plan.n_out != n_kv * head_dim
            or plans["o_proj"].k != n_heads * head_dim or n_heads % n_kv):
        return "projection shapes"
    valid = _validator(layer, [(attn.q_proj, q.dropout), (attn.v_proj, v.dropout)], linears)
    return LayerPlan(q=q, v=v, k=plans["k_proj"], k_bias16=_bnb.linear4bit_bias(attn.k_proj), o=plans["o_proj"],
                     mlp=(gate, up, down), policy=cur.memory_policy,
                     norm1_w=norms[0].weight, norm2_w=norms[1].weight, eps1=float(norms[0].variance_epsilon),
                     eps2=float(norms[1].variance_epsilon), n_heads=n_heads, n_kv=n_kv, head_dim=head_dim,
                     scale=attn.scaling, valid=valid)


def install(swaps) -> str:
    import sys

    from solution.step import layer

    swaps.set(layer, "PLANNER", sys.modules[__name__])
    return ("each packed decoder layer as one autograd node (the same kernels in the same order; "
            "q/k/v input gradients summed in one Triton kernel); layers it does not mirror run as modules")
