"""Route ``modeling_qwen2.apply_rotary_pos_emb`` through our Triton RoPE (solution/kernels/rope.py).

Qwen2Attention.forward looks the function up as a module global at call time, so swapping the
global is enough. The replacement rotates q and k in one kernel launch when the call is the one
Qwen2 makes (``apply_rotary_pos_emb(q, k, cos, sin)``, unsqueeze_dim 1, q/k 4-D [B, H, L, D],
cos/sin [B or 1, L, D], fp16/fp32, on CUDA or on the CPU under Triton's interpreter) and hands
everything else (other unsqueeze_dim, extra arguments, bf16, cos/sin requiring grad...) to the
stock function unchanged.

Refused (check()) unless the installed ``apply_rotary_pos_emb`` and ``rotate_half`` are reviewed
sources (sha256, solution/patches/_sources.py).
"""
from __future__ import annotations

from solution.kernels._device import cuda_or_runs_here
from solution.patches._sources import first_unexpected

NAME = "qwen2_rope"


def _stock_is_expected(modeling_qwen2) -> str | None:
    """The kernel reproduces `x * cos + rotate_half(x) * sin`; refuse unless both functions are
    reviewed sources (sha256, solution/patches/_sources.py)."""
    return first_unexpected(("transformers.apply_rotary_pos_emb", getattr(modeling_qwen2, "apply_rotary_pos_emb", None)),
                            ("transformers.rotate_half", getattr(modeling_qwen2, "rotate_half", None)))


def check() -> str | None:
    try:
        from transformers.models.qwen2 import modeling_qwen2
    except Exception as exc:
        return f"transformers' Qwen2 is not importable ({type(exc).__name__}: {exc})"
    if not callable(getattr(modeling_qwen2, "apply_rotary_pos_emb", None)):
        return "transformers' modeling_qwen2 has no apply_rotary_pos_emb"
    return _stock_is_expected(modeling_qwen2)


def install(swaps) -> str:
    from transformers.models.qwen2 import modeling_qwen2

    from solution.kernels.rope import rope, rope_supported

    stock = modeling_qwen2.apply_rotary_pos_emb

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        # Only the call Qwen2 makes: unsqueeze_dim == 1 (positional or keyword), nothing else.
        if len(args) + len(kwargs) == 0:
            unsqueeze_dim = 1
        elif len(args) == 1 and not kwargs:
            unsqueeze_dim = args[0]
        elif not args and set(kwargs) == {"unsqueeze_dim"}:
            unsqueeze_dim = kwargs["unsqueeze_dim"]
        else:
            unsqueeze_dim = None
        if unsqueeze_dim == 1 and rope_supported(q, k, cos, sin):
            if cuda_or_runs_here(q.device):
                return rope(q, k, cos, sin)
        return stock(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.__doc__ = ("modeling_qwen2.apply_rotary_pos_emb through solution's Triton RoPE "
                                    "(q and k in one launch; stock fallback). " + (stock.__doc__ or ""))
    apply_rotary_pos_emb._solution_stock = stock
    swaps.set(modeling_qwen2, "apply_rotary_pos_emb", apply_rotary_pos_emb)
    return "modeling_qwen2.apply_rotary_pos_emb -> Triton RoPE, q and k in one launch (fp16/fp32; stock otherwise)"
