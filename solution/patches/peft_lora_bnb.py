"""Route peft.tuners.lora.bnb.Linear4bit.forward (LoRA on a frozen NF4 linear: q_proj, v_proj)
through solution.kernels.lora_nf4 for the one case training uses: a single active adapter, not
merged, adapters enabled, plain LoRA (no DoRA / aLoRA / other variant, no LoRA bias), nn.Dropout
(0 <= p < 1, not in place) or no dropout, no hooks on the sub-modules we bypass, under
torch.autocast(fp16), base layer accepted by our NF4 linear. Anything else runs peft's original
forward. The checks are written to cost a few microseconds per call (they run 56 x 2 times per
training step); the base layer's own checks are cached in its ``LinearPlan``.

Refused (check()) unless peft's ``Linear4bit.forward`` (0.20.0-0.21.2) and bitsandbytes' path
(bnb_linear4bit's gate, 0.50.0-0.50.2) are reviewed sources (sha256, solution/patches/_sources.py).
"""
from __future__ import annotations

import torch

from solution.hooks import has_hooks
from solution.step import packing

NAME = "peft_lora_bnb4bit"
# What else needs this patch: apply()'s line says it when the patch is skipped. Stock peft's
# dropout would draw over the packed rows (other random numbers than stock's padded draw), so a
# model with LoRA dropout > 0 then keeps the stock forward (solution/step/decoder.py, _dropouts_ok).
ALSO_OFF_WHEN_SKIPPED = ("the packed step (no work on padding) and the decoder CUDA graphs when LoRA dropout is > 0 "
                         "(the workload's 0.05)")


def check() -> str | None:
    try:
        from peft.tuners.lora import bnb as lora_bnb
    except Exception as exc:
        return f"peft.tuners.lora.bnb not importable ({type(exc).__name__}: {exc})"
    if not hasattr(lora_bnb, "Linear4bit"):
        return "peft has no lora.bnb.Linear4bit (bitsandbytes 4-bit not available to peft)"
    # The replacement mirrors peft's forward and runs the base layer's path itself: both must be
    # reviewed sources (sha256, solution/patches/_sources.py).
    from solution.patches._sources import unexpected_source
    from solution.patches.bnb_linear4bit import bnb_sources_reason

    return (unexpected_source("peft.tuners.lora.bnb.Linear4bit.forward", lora_bnb.Linear4bit.__dict__.get("forward"))
            or bnb_sources_reason())


def _autocast_fp16(device_type: str) -> bool:
    # peft decides with torch.is_autocast_enabled() (the CUDA autocast); F.linear casts with the
    # autocast of the tensors' device. Both must say fp16 for our path to compute what peft does.
    return (torch.is_autocast_enabled() and torch.is_autocast_enabled(device_type)
            and torch.get_autocast_dtype(device_type) == torch.float16)


_LINEAR, _DROPOUTS = torch.nn.Linear, (torch.nn.Dropout, torch.nn.Identity)
_bnb_linear4bit = None  # bitsandbytes.nn.Linear4bit, imported on first use
_bnb = None             # solution.patches._bnb, imported on first use


def _param(module: torch.nn.Module, name: str):
    """``module.<name>`` for a parameter, without nn.Module.__getattr__'s Python overhead."""
    params = module._parameters
    return params[name] if name in params else getattr(module, name, None)


