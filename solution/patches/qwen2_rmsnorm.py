"""Route ``Qwen2RMSNorm.forward`` through our fused Triton RMSNorm (solution/kernels/rmsnorm.py) where the
input is where our kernels run and ``rmsnorm_supported``; anything else: the stock forward. Stock's formula
and dtypes, ``weight * (x.float() * rstd).to(x.dtype)``, with or without autocast (which touches neither).
Refused (check()) unless the installed forward is a reviewed source (sha256, solution/patches/_sources.py).
"""
from __future__ import annotations

from solution.kernels._device import cuda_or_runs_here
from solution.patches._sources import unexpected_source

NAME = "qwen2_rmsnorm"


def _stock_forward_is_expected(forward) -> str | None:
    """The kernel reproduces this exact formula: the reason unless ``forward`` is a reviewed source."""
    return unexpected_source("transformers.Qwen2RMSNorm.forward", forward)


def check() -> str | None:
    try:
        from transformers.models.qwen2 import modeling_qwen2
    except Exception as exc:  # transformers missing or broken
        return f"transformers' Qwen2 is not importable ({type(exc).__name__}: {exc})"
    cls = getattr(modeling_qwen2, "Qwen2RMSNorm", None)
    if cls is None:
        return "transformers has no Qwen2RMSNorm"
    return _stock_forward_is_expected(cls.forward)


def install(swaps) -> str:
    import torch
    from transformers.models.qwen2 import modeling_qwen2

    from solution.kernels.rmsnorm import rmsnorm, rmsnorm_supported

    cls = modeling_qwen2.Qwen2RMSNorm
    stock_forward = cls.forward

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (cuda_or_runs_here(hidden_states.device) and isinstance(weight, torch.Tensor)
                and rmsnorm_supported(hidden_states, weight)):
            return rmsnorm(hidden_states, weight, self.variance_epsilon)
        return stock_forward(self, hidden_states)

    forward.__doc__ = "Qwen2RMSNorm.forward through solution's fused Triton RMSNorm (stock fallback)."
    forward.__qualname__ = "Qwen2RMSNorm.forward"
    forward._solution_stock = stock_forward
    swaps.set(cls, "forward", forward)
    return "Qwen2RMSNorm.forward -> fused Triton RMSNorm fwd+bwd (fp16/fp32; stock for anything else)"
