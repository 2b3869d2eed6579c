"""bitsandbytes' ``Linear4bit`` as our NF4 linear (solution/kernels/nf4_linear.py) sees it, for the
patches that route such layers through it: bnb_linear4bit, peft_lora_bnb (its base layer) and
qwen2_mlp (the fused NF4 MLP). Everything here reads a bnb module object or bitsandbytes itself;
the kernel side takes the weight tensor, its quant state and the compute dtype.

- ``linear_plan(module)``: the layer's cached ``LinearPlan`` (one per layer, in a
  WeakKeyDictionary, re-validated by identity checks only: it is on the hot path, 196 linears per
  step), after bnb's quant-state repair as its forward does first.
- ``call_reason(plan, module, x)``: None when this call takes our path: the kernel's checks
  (``input_reason``) plus bnb's own choices we leave to bnb (its fused small-M GEMM on CUDA, its
  CPU inference repacking).
- ``linear4bit_bias(module)``: bnb's in-place fp16 cast of the bias parameter.

Imported by those patches when they install or first run (it imports the kernels, hence Triton);
bitsandbytes' own helpers are imported on first use.
"""
from __future__ import annotations

import weakref

import torch

# MAX_CAST_ELEMENTS and nf4_linear_call are for the patches: each imports this one module
from solution.kernels.nf4_dequant import MAX_CAST_ELEMENTS  # noqa: F401
from solution import state
from solution.kernels.nf4_linear import LinearPlan, input_reason, nf4_linear_call, release_scratch  # noqa: F401

_fix_quant_state = None  # bitsandbytes' fix_4bit_weight_quant_state_from_module, loaded lazily
_cuda_ops = None         # bitsandbytes.backends.cuda.ops (its fused-GEMM heuristic), loaded lazily

_PLANS: "weakref.WeakKeyDictionary" = state.kept(weakref.WeakKeyDictionary())  # Linear4bit -> LinearPlan


def _param(module, name: str):
    """``module.<name>`` for a parameter, without nn.Module.__getattr__'s Python overhead."""
    params = module._parameters
    return params[name] if name in params else getattr(module, name, None)


def linear_plan(module) -> LinearPlan:
    """The cached plan of a bnb ``Linear4bit`` (bnb's quant-state repair included, as its forward
    does first). Its compute dtype: ``module.compute_dtype`` once bnb fixed it
    (``compute_type_is_set``), else None (bnb's forward may still change it: left to bnb)."""
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


def bnb_would_use_fused_gemm_m(m: int, device_index, plan: LinearPlan) -> bool:
    """True when bnb 0.50's gemm_4bit would run its own fused 4-bit GEMM for this call (small M on
    CUDA), whose rounding differs from dequant + cuBLAS: we leave those calls to bnb. Mirrors
    ``bitsandbytes.backends.cuda.ops``' dispatch: M > ``_gemm_4bit_custom_max_m`` (1536) or K not a
    multiple of the blocksize -> dequant + F.linear; else ``_gemm_4bit_use_custom_fn`` decides."""
    global _cuda_ops
    if not plan.on_cuda:
        return False  # CPU: bnb's default gemm_4bit is dequant + F.linear, like ours
    k = plan.k
    if _cuda_ops is None:
        try:
            from bitsandbytes.backends.cuda import ops as _cuda_ops
        except Exception:
            _cuda_ops = False
    if _cuda_ops is False:
        return m <= 4
    if m > getattr(_cuda_ops, "_gemm_4bit_custom_max_m", 1536):
        return False
    if k % plan.qs.blocksize != 0:
        return False
    choose = getattr(_cuda_ops, "_gemm_4bit_use_custom_fn", None)
    if choose is None:
        return m <= 4
    return bool(choose(device_index, torch.float16, m, plan.n_out, k))


def call_reason(plan: LinearPlan, module, x: torch.Tensor) -> str | None:
    """None when this call (layer ``module``, its ``plan``, input ``x``) can take our path; else why not."""
    reason = input_reason(plan, x)
    if reason is not None:
        return reason
    if plan.on_cuda:
        if bnb_would_use_fused_gemm_m(x.numel() // plan.k, x.device.index, plan):
            return "bnb's fused small-M 4-bit GEMM keeps this call"
    elif getattr(module, "support_avx512bf16_for_cpu", False) and not module.training and not x.requires_grad:
        return "bnb's CPU inference repacking path"
    return None


def linear4bit_unsupported(module, x: torch.Tensor) -> str | None:
    """None when ``module`` (a bnb.nn.Linear4bit) called on ``x`` can take our path; else why not."""
    return call_reason(linear_plan(module), module, x)


def linear4bit_bias(module):
    """bnb's Linear4bit.forward bias handling, side effect included: the bias parameter is cast
    to fp16 IN PLACE when it differs (``bias.data = bias.data.to(x.dtype)``), then
    ``bias.to(compute_dtype)``, which returns the parameter itself once it is fp16."""
    bias = _param(module, "bias")
    if bias is not None and bias.dtype != torch.float16:
        bias.data = bias.data.to(torch.float16)
    return bias
