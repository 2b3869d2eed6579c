"""Route peft.tuners.lora.bnb.Linear4bit.forward (LoRA on a frozen NF4 linear: q_proj, v_proj)
through solution.kernels.lora_nf4 for the one case training uses: a single active adapter, not
merged, adapters enabled, plain LoRA (no DoRA / aLoRA / other variant, no LoRA bias), nn.Dropout
or no dropout, under torch.autocast(fp16), base layer accepted by our NF4 linear. Anything else
runs peft's original forward.
"""
from __future__ import annotations

import torch

NAME = "peft_lora_bnb4bit"


def check() -> str | None:
    try:
        from peft.tuners.lora import bnb as lora_bnb
    except Exception as exc:
        return f"peft.tuners.lora.bnb not importable ({type(exc).__name__}: {exc})"
    if not hasattr(lora_bnb, "Linear4bit"):
        return "peft has no lora.bnb.Linear4bit (bitsandbytes 4-bit not available to peft)"
    return None


def _has_hooks(module: torch.nn.Module) -> bool:
    from torch.nn.modules import module as nn_module

    return bool(module._forward_hooks or module._forward_pre_hooks
                or getattr(module, "_forward_hooks_with_kwargs", None)
                or nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)


def _autocast_fp16(device: torch.device) -> bool:
    # peft decides with torch.is_autocast_enabled() (the CUDA autocast); F.linear casts with the
    # autocast of the tensors' device. Both must say fp16 for our path to compute what peft does.
    dev = device.type
    return (torch.is_autocast_enabled() and torch.is_autocast_enabled(dev)
            and torch.get_autocast_dtype(dev) == torch.float16)


def unsupported_reason(layer, x: torch.Tensor, args, kwargs) -> tuple[str | None, str | None]:
    """(None, adapter name) when our path computes exactly what peft would; else (reason, None)."""
    import bitsandbytes as bnb
    from bitsandbytes.nn.modules import fix_4bit_weight_quant_state_from_module

    from solution.kernels.nf4_linear import linear4bit_unsupported

    if args or any(v is not None for v in kwargs.values()):
        return "extra forward arguments", None
    if layer.disable_adapters or layer.merged:
        return "adapters disabled or merged", None
    active = [a for a in layer.active_adapters if a in layer.lora_A.keys()]
    if len(active) != 1:
        return f"{len(active)} active adapters", None
    name = active[0]
    if name in getattr(layer, "lora_variant", {}) or getattr(layer, "use_dora", {}).get(name, False):
        return "LoRA variant (DoRA / aLoRA / ...)", None
    lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
    if type(lora_a) is not torch.nn.Linear or type(lora_b) is not torch.nn.Linear:
        return "lora_A / lora_B are not plain nn.Linear", None
    if lora_a.bias is not None or lora_b.bias is not None:
        return "LoRA bias", None
    if not isinstance(layer.scaling.get(name), (int, float)):
        return "non-scalar scaling", None
    if type(layer.lora_dropout[name]) not in (torch.nn.Dropout, torch.nn.Identity):
        return "custom dropout module", None
    if x.dtype not in (torch.float32, torch.float16):
        return f"input dtype {x.dtype}", None
    if not _autocast_fp16(x.device):
        return "not under torch.autocast(fp16)", None
    base = layer.get_base_layer()
    if not isinstance(base, bnb.nn.Linear4bit) or _has_hooks(base) or "forward" in base.__dict__:
        return "base layer is not a plain bnb Linear4bit", None
    if lora_a.weight.device != x.device or lora_b.weight.device != x.device:
        return "LoRA weights on another device", None
    if lora_a.in_features != x.shape[-1] or lora_b.out_features != base.out_features:
        return "LoRA shapes", None
    fix_4bit_weight_quant_state_from_module(base)
    reason = linear4bit_unsupported(base, x)
    if reason is not None:
        return f"base: {reason}", None
    return None, name


def make_forward(original_forward):
    from solution.kernels.lora_nf4 import lora_nf4
    from solution.kernels.nf4_linear import linear4bit_bias

    def forward(self, x, *args, **kwargs):
        reason, name = unsupported_reason(self, x, args, kwargs)
        if reason is not None:
            return original_forward(self, x, *args, **kwargs)
        self._check_forward_args(x)
        base = self.get_base_layer()
        # bnb's Linear4bit prologue (with its in-place fp16 cast of the bias), then torch's own
        # dropout call on x, in peft's order (the base layer consumes no random numbers)
        bias16 = linear4bit_bias(base)
        dropout = self.lora_dropout[name]
        xd = None
        if not isinstance(dropout, torch.nn.Identity):
            xd = dropout(x)
            if xd is x:  # eval mode: dropout is the identity
                xd = None
        return lora_nf4(x, xd, self.lora_A[name].weight, self.lora_B[name].weight, bias16,
                        base.weight, base.weight.quant_state, self.scaling[name])

    forward.__wrapped__ = original_forward
    return forward


def install(swaps) -> str:
    from peft.tuners.lora.bnb import Linear4bit

    original = Linear4bit.__dict__["forward"]
    swaps.set(Linear4bit, "forward", make_forward(original))
    return ("peft lora.bnb.Linear4bit.forward: NF4 base + LoRA in one autograd Function, "
            "fused scale/add/casts (Triton), torch dropout kept")
