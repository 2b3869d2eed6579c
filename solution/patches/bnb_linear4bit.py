"""Route bitsandbytes.nn.Linear4bit.forward (NF4, fp16 compute) through our NF4 linear: one
Triton launch (weight dequantization + fp16 cast of x) into a reused buffer + the same cuBLAS
F.linear as bnb. The bnb side (the layer's cached plan, bnb's quant-state repair and fused-GEMM
choice, the in-place bias cast) is solution/patches/_bnb.py.

Everything else (FP4, bf16/fp32 compute dtype, bnb's fused small-M GEMM, CPU without the Triton
interpreter, odd states) goes to the original forward, unchanged.

Refused (check()) unless bitsandbytes' ``Linear4bit.forward``, ``matmul_4bit`` and CUDA
``gemm_4bit`` dispatch are reviewed sources (sha256, solution/patches/_sources.py: 0.50.0-0.50.2).
"""
from __future__ import annotations

NAME = "bnb_linear4bit"


def bnb_sources_reason() -> str | None:
    """None when the bitsandbytes code our NF4 path stands in for is the reviewed one (sha256,
    solution/patches/_sources.py): ``Linear4bit.forward`` (quant-state repair, bias cast, compute
    dtype), ``matmul_4bit`` and the CUDA ``gemm_4bit`` dispatch whose fused small-M choice
    solution/patches/_bnb.py reproduces (it reads the private ``_gemm_4bit_custom_max_m`` and
    ``_gemm_4bit_use_custom_fn`` of that module); else the reason. Also asked by peft_lora_bnb,
    whose base layer runs the same path."""
    try:
        import bitsandbytes
        from bitsandbytes.nn import Linear4bit
        from bitsandbytes.nn.modules import fix_4bit_weight_quant_state_from_module  # noqa: F401
    except Exception as exc:  # ImportError, or a bnb without these names
        return f"bitsandbytes.nn.Linear4bit not importable ({type(exc).__name__}: {exc})"
    from solution.patches._sources import first_unexpected, unexpected_registered_kernel

    return (first_unexpected(("bitsandbytes.nn.Linear4bit.forward", Linear4bit.__dict__.get("forward")),
                             ("bitsandbytes.matmul_4bit", getattr(bitsandbytes, "matmul_4bit", None)))
            or unexpected_registered_kernel("bitsandbytes.backends.cuda.ops.gemm_4bit[cuda]",
                                            "bitsandbytes.backends.cuda.ops", "bitsandbytes::gemm_4bit", "cuda"))


def check() -> str | None:
    return bnb_sources_reason()


def make_forward(original_forward):
    """The replacement Linear4bit.forward; ``original_forward`` takes every unsupported call."""
    from solution.patches._bnb import call_reason, linear4bit_bias, linear_plan, nf4_linear_call

    def forward(self, x):
        plan = linear_plan(self)  # cached per layer; includes bnb's quant-state repair
        if call_reason(plan, self, x) is not None:
            return original_forward(self, x)
        return nf4_linear_call(plan, x, linear4bit_bias(self))

    forward.__wrapped__ = original_forward
    return forward


def install(swaps) -> str:
    from bitsandbytes.nn import Linear4bit

    original = Linear4bit.__dict__["forward"]
    swaps.set(Linear4bit, "forward", make_forward(original))
    return ("Linear4bit.forward: NF4 dequant + fp16 cast of x in 1 Triton launch (reused buffer) + cuBLAS, "
            "backward grad_input only")
