"""patches/trainer_clip: Trainer._clip_grad_norm handing accelerate only the parameters that hold a
gradient. The returned norm and every gradient after the clip must be stock's bits (gradients
large enough to be clipped, one trainable parameter without a gradient, one frozen parameter with
one); stock wherever the one-process branch would not be taken. CPU (the clip runs no kernel of
ours); on a GPU also with fp16's GradScaler unscaling first."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("peft")

from solution.patches import trainer_clip  # noqa: E402
from solution.patches._base import Swaps  # noqa: E402
from tests.test_peft_model_walks import _peft_model  # noqa: E402


@pytest.fixture
def clip():
    """(stock, patched) Trainer._clip_grad_norm; the patch installed while the test runs."""
    assert trainer_clip.check() is None
    stock = transformers.Trainer._clip_grad_norm
    swaps = Swaps()
    trainer_clip.install(swaps)
    patched = transformers.Trainer._clip_grad_norm
    assert patched is not stock
    yield stock, patched
    swaps.restore()
    assert transformers.Trainer._clip_grad_norm is stock


def _model_with_grads(device, scale_loss=None):
    """The tiny peft model with gradients from one backward (x 1000: the norm is far above 1, so
    the clip scales them), then q_proj's first lora_B without one and a frozen weight with one."""
    model = _peft_model().to(device)
    ids = torch.arange(24, device=device).view(2, 12) % 64
    loss = model(input_ids=ids, labels=ids).loss * 1000
    (loss if scale_loss is None else scale_loss(loss)).backward()
    named = dict(model.named_parameters())
    lora_b = next(n for n in named if "q_proj.lora_B" in n)
    named[lora_b].grad = None
    frozen = next(n for n, p in named.items() if not p.requires_grad and p.dim() == 2)
    torch.manual_seed(1)
    named[frozen].grad = torch.randn_like(named[frozen])
    return model, lora_b, frozen


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _trainer(accelerator):
    return SimpleNamespace(accelerator=accelerator, args=SimpleNamespace(max_grad_norm=1.0, fp16=False),
                           _has_mixed_mesh_grads=lambda model: False)


def _same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_clip_is_stocks_bits(clip):
    from accelerate import Accelerator

    stock, patched = clip
    acc = Accelerator(cpu=True)
    runs = []
    for fn in (stock, patched):
        model, lora_b, frozen = _model_with_grads("cpu")
        before = _grads(model)
        norm = fn(_trainer(acc), model)
        runs.append((norm, _grads(model), before))
    (n_s, g_s, b_s), (n_p, g_p, b_p) = runs
    _same(b_s, b_p)  # the same gradients going in
    assert n_s.item() > 1.0  # the clip scaled them
    assert torch.equal(n_s, n_p)
    _same(g_s, g_p)
    assert lora_b not in g_p and frozen in g_p  # None stays None; the frozen weight's gradient is clipped too
    assert not torch.equal(g_p[frozen], b_p[frozen])


def test_with_grads_keeps_torchs_order():
    model, lora_b, frozen = _model_with_grads("cpu")
    want = [p for p in torch.nn.Module.parameters(model) if p.grad is not None]
    got = trainer_clip.with_grads(model)
    assert len(got) == len(want) and all(a is b for a, b in zip(got, want))


def test_stock_where_another_branch_would_run(clip):
    """Several processes, mixed DTensor meshes: stock's own call, with the whole parameter walk."""
    from accelerate.utils import DistributedType

    stock, patched = clip
    model, _, _ = _model_with_grads("cpu")
    seen = []
    fake = SimpleNamespace(distributed_type=DistributedType.MULTI_GPU,
                           clip_grad_norm_=lambda params, max_norm: seen.append(list(params)) or "stock")
    assert patched(_trainer(fake), model) == "stock"
    assert len(seen[-1]) == len(list(torch.nn.Module.parameters(model)))
    mixed = _trainer(SimpleNamespace(distributed_type=DistributedType.NO))
    mixed._has_mixed_mesh_grads = lambda m: True
    mixed._mixed_mesh_grad_norm = lambda m, n: "mixed"
    assert patched(mixed, model) == "mixed"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (fp16 GradScaler)")
def test_clip_is_stocks_bits_with_the_fp16_scaler(clip):
    """As the workload runs: accelerate's fp16 GradScaler scales the loss, the clip unscales first."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    stock, patched = clip
    runs = []
    for fn in (stock, patched):
        AcceleratorState._reset_state(True)
        acc = Accelerator(mixed_precision="fp16")
        model, lora_b, frozen = _model_with_grads("cuda")
        model.zero_grad(set_to_none=True)
        opt = acc.prepare(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3))
        ids = torch.arange(24, device="cuda").view(2, 12) % 64
        acc.backward(model(input_ids=ids, labels=ids).loss * 1000)
        norm = fn(_trainer(acc), model)
        runs.append((norm, _grads(model)))
        del opt
    (n_s, g_s), (n_p, g_p) = runs
    assert torch.equal(n_s, n_p)
    _same(g_s, g_p)
    AcceleratorState._reset_state(True)
