"""QLoRA training steps of the tiny stand-in, as the tests that compare whole steps run them.

tests/test_unpad.py and test_several_gpus.py (the packed step against stock), test_layer_node.py
(the decoder-layer node against stock and against itself), test_wrappers.py (instance wrappers
and hooks) and test_decoder_graphs.py (CUDA graphs against eager) all go through ``run_qlora``:
stock or solution.apply(), tests/test_unpad.py's qlora_tiny_model, the same seeds, the forward
under fp16 autocast with the fused LM head requested, the backward from loss x LOSS_SCALE (its
derivation: STEP_REL's comment in tests/test_unpad.py), the LoRA gradients and the generator after
every step. No optimizer: every step sees the same weights.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch


class Step(NamedTuple):
    loss: torch.Tensor  # the step's loss, detached, fp32
    grads: dict  # LoRA parameter name -> its gradient after the step (an fp32 copy)
    rng: object  # on "cuda" the CUDA generator's offset (cuda:0's), on the CPU torch.get_rng_state()


@dataclass
class Run:
    steps: list = field(default_factory=list)  # a Step per batch
    installed: dict = field(default_factory=dict)  # solution.apply()'s answer ({} for stock)
    launches: dict = field(default_factory=dict)  # our kernels' launches over the steps (kernels/_launches.py)
    after_forward: list = field(default_factory=list)  # after_forward(model) per step, where given
    after_steps: object = None  # after_steps(model), where given


def run_qlora(model_dir, batches, *, device="cuda", apply=False, device_map=None, ckpt=None, setup=None,
              accumulate=(), num_items_in_batch=None, autocast_ctx=None, after_forward=None,
              after_steps=None) -> Run:
    """One training forward + backward per batch ((input_ids, attention_mask, labels)) of
    qlora_tiny_model(model_dir, device, device_map), stock or with the solution; solution.revert()
    before and after.

    ``apply``: False stock; True solution.apply() with the $SOLUTION_* settings; a Settings: apply()
    with those. ``ckpt``: gradient checkpointing on with use_reentrant=ckpt (None: off). ``setup(model)``:
    called after that, before the seeds. The gradients are set to None before every step but those
    whose index is in ``accumulate`` (they add to the step before). ``num_items_in_batch``: passed to the
    forward as the Trainer passes it (a tensor on ``device``; None: not passed). ``autocast_ctx``: a
    factory of the autocast context (None: torch.autocast(device, fp16); the tests' autocast_ctx fixture
    on the CPU also makes peft see it). ``after_forward(model)``: called after each forward, before its
    backward (e.g. a hook's count); ``after_steps(model)``: after the last step, before revert()."""
    import solution
    from solution.kernels import _launches
    from solution.patches.qwen2_lm_head_loss import fused_lm_head_requested
    from tests.test_unpad import LOSS_SCALE, qlora_tiny_model

    if autocast_ctx is None:
        def autocast_ctx():
            return torch.autocast(device_type=device, dtype=torch.float16)

    run = Run()
    solution.revert()
    if apply is not False:
        run.installed = solution.apply(verbose=False, settings=None if apply is True else apply)
    try:
        model = qlora_tiny_model(model_dir, device, device_map=device_map)
        if ckpt is not None:  # what prepare_model_for_kbit_training(use_gradient_checkpointing=True) adds
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": ckpt})
            model.enable_input_require_grads()
            model.train()
        if setup is not None:
            setup(model)
        torch.manual_seed(0)  # the CPU's generator and every GPU's
        if device == "cuda":  # (done already by manual_seed; explicit: a model spread over two GPUs draws on both)
            torch.cuda.manual_seed_all(0)
        _launches.reset()
        for i, (ids, mask, labels) in enumerate(batches):
            if i not in accumulate:
                model.zero_grad(set_to_none=True)
            with autocast_ctx(), fused_lm_head_requested():
                extra = {} if num_items_in_batch is None else {
                    "num_items_in_batch": torch.tensor(num_items_in_batch, device=device)}
                out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False, **extra)
            if after_forward is not None:
                run.after_forward.append(after_forward(model))
            (out.loss * LOSS_SCALE).backward()  # normal fp16 gradients: STEP_REL's condition
            grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
            rng = torch.cuda.default_generators[0].get_offset() if device == "cuda" else torch.get_rng_state()
            run.steps.append(Step(out.loss.detach().float(), grads, rng))
            # as the Trainer (its training_step returns loss.detach()): this step's autograd graph is
            # not kept into the next step. Kept, its AccumulateGrad nodes (made on the eager steps'
            # stream) would be reused by a capture's backward in the next forward, which must then
            # wait on the legacy stream: the capture fails (cudaErrorStreamCaptureImplicit), as
            # test_replay_check_in_auto_mode_gpu found (auto mode captures after eager steps)
            del out
        run.launches = dict(_launches.LAUNCHES)
        if after_steps is not None:
            run.after_steps = after_steps(model)
        return run
    finally:
        solution.revert()
