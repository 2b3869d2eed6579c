"""Qwen2MLP.forward with the fused SwiGLU kernel (solution/kernels/swiglu.py).

Stock: ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``. Ours calls the same three projection
modules (so whatever is installed on bitsandbytes' Linear4bit / peft's LoRA layers still runs),
and replaces ``act_fn(g) * u`` by one Triton kernel forward and one backward, with the backward
writing dg / du in place into g / u (temporaries of this forward, read by nobody else).

When the three projections are plain bnb NF4 ``Linear4bit`` layers on our NF4 path (the
bnb_linear4bit patch installed, no bias, no hooks, no LoRA) and x is fp32 with a gradient (the
workload's training step), the whole block runs as ONE autograd function that keeps the gate / up
outputs in fp16 and follows the memory policy (solution/kernels/nf4_mlp.py: same values as stock,
half the saved bytes, no fp32 round trips). Otherwise the per-projection path above.

Falls back to the stock forward, unchanged, when the activation is not SiLU, or x is on a device
our kernels do not run on; and to the stock expression ``act_fn(g) * u`` when the projections'
outputs are not supported (mixed dtypes, bf16 before sm_80, fp64...).
"""
from __future__ import annotations

import torch

from solution import settings
from solution.hooks import has_hooks
from solution.kernels._device import runs_here

NAME = "qwen2_mlp"


def check() -> str | None:
    try:
        from transformers.models.qwen2 import modeling_qwen2
    except Exception as exc:  # transformers missing or broken
        return f"transformers' Qwen2 is not importable ({type(exc).__name__}: {exc})"
    if not hasattr(modeling_qwen2, "Qwen2MLP") or "forward" not in modeling_qwen2.Qwen2MLP.__dict__:
        return "transformers has no Qwen2MLP.forward (another transformers version?)"
    # The mirror calls the three projections as stock does: only a reviewed stock body (sha256,
    # solution/patches/_sources.py) is replaced.
    from solution.patches._sources import unexpected_source

    reason = unexpected_source("transformers.Qwen2MLP.forward", modeling_qwen2.Qwen2MLP.__dict__["forward"])
    if reason is not None:
        return reason
    # Private torch call: the SwiGLU backward writes dg / du into g / u and bumps their version
    # counters (torch._C._increment_version) so that autograd refuses a later reuse of them.
    if not callable(getattr(torch._C, "_increment_version", None)):
        return "torch._C._increment_version is missing (the SwiGLU backward's in-place writes would go unmarked)"
    try:
        import solution.kernels.swiglu  # noqa: F401
    except Exception as exc:
        return f"swiglu kernel not importable ({type(exc).__name__}: {exc})"
    return None


def _silu_types() -> tuple:
    from transformers.activations import SiLUActivation

    return (SiLUActivation, torch.nn.SiLU)


def _callable_directly(module) -> bool:
    """No module hooks (its own or global), and no per-instance forward (accelerate's hooks replace
    ``module.forward`` on the instance and set ``_hf_hook``): a fused call would skip either."""
    return not (has_hooks(module) or "forward" in module.__dict__ or hasattr(module, "_hf_hook"))


def fused_plans(mlp, x: torch.Tensor):
    """(gate, up, down) LinearPlans when this call can run as one fused NF4 MLP function (see the
    module doc), else None."""
    if x.dtype != torch.float32 or not (torch.is_grad_enabled() and x.requires_grad) or x.numel() == 0:
        return None
    try:
        from bitsandbytes.nn import Linear4bit
    except Exception:
        return None
    from solution.patches._bnb import bnb_would_use_fused_gemm_m, call_reason, linear_plan

    mods = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if not all(type(m) is Linear4bit and getattr(m, "bias", None) is None and _callable_directly(m) for m in mods):
        return None
    if getattr(Linear4bit.forward, "__wrapped__", None) is None:  # bnb_linear4bit patch not installed
        return None
    gate, up, down = (linear_plan(m) for m in mods)
    if call_reason(gate, mods[0], x) or call_reason(up, mods[1], x) or down.reason is not None:
        return None
    if down.k != gate.n_out or up.n_out != gate.n_out or down.device != gate.device:
        return None
    if bnb_would_use_fused_gemm_m(x.numel() // gate.k, x.device.index, down):
        return None
    return gate, up, down


def make_forward(stock_forward, policy: str = "speed"):
    """Our Qwen2MLP.forward; ``stock_forward`` is the one it replaces (used for every fallback).
    ``policy``: the fused NF4 MLP's memory policy (solution/kernels/nf4_mlp.py)."""
    from solution.kernels.nf4_mlp import nf4_mlp
    from solution.kernels.swiglu import swiglu, unsupported_reason

    silu_types = _silu_types()

    def forward(self, x):
        if not runs_here(x.device) or not isinstance(self.act_fn, silu_types):
            return stock_forward(self, x)
        if _callable_directly(self):
            plans = fused_plans(self, x)
            if plans is not None:
                return nf4_mlp(x, *plans, policy=policy)
        g = self.gate_proj(x)
        u = self.up_proj(x)
        if unsupported_reason(g, u) is not None:
            return self.down_proj(self.act_fn(g) * u)  # exactly the stock expression
        return self.down_proj(swiglu(g, u, inplace_backward=True))

    forward.__doc__ = "Qwen2MLP.forward with a fused Triton SwiGLU (solution.patches.qwen2_mlp)."
    forward._solution_stock = stock_forward
    return forward


def install(swaps) -> str:
    from transformers.models.qwen2 import modeling_qwen2

    cur = settings.current()  # read at install; apply() already checked it
    policy = cur.memory_policy
    cls = modeling_qwen2.Qwen2MLP
    swaps.set(cls, "forward", make_forward(cls.__dict__["forward"], policy))
    return ("Qwen2MLP.forward: NF4 gate/up/down + SwiGLU as one autograd function with fp16 "
            f"activations (memory policy {policy!r}) when the projections are bnb NF4 on our path; "
            "else gate_proj, up_proj, one Triton SwiGLU kernel (backward: one kernel, dg/du in place), down_proj")
