"""``transformers.Trainer._clip_grad_norm``: the gradient clip handed only the parameters that
hold a gradient.

What it replaces: every step the Trainer clips with
``accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)``. With one process accelerate
unscales the gradients (fp16's GradScaler), then loops over the list once (its DTensor grouping),
and torch's ``clip_grad_norm_`` loops over it twice more (the gradients of the norm, then those
it scales). Each loop reads ``.grad`` of all 450 parameters of the workload's model; for the 196
bitsandbytes 4-bit weights every such read goes through their ``__torch_function__``. Only the
112 LoRA weights hold a gradient. Measured on the H200 host (graphs off, one run's host split,
bench/host_split.py): the clip phase 7.3 ms a step.

What it does instead: one pass reads every parameter's ``.grad`` with tensor-subclass overrides
off (bitsandbytes' ``__torch_function__`` hands a ``.grad`` read to torch unchanged: the same
tensor, or None) and keeps the parameters that hold one, in ``model.parameters()``'s order;
accelerate's ``clip_grad_norm_`` gets that list instead of all parameters. In the reviewed code
every use of the list skips a parameter whose ``.grad`` is None and keeps the order of the others
(accelerate's DTensor grouping, torch's norm and its clip: the documented contract of
``torch.nn.utils.clip_grad_norm_``), and the unscale does not read the list. So the unscaled
gradients, the norm (the same tensors in the same order), the clip coefficient, the clipped
gradients and the returned norm are the same bits.

Where: one process (``accelerator.distributed_type`` NO), SageMaker model parallelism off
and no mixed DTensor meshes (both stock's own branches), and the reviewed sources of
``Trainer._clip_grad_norm`` (transformers 5.17.0-5.24.0), ``Accelerator.clip_grad_norm_`` and
``Accelerator._clip_grad_norm_dtensor_aware`` (accelerate 1.15.0-1.16.0) and torch's
``clip_grad_norm_`` with its ``_get_total_norm`` and ``_clip_grads_with_norm_`` (torch
2.10.0-2.13.0), sha256 in solution/patches/_sources.py; anything else: stock.

Risk: a later release whose clip uses a parameter without a gradient (the hash check refuses any
other source); tests/test_trainer_clip.py compares the returned norm and every gradient with
stock's bit for bit, with gradients missing on some trainable parameters and set on a frozen one.
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
    """The parameters of ``model`` that hold a gradient, in ``model.parameters()``'s order (the
    ``.grad`` reads with tensor-subclass overrides off: the same tensors)."""
    import torch

    with torch._C.DisableTorchFunctionSubclass():
        return [p for p in model.parameters() if p.grad is not None]


def _single_process(trainer, model) -> bool:
    """Stock's clip would take accelerate's one-process branch (``_clip_grad_norm``'s own
    branches not taken)."""
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
