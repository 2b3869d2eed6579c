"""bitsandbytes' ``Linear4bit`` as our NF4 kernels (kernels/nf4_linear.py) see it, for the decoder-layer node's
planner: everything here reads a bnb module or bitsandbytes itself; the kernel side takes the weight, its quant
state and the compute dtype. Imported by the planner when it first runs (bitsandbytes' helpers on first use).
"""
from __future__ import annotations

import weakref

import torch

from solution import state
from solution.kernels.nf4_linear import LinearPlan, input_reason, release_scratch

_fix_quant_state = None  # bitsandbytes' fix_4bit_weight_quant_state_from_module, loaded lazily

_PLANS: "weakref.WeakKeyDictionary" = state.kept(weakref.WeakKeyDictionary())  # Linear4bit -> LinearPlan


def _param(module, name: str):
    """``module.<name>`` for a parameter, without nn.Module.__getattr__'s Python overhead."""
    params = module._parameters
    return params[name] if name in params else getattr(module, name, None)


def linear_plan(module) -> LinearPlan:
    """The cached plan of a bnb ``Linear4bit`` (one per layer, re-validated by identity checks: hot path),
    after bnb's quant-state repair as its forward does first. Compute dtype: ``module.compute_dtype`` once
    bnb fixed it (``compute_type_is_set``), else None (left to bnb)."""
    global _fix_quant_state
    weight = _param(module, "weight")
    qs = getattr(weight, "quant_state", None)
    if qs is None:  # bnb's forward starts with this repair (e.g. after FSDP-style conversions)
        if _fix_quant_state is None:
            from bitsandbytes.nn.modules import fix_4bit_weight_quant_state_from_module as _fix_quant_state
        _fix_quant_state(module)
        weight = _param(module, "weight")
        qs = getattr(weight, "quant_state", None)
    compute_dtype = module.compute_dtype if module.compute_type_is_set else None
    plan = _PLANS.get(module)
    if plan is None or not plan.matches(weight, qs, compute_dtype):
        plan = LinearPlan(weight, qs, compute_dtype)
        _PLANS[module] = plan
    return plan


def release() -> None:
    """Drop the layers' plans and the kernel's scratch buffers (which the plans view)."""
    _PLANS.clear()
    release_scratch()


def call_reason(plan: LinearPlan, module, x: torch.Tensor) -> str | None:
    """None when this call can take our path (``input_reason``; bnb's CPU inference repacking is bnb's), else why."""
    reason = input_reason(plan, x)
    if reason is not None:
        return reason
    if not plan.on_cuda and getattr(module, "support_avx512bf16_for_cpu", False) and not module.training and not x.requires_grad:
        return "bnb's CPU inference repacking path"
    return None


def linear4bit_bias(module):
    """bnb's Linear4bit.forward bias handling, side effect included: the bias parameter cast to fp16 IN PLACE
    when it differs (``bias.data = bias.data.to(x.dtype)``); returns the parameter."""
    bias = _param(module, "bias")
    if bias is not None and bias.dtype != torch.float16:
        bias.data = bias.data.to(torch.float16)
    return bias
