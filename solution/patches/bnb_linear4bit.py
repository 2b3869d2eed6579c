"""Route bitsandbytes.nn.Linear4bit.forward (NF4, fp16 compute) through our NF4 linear: one
Triton dequantization kernel into a reused buffer + the same cuBLAS F.linear as bnb.

Everything else (FP4, bf16/fp32 compute dtype, bnb's fused small-M GEMM, CPU without the Triton
interpreter, odd states) goes to the original forward, unchanged.
"""
from __future__ import annotations

NAME = "bnb_linear4bit"


def check() -> str | None:
    try:
        import bitsandbytes  # noqa: F401
        from bitsandbytes.nn import Linear4bit  # noqa: F401
        from bitsandbytes.nn.modules import fix_4bit_weight_quant_state_from_module  # noqa: F401
    except Exception as exc:  # ImportError, or a bnb without these names
        return f"bitsandbytes.nn.Linear4bit not importable ({type(exc).__name__}: {exc})"
    return None


def make_forward(original_forward):
    """The replacement Linear4bit.forward; ``original_forward`` takes every unsupported call."""
    from bitsandbytes.nn.modules import fix_4bit_weight_quant_state_from_module

    from solution.kernels.nf4_linear import linear4bit_prepare, linear4bit_unsupported, nf4_linear

    def forward(self, x):
        fix_4bit_weight_quant_state_from_module(self)
        if linear4bit_unsupported(self, x) is not None:
            return original_forward(self, x)
        inp_dtype = x.dtype
        x16, bias16 = linear4bit_prepare(self, x)
        return nf4_linear(x16, self.weight, self.weight.quant_state, bias16).to(inp_dtype)

    forward.__wrapped__ = original_forward
    return forward


def install(swaps) -> str:
    from bitsandbytes.nn import Linear4bit

    original = Linear4bit.__dict__["forward"]
    swaps.set(Linear4bit, "forward", make_forward(original))
    return "Linear4bit.forward: NF4 dequant (1 Triton kernel, reused buffer) + cuBLAS, backward grad_input only"
