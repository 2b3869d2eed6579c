"""Turns on the decoder-layer node (solution/step/layer.py, docs/layer_node.md) and is its planner: what
needs the libraries' modules (bitsandbytes' Linear4bit, peft's LoRA layer, transformers' Qwen2 classes) is
read here, once per layer, into a ``LayerPlan``, with a cheap per-step check (``_validator``).

Skipping it (``SOLUTION_SKIP_PATCHES=qwen2_layer_node``) turns off the packed step too. Refused (check())
unless every stock source the node stands in for is a reviewed one (``_mirrored``; sha256,
solution/patches/_sources.py).
"""
from __future__ import annotations

import inspect

import torch

from solution import state
from solution.hooks import has_hooks, own_hooks
from solution.patches._sources import first_unexpected

NAME = "qwen2_layer_node"
# What else this patch carries: apply()'s line says it when the patch is skipped.
ALSO_OFF_WHEN_SKIPPED = "the packed step (no work on padding) and the decoder CUDA graphs: stock's forward runs"

# the reviewed stock functions (unwrapped: a timing wrapper keeps them); plans are built only while installed
_CHECKED: list = state.kept([])

# rows of the probe inputs the plan is checked with (a plan must not depend on a step's token count)
PROBE_ROWS = 4096


def _mirrored():
    """(name in _sources.ACCEPTED, installed function) for every stock source the node mirrors."""
    import bitsandbytes
    from bitsandbytes.nn import Linear4bit
    from peft.tuners.lora import bnb as lora_bnb
    from torch.utils import checkpoint as torch_checkpoint
    from transformers.models.qwen2 import modeling_qwen2 as mq

    return (("transformers.Qwen2DecoderLayer.forward", mq.Qwen2DecoderLayer.__dict__.get("forward")),
            ("transformers.Qwen2Attention.forward", mq.Qwen2Attention.__dict__.get("forward")),
            ("transformers.Qwen2MLP.forward", mq.Qwen2MLP.__dict__.get("forward")),
            ("transformers.Qwen2RMSNorm.forward", mq.Qwen2RMSNorm.__dict__.get("forward")),
            ("transformers.apply_rotary_pos_emb", getattr(mq, "apply_rotary_pos_emb", None)),
            ("transformers.rotate_half", getattr(mq, "rotate_half", None)),
            ("peft.tuners.lora.bnb.Linear4bit.forward", lora_bnb.Linear4bit.__dict__.get("forward")),
            ("bitsandbytes.nn.Linear4bit.forward", Linear4bit.__dict__.get("forward")),
            ("bitsandbytes.matmul_4bit", getattr(bitsandbytes, "matmul_4bit", None)),
            ("torch.utils.checkpoint.checkpoint", getattr(torch_checkpoint, "checkpoint", None)))


def check() -> str | None:
    try:
        mirrored = _mirrored()
        from bitsandbytes.nn.modules import fix_4bit_weight_quant_state_from_module  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - transformers / peft / bitsandbytes missing or another layout
        return f"transformers' Qwen2, peft's LoRA over bitsandbytes 4-bit not importable ({type(exc).__name__}: {exc})"
    reason = first_unexpected(*mirrored)
    if reason is not None:
        return reason
    _CHECKED[:] = [inspect.unwrap(fn) for _, fn in mirrored]
    try:
        import solution.kernels.qkv_grad  # noqa: F401
        import solution.step.layer  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"the layer node is not importable ({type(exc).__name__}: {exc})"
    return None


def step_ok(x) -> bool:
    """fp16 autocast for x's device, as peft (``torch.is_autocast_enabled()``: CUDA's) and F.linear read it."""
    dev = x.device.type
    return (torch.is_autocast_enabled() and torch.is_autocast_enabled(dev)
            and torch.get_autocast_dtype(dev) == torch.float16)


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


def _frozen(layer, trained) -> tuple:
    """The layer's parameters other than ``trained`` (the q / v LoRA A and B weights): the node computes no
    gradient for them, so it takes the layer only while none of them requires one."""
    ids = {id(p) for p in trained}
    return tuple(p for p in layer.parameters() if id(p) not in ids)


def _validator(layer, sides, linears, frozen):
    """A plan's per-step check (attribute reads only): no hooks or instance-level forwards on the layer's
    modules, the same ``_lora_state``, the same packed weights, no ``frozen`` parameter requiring a gradient."""
    modules = tuple(layer.modules())
    states = [(mod, dropout, _lora_state(mod, dropout)) for mod, dropout in sides]

    def valid() -> bool:
        for m in modules:
            if own_hooks(m) or "forward" in m.__dict__:
                return False
        return (not any(p.requires_grad for p in frozen)
                and all(_lora_state(mod, dropout) == st for mod, dropout, st in states)
                and all(_weight_same(mod, plan) for mod, plan in linears))

    return valid