def resolve(layer, x: torch.Tensor, args, kwargs):
    """(None, (adapter, base layer, its plan, lora_A weight, lora_B weight, dropout, scaling)) when our path
    computes exactly what peft would; else (reason, None). Sub-modules and parameters are read
    from nn.Module's own dicts (``module.attr`` goes through a Python __getattr__; its cost:
    docs/kernels/lora_nf4.md, section 3)."""
    global _bnb_linear4bit, _bnb
    if _bnb is None:
        import bitsandbytes as bnb

        from solution.patches import _bnb as bnb_glue
        _bnb_linear4bit, _bnb = bnb.nn.Linear4bit, bnb_glue
    if args or (kwargs and any(v is not None for v in kwargs.values())):
        return "extra forward arguments", None
    if layer.disable_adapters or layer.merged:
        return "adapters disabled or merged", None
    mods = layer._modules
    try:
        lora_As, lora_Bs, dropouts = mods["lora_A"]._modules, mods["lora_B"]._modules, mods["lora_dropout"]._modules
        base = mods["base_layer"]
    except (KeyError, AttributeError):
        return "not the LoRA layer layout this patch knows", None
    active = [a for a in layer.active_adapters if a in lora_As]
    if len(active) != 1:
        return f"{len(active)} active adapters", None
    name = active[0]
    if name in getattr(layer, "lora_variant", ()) or getattr(layer, "use_dora", {}).get(name, False):
        return "LoRA variant (DoRA / aLoRA / ...)", None
    lora_a, lora_b, dropout = lora_As[name], lora_Bs.get(name), dropouts.get(name)
    if type(lora_a) is not _LINEAR or type(lora_b) is not _LINEAR:
        return "lora_A / lora_B are not plain nn.Linear", None
    if _param(lora_a, "bias") is not None or _param(lora_b, "bias") is not None:
        return "LoRA bias", None
    scaling = layer.scaling.get(name)
    if not isinstance(scaling, (int, float)):
        return "non-scalar scaling", None
    if type(dropout) not in _DROPOUTS or (type(dropout) is torch.nn.Dropout and (dropout.inplace or dropout.p >= 1)):
        return "custom dropout module (or p >= 1, in place)", None
    if x.dtype is not torch.float32 and x.dtype is not torch.float16:
        return f"input dtype {x.dtype}", None
    dev = x.device
    if not _autocast_fp16(dev.type):
        return "not under torch.autocast(fp16)", None
    if (type(base) is not _bnb_linear4bit or "forward" in base.__dict__
            or any(has_hooks(m) for m in (base, lora_a, lora_b, dropout))):
        return "base layer is not a plain bnb Linear4bit, or hooks on the modules we bypass", None
    wa, wb = _param(lora_a, "weight"), _param(lora_b, "weight")
    if not (wa.device == dev and wb.device == dev):
        return "LoRA weights on another device", None
    plan = _bnb.linear_plan(base)
    reason = _bnb.call_reason(plan, base, x)
    if reason is not None:
        return f"base: {reason}", None
    if wa.shape[1] != plan.k or wb.shape[0] != plan.n_out:
        return "LoRA shapes", None
    if x.numel() >= _bnb.MAX_CAST_ELEMENTS or x.numel() // plan.k * plan.n_out >= _bnb.MAX_CAST_ELEMENTS:
        return "too many elements for int32 indexing", None
    return None, (name, base, plan, wa, wb, dropout, scaling)


def unsupported_reason(layer, x: torch.Tensor, args, kwargs) -> tuple[str | None, str | None]:
    """(None, adapter name) when our path computes exactly what peft would; else (reason, None)."""
    reason, spec = resolve(layer, x, args, kwargs)
    return reason, None if spec is None else spec[0]


def make_forward(original_forward):
    from solution.kernels.lora_nf4 import lora_dropout, lora_nf4
    from solution.patches._bnb import linear4bit_bias

    def forward(self, x, *args, **kwargs):
        reason, spec = resolve(self, x, args, kwargs)
        if reason is not None:
            return original_forward(self, x, *args, **kwargs)
        _, base, plan, wa, wb, dropout, scaling = spec
        # bnb's Linear4bit prologue (its in-place fp16 cast of the bias), then torch's dropout op
        # on x, in peft's order (the base layer consumes no random numbers)
        bias16 = linear4bit_bias(base)
        xd, mask, mode, drop_scale = lora_dropout(dropout, x, defer=True, packed=packing.active(),
                                                  mask_source=packing.dropout_mask_source())
        return lora_nf4(x, wa, wb, bias16, plan, xd, mask, mode, drop_scale, scaling)

    forward.__wrapped__ = original_forward
    forward._solution_lora_dropout = True  # draws dropout over the padded shape (see qwen2_unpad)
    return forward


def install(swaps) -> str:
    from peft.tuners.lora.bnb import Linear4bit

    original = Linear4bit.__dict__["forward"]
    swaps.set(Linear4bit, "forward", make_forward(original))
    return ("peft lora.bnb.Linear4bit.forward: NF4 base + LoRA in one autograd Function; dequant + fp16 casts "
            "in one Triton launch each way, fused combine and input-gradient/dropout-backward kernels")
