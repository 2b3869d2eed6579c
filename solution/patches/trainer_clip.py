"""``transformers.Trainer._clip_grad_norm``: the gradient clip handed only the parameters that hold a gradient.

Stock's ``accelerator.clip_grad_norm_(model.parameters(), ...)`` reads ``.grad`` of all 450 parameters three
times a step (through ``__torch_function__`` for the 196 4-bit weights); only the 112 LoRA weights hold one.
Here one pass (subclass overrides off) keeps those, in order. In the reviewed code every use of the list skips
a parameter whose ``.grad`` is None and keeps the others' order, and the unscale does not read it: norm and
clipped gradients are the same bits (tests/test_trainer_clip.py). Only with one process, SageMaker model
parallelism off, no mixed DTensor meshes, and reviewed sources of the transformers, accelerate and torch
functions involved (``check``; sha256, solution/patches/_sources.py); anything else: stock.
"""
from __future__ import annotations

import functools

NAME = "trainer_clip"


def check() -> str | None:
    try:
        import transformers
        from accelerate import Accelerator
    except Exception as exc:  # noqa: BLE001 - transformers / accelerate missing or broken
        return f"transformers / accelerate not importable ({type(exc).__name__}: {exc})"
    import torch.nn.utils.clip_grad as clip_grad

    from solution.patches._sources import first_unexpected

    reason = first_unexpected(
        ("transformers.Trainer._clip_grad_norm", getattr(transformers.Trainer, "_clip_grad_norm", None)),
        ("accelerate.Accelerator.clip_grad_norm_", getattr(Accelerator, "clip_grad_norm_", None)),
        ("accelerate.Accelerator._clip_grad_norm_dtensor_aware",
         getattr(Accelerator, "_clip_grad_norm_dtensor_aware", None)),
        ("torch.nn.utils.clip_grad_norm_", getattr(clip_grad, "clip_grad_norm_", None)),
        ("torch.nn.utils.clip_grad._get_total_norm", getattr(clip_grad, "_get_total_norm", None)),
        ("torch.nn.utils.clip_grad._clip_grads_with_norm_", getattr(clip_grad, "_clip_grads_with_norm_", None)))
    if reason is not None:
        return reason
    # Private transformers method _single_process calls, as the reviewed _clip_grad_norm does.
    if not callable(getattr(transformers.Trainer, "_has_mixed_mesh_grads", None)):
        return "transformers.Trainer has no _has_mixed_mesh_grads()"
    return None


def with_grads(model) -> list:
    """The parameters of ``model`` that hold a gradient, in ``model.parameters()``'s order."""
    import torch

    with torch._C.DisableTorchFunctionSubclass():
        return [p for p in model.parameters() if p.grad is not None]


def _single_process(trainer, model) -> bool:
    """Stock's clip would take accelerate's one-process branch (none of ``_clip_grad_norm``'s own)."""
    from accelerate.utils import DistributedType
    from transformers.trainer import is_sagemaker_mp_enabled

    if is_sagemaker_mp_enabled() and trainer.args.fp16:
        return False
    if trainer._has_mixed_mesh_grads(model):
        return False
    return trainer.accelerator.distributed_type == DistributedType.NO


def _make_clip_grad_norm(stock):
    def _clip_grad_norm(self, model):
        if not _single_process(self, model):
            return stock(self, model)
        return self.accelerator.clip_grad_norm_(with_grads(model), self.args.max_grad_norm)

    functools.update_wrapper(_clip_grad_norm, stock)
    return _clip_grad_norm


def install(swaps) -> str:
    import transformers

    swaps.set(transformers.Trainer, "_clip_grad_norm", _make_clip_grad_norm(transformers.Trainer._clip_grad_norm))
    return ("Trainer._clip_grad_norm: the clip handed only the parameters that hold a gradient (the same "
            "unscale, norm and clipped gradients; 196 bitsandbytes weights no longer read three times a step)")