def _lora_side(layer, x):
    """(None, LoraPlan) when the node computes what peft's ``lora.bnb.Linear4bit.forward`` computes for
    ``layer`` on inputs like x, else (reason, None)."""
    from bitsandbytes.nn import Linear4bit

    from solution.patches import _bnb
    from solution.step.layer import LoraPlan

    if layer.disable_adapters or layer.merged:
        return "adapters disabled or merged", None
    mods = layer._modules
    try:
        lora_As, lora_Bs, dropouts = mods["lora_A"]._modules, mods["lora_B"]._modules, mods["lora_dropout"]._modules
        base = mods["base_layer"]
    except (KeyError, AttributeError):
        return "not the LoRA layer layout the node knows", None
    active = [a for a in layer.active_adapters if a in lora_As]
    if len(active) != 1:
        return f"{len(active)} active adapters", None
    name = active[0]
    if name in getattr(layer, "lora_variant", ()) or getattr(layer, "use_dora", {}).get(name, False):
        return "LoRA variant (DoRA / aLoRA / ...)", None
    lora_a, lora_b, dropout = lora_As[name], lora_Bs.get(name), dropouts.get(name)
    if type(lora_a) is not torch.nn.Linear or type(lora_b) is not torch.nn.Linear:
        return "lora_A / lora_B are not plain nn.Linear", None
    if lora_a.bias is not None or lora_b.bias is not None:
        return "LoRA bias", None
    scaling = layer.scaling.get(name)
    if not isinstance(scaling, (int, float)):
        return "non-scalar scaling", None
    if type(dropout) not in (torch.nn.Dropout, torch.nn.Identity) or (
            type(dropout) is torch.nn.Dropout and (dropout.inplace or dropout.p >= 1)):
        return "custom dropout module (or p >= 1, in place)", None
    if type(base) is not Linear4bit or any(has_hooks(m) for m in (base, lora_a, lora_b, dropout)):
        return "base layer is not a plain bnb Linear4bit, or hooks on the LoRA modules", None
    wa, wb = lora_a.weight, lora_b.weight
    if not (wa.device == x.device and wb.device == x.device):
        return "LoRA weights on another device", None
    plan = _bnb.linear_plan(base)
    reason = _bnb.call_reason(plan, base, x)
    if reason is not None:
        return f"base: {reason}", None
    if wa.shape[1] != plan.k or wb.shape[0] != plan.n_out:
        return "LoRA shapes", None
    return None, LoraPlan(plan, _bnb.linear4bit_bias(base), wa, wb, dropout, scaling)


def build(layer, x):
    """A LayerPlan for ``layer`` on x ([1, N, H] fp32 packed rows), or why not (a string)."""
    from bitsandbytes.nn import Linear4bit
    from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit
    from transformers.activations import SiLUActivation
    from transformers.models.qwen2 import modeling_qwen2 as mq

    from solution import settings
    from solution.kernels.rmsnorm import rmsnorm_supported
    from solution.patches import _bnb
    from solution.step import attention
    from solution.step.layer import LayerPlan

    if type(layer) is not mq.Qwen2DecoderLayer:
        return "not a Qwen2DecoderLayer"
    if [inspect.unwrap(fn) for _, fn in _mirrored()] != _CHECKED:
        return "a stock function the node mirrors was replaced after apply()"
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
    if not isinstance(mlp.act_fn, (SiLUActivation, torch.nn.SiLU)):
        return "MLP activation is not SiLU"
    if x.dtype != torch.float32 or x.dim() != 3 or x.shape[0] != 1:
        return "hidden states are not fp32 packed rows"
    if not attention.varlen_enabled():
        return "variable-length attention refused on this machine"

    # inputs like the step's with PROBE_ROWS rows (expanded views: nothing allocated)
    def probe(k: int, dtype):
        return torch.empty(1, dtype=dtype, device=x.device).expand(1, PROBE_ROWS, k)

    sides, linears = [], []
    for mod in (attn.q_proj, attn.v_proj):
        if type(mod) is not LoraLinear4bit:
            return "q_proj / v_proj are not peft LoRA over bnb 4-bit"
        why, side = _lora_side(mod, probe(x.shape[-1], x.dtype))
        if why is not None:
            return why
        sides.append(side)
        linears.append((mod.base_layer, side.plan))
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
    frozen = _frozen(layer, (q.wa, q.wb, v.wa, v.wb))
    if any(p.requires_grad for p in frozen):
        return "parameters other than q_proj / v_proj's LoRA A and B require gradients (the node computes only those)"
    valid = _validator(layer, [(attn.q_proj, q.dropout), (attn.v_proj, v.dropout)], linears, frozen)
    return LayerPlan(q=q, v=v, k=plans["k_proj"], k_bias16=_bnb.linear4bit_bias(attn.k_proj), o=plans["o_proj"],
                     mlp=(gate, up, down), policy=settings.current().memory_policy,
                     norm1_w=norms[0].weight, norm2_w=norms[1].weight, eps1=float(norms[0].variance_epsilon),
                     eps2=float(norms[1].variance_epsilon), n_heads=n_heads, n_kv=n_kv, head_dim=head_dim,
                     scale=attn.scaling, valid=valid)


def install(swaps) -> str:
    import sys

    from solution.step import layer

    swaps.set(layer, "PLANNER", sys.modules[__name__])
    return ("each packed decoder layer as one autograd node (the same operations as stock's modules in the same "
            "order); a step it does not take runs stock's forward")
