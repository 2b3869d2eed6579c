"""Qwen2MLP.forward with the fused SwiGLU kernel (solution/kernels/swiglu.py).

Stock: ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``. Ours calls the same three projection
modules (so whatever is installed on bitsandbytes' Linear4bit / peft's LoRA layers still runs),
and replaces ``act_fn(g) * u`` by one Triton kernel forward and one backward, with the backward
writing dg / du in place into g / u (temporaries of this forward, read by nobody else).

Falls back to the stock forward, unchanged, when the activation is not SiLU, or x is on a device
our kernels do not run on; and to the stock expression ``act_fn(g) * u`` when the projections'
outputs are not supported (mixed dtypes, bf16 before sm_80, fp64...).
"""
from __future__ import annotations

import torch

NAME = "qwen2_mlp"


def check() -> str | None:
    try:
        from transformers.models.qwen2 import modeling_qwen2
    except Exception as exc:  # transformers missing or broken
        return f"transformers' Qwen2 is not importable ({type(exc).__name__}: {exc})"
    if not hasattr(modeling_qwen2, "Qwen2MLP") or "forward" not in modeling_qwen2.Qwen2MLP.__dict__:
        return "transformers has no Qwen2MLP.forward (another transformers version?)"
    try:
        import solution.kernels.swiglu  # noqa: F401
    except Exception as exc:
        return f"swiglu kernel not importable ({type(exc).__name__}: {exc})"
    return None


def _silu_types() -> tuple:
    from transformers.activations import SiLUActivation

    return (SiLUActivation, torch.nn.SiLU)


def make_forward(stock_forward):
    """Our Qwen2MLP.forward; ``stock_forward`` is the one it replaces (used for every fallback)."""
    from solution.env import interpreter_enabled
    from solution.kernels.swiglu import swiglu, unsupported_reason

    silu_types = _silu_types()

    def forward(self, x):
        on_kernel_device = x.device.type == "cuda" or (x.device.type == "cpu" and interpreter_enabled())
        if not on_kernel_device or not isinstance(self.act_fn, silu_types):
            return stock_forward(self, x)
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

    cls = modeling_qwen2.Qwen2MLP
    swaps.set(cls, "forward", make_forward(cls.__dict__["forward"]))
    return ("Qwen2MLP.forward: gate_proj, up_proj, one Triton SwiGLU kernel (backward: one kernel, "
            "dg/du in place), down_proj")
