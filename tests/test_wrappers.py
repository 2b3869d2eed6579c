"""Hooks and forwards set on module instances still run where stock runs them, with the solution
applied: a wrapper on a decoder layer's instance (a profiler's, an offload library's, or
``mock.patch.object(layer, "forward", wraps=...)``, as transformers' own gradient-checkpointing
test sets) and hooks or wrappers on the patched modules inside a layer.

The packed step runs every layer through the decoder-layer node, which never calls a layer's or
its modules' forwards: the node refuses a layer that carries hooks or an instance-level forward,
on itself or on a module inside it, and the whole step then runs stock's forward (which calls
them), with or without gradient checkpointing. So the wrapper runs in the forward and in the
recompute as often as with stock, and the loss and LoRA gradients are as close to stock's as the solution
is without the wrapper (the backward starts from loss x 1024, as GradScaler's first steps do, so
that the tiny model's fp16 gradients are not subnormal).
"""
from __future__ import annotations

import pytest

from tests._qlora_step import run_qlora
from tests.conftest import rel_err
from tests.test_unpad import STEP_REL, _right_padded_batch


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from workload.model_standin import write_standin

    return write_standin(tmp_path_factory.mktemp("tiny") / "m", size="tiny")


def _wrap(model, where: str | None, calls: list) -> None:
    """Install the wrapper or hook named by ``where`` on the model's first decoder layer (None:
    nothing); it counts its calls in ``calls``."""
    layer = model.base_model.model.model.layers[0]
    if where == "layer forward":
        original = layer.forward  # the bound class forward; the wrapper goes on the instance, as mock.patch.object puts it

        def counted(*args, **kwargs):
            calls.append(1)
            return original(*args, **kwargs)

        layer.forward = counted
    elif where == "mlp hook":
        layer.mlp.register_forward_hook(lambda module, args, out: calls.append(1))
    elif where == "q_proj forward":
        q = layer.self_attn.q_proj
        original = q.forward

        def counted_q(*args, **kwargs):
            calls.append(1)
            return original(*args, **kwargs)

        q.forward = counted_q


def _step(model_dir, device, batch, where, reentrant, patched, autocast_ctx):
    """One checkpointed step (use_reentrant=``reentrant``; tests/_qlora_step.py: from loss x LOSS_SCALE,
    normal fp16 gradients as STEP_REL needs), stock or with the solution, the wrapper ``where`` on the
    first layer: (loss, LoRA gradients, the wrapper's calls after the forward, after the backward)."""
    from solution.settings import Settings

    calls = []
    run = run_qlora(model_dir, [batch], device=device, autocast_ctx=autocast_ctx, ckpt=reentrant,
                    apply=Settings(cuda_graphs="0", precompile=False) if patched else False,
                    setup=lambda model: _wrap(model, where, calls), after_forward=lambda model: len(calls))
    loss, grads, _ = run.steps[0]
    return loss, grads, run.after_forward[0], len(calls)


_UNWRAPPED: dict = {}


def _unwrapped_error(model_dir, device, batch, reentrant, autocast_ctx) -> dict:
    """Per LoRA gradient (and "loss"): how far the solution is from stock on these inputs with no
    wrapper at all (the packed step's own fp16 rounding), the yardstick of the wrapped runs."""
    if reentrant not in _UNWRAPPED:
        loss_s, grads_s, _, _ = _step(model_dir, device, batch, None, reentrant, False, autocast_ctx)
        loss_p, grads_p, _, _ = _step(model_dir, device, batch, None, reentrant, True, autocast_ctx)
        err = {n: rel_err(grads_p[n], g) for n, g in grads_s.items()}
        err["loss"] = rel_err(loss_p, loss_s)
        _UNWRAPPED[reentrant] = err
    return _UNWRAPPED[reentrant]


@pytest.mark.parametrize("where", ["layer forward", "mlp hook", "q_proj forward"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_instance_wrappers_and_hooks_run_as_with_stock(device, tiny_dir, autocast_ctx, where, reentrant):
    """The wrapper or hook runs as often as with stock (forward and recompute); the loss and every
    LoRA gradient are as close to stock's as the solution is without any wrapper (within 1.25x that
    distance, or the packed-vs-stock limits where that is smaller): a wrapper costs nothing in accuracy."""
    batch = _right_padded_batch([30, 12, 33], 33, vocab=100, device=device)
    base = _unwrapped_error(tiny_dir, device, batch, reentrant, autocast_ctx)
    loss_s, grads_s, fwd_s, all_s = _step(tiny_dir, device, batch, where, reentrant, False, autocast_ctx)
    loss_p, grads_p, fwd_p, all_p = _step(tiny_dir, device, batch, where, reentrant, True, autocast_ctx)
    assert fwd_s >= 1 and (fwd_p, all_p) == (fwd_s, all_s)
    if where == "layer forward":
        assert all_s == 2 * fwd_s  # the checkpointed layer's forward, and its recompute in backward
    assert rel_err(loss_p, loss_s) <= max(1e-3, 1.25 * base["loss"])
    assert grads_p.keys() == grads_s.keys() and grads_s
    for name, g in grads_s.items():
        assert rel_err(grads_p[name], g) <= max(STEP_REL, 1.25 * base[name]), (name, rel_err(grads_p[name], g))
