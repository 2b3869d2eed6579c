"""The decoder-layer node (solution/step/layer.py): against stock, against itself under
gradient checkpointing, and where it refuses.

The workload's stack on the tiny stand-in (bitsandbytes NF4 double-quant weights, peft LoRA r=16
on q/v, fp16 autocast; on the CPU bitsandbytes quantizes there and our kernels run in Triton's
interpreter), every patch installed by solution.apply(), once with the node and once without it
(``SOLUTION_SKIP_PATCHES=qwen2_layer_node``: the packed step is then off, stock's forward runs).
- Against stock: the random generator must end where stock leaves it (the same dropout draws,
  exactly), the loss and every LoRA gradient within fp16 noise (the fp64-anchored limit is
  tests/test_default_stack.py's; here a looser guard: ``STEP_REL``).
- Against itself: checkpointed (its own checkpointing, or inside another checkpoint function) the
  node recomputes the same kernels with the same draws, so the loss and every gradient are the
  SAME BITS as without checkpointing.
- A step the node does not take (a hook, a head_dim qkv_rope.py does not take) runs stock's
  forward entirely: no node launch.
"""
from __future__ import annotations

import pytest
import torch

from solution.kernels import _launches
from solution.step.layer import CHECKPOINT_COUNT as CKPT
from solution.step.layer import NODE_COUNT as NODE
from tests._qlora_step import run_qlora
from tests.test_unpad import LOSS_SCALE, STEP_REL, _right_padded_batch, qlora_tiny_model


def _step(model_dir, device, batch, node: bool, autocast_ctx, dropout=0.05, ckpt=None, steps=1):
    """``steps`` training steps on ``batch`` (tests/_qlora_step.py: from loss x LOSS_SCALE, no optimizer)
    after solution.apply() with or without the node, every dropout at p = ``dropout``: (losses, LoRA
    grads of the last step, generator offset or CPU RNG state, our launches by name)."""
    from solution.settings import Settings

    def set_dropout(model):
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = dropout

    skip = frozenset() if node else frozenset({"qwen2_layer_node"})
    run = run_qlora(model_dir, [batch] * steps, device=device, autocast_ctx=autocast_ctx, ckpt=ckpt,
                    setup=set_dropout, apply=Settings(skip_patches=skip, cuda_graphs="0", precompile=False))
    assert ("qwen2_layer_node" in run.installed) == node
    return torch.stack([s.loss for s in run.steps]), run.steps[-1].grads, run.steps[-1].rng, run.launches


def _lengths(device, lengths):
    """Row lengths for the test's batch: as given on the CPU (the interpreter is slow); x12 on a GPU."""
    return [n * 12 for n in lengths] if device == "cuda" else lengths


def _batch(device, lengths):
    lengths = _lengths(device, lengths)
    return _right_padded_batch(lengths, max(lengths), vocab=100, device=device)




def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _assert_same_bits(a, b):
    """a and b (``_step`` results) are the same bits: loss, every gradient, the generator."""
    loss_a, grads_a, rng_a, _ = a
    loss_b, grads_b, rng_b, _ = b
    assert torch.equal(loss_a, loss_b), (loss_a, loss_b)
    assert set(grads_a) == set(grads_b) and any("lora_B" in n for n in grads_b)
    for name, g in grads_b.items():
        assert torch.equal(grads_a[name], g), (name, (grads_a[name] - g).abs().max())
    assert (rng_a == rng_b) if isinstance(rng_a, int) else torch.equal(rng_a, rng_b)


def _stock(model_dir, device, batch, autocast_ctx, **kw):
    """``_step`` without the node (stock's forward), with bitsandbytes' CPU NF4 dequantization
    reading whole flat blocks (tests/test_default_stack.py's bnb_cpu_dequant_flat_blocks: bnb 0.50's
    CPU kernel decodes a row that is not whole 64-blocks wrongly, the tiny stand-in's down_proj)."""
    from tests.test_default_stack import bnb_cpu_dequant_flat_blocks

    with bnb_cpu_dequant_flat_blocks(device):
        return _step(model_dir, device, batch, False, autocast_ctx, **kw)


def _assert_node_against_stock(node, stock):
    loss_n, grads_n, rng_n, launches_n = node
    loss_s, grads_s, rng_s, launches_s = stock
    assert launches_n.get(NODE, 0) > 0 and launches_n.get("qkv_grad_sum", 0) > 0, launches_n  # the node ran
    assert launches_s.get(NODE, 0) == 0, launches_s  # stock's forward ran
    assert (rng_n == rng_s) if isinstance(rng_n, int) else torch.equal(rng_n, rng_s)  # the same draws
    assert _rel(loss_n, loss_s) <= STEP_REL, (loss_n, loss_s)
    assert set(grads_n) == set(grads_s) and any("lora_B" in n for n in grads_s)
    for name, g in grads_s.items():
        assert _rel(grads_n[name], g) <= STEP_REL, (name, _rel(grads_n[name], g))


@pytest.fixture
def tiny_dir(tmp_path_factory):
    from workload.model_standin import write_standin

    return write_standin(tmp_path_factory.mktemp("tiny") / "m", size="tiny")


@pytest.mark.parametrize("dropout", [0.05, 0.0])
def test_node_against_stock(device, tiny_dir, autocast_ctx, dropout):
    """Two steps (the second reuses the plans: the per-step check and the cached state), right
    padding with rows of different lengths and one full row. Attention's way in and out is
    kernels/qkv_rope.py, once a layer each way, and q's and v's four LoRA weights are cast in one
    launch each way."""
    batch = _batch(device, [40, 17, 64, 9])
    node = _step(tiny_dir, device, batch, True, autocast_ctx, dropout=dropout, steps=2)
    stock = _stock(tiny_dir, device, batch, autocast_ctx, dropout=dropout, steps=2)
    _assert_node_against_stock(node, stock)
    launches, layers = node[3], node[3][NODE]
    assert launches.get("qkv_rope_pad", 0) == layers and launches.get("qkv_rope_unpad", 0) == layers, launches
    assert launches.get("quad_cast", 0) == 2 * layers, launches


def test_step_runs_stock_where_qkv_rope_does_not_take_the_shapes(device, tmp_path_factory, autocast_ctx,
                                                                 monkeypatch):
    """The node's only way in and out of attention is kernels/qkv_rope.py: a head_dim its kernels
    do not take (24: half 12, not a power of two) makes the node refuse, and the whole step runs
    stock's forward (said once): stock's bits on the CPU, since it is stock. On the GPU two stock
    runs need not be the same bits (the memory-efficient attention backward that stock's SDPA
    takes on the T4's paths accumulates in a run-dependent order: seen 9.5e-7 apart on a lora_B
    gradient of ~1e-2 from loss x 1024): there the two are held to STEP_REL, the draws exactly."""
    from solution.step import layer as layer_node
    from workload import model_standin

    monkeypatch.setitem(model_standin.SIZES, "tiny_hd24", {**model_standin.TINY_OVERRIDES, "head_dim": 24})
    model_dir = model_standin.write_standin(tmp_path_factory.mktemp("hd24") / "m", size="tiny_hd24")
    said = []
    monkeypatch.setattr(layer_node, "say_once", said.append)
    batch = _batch(device, [30, 17, 33])
    refused = _step(model_dir, device, batch, True, autocast_ctx, steps=2)
    stock = _step(model_dir, device, batch, False, autocast_ctx, steps=2)
    assert refused[3].get(NODE, 0) == 0 and refused[3].get("qkv_rope_pad", 0) == 0, refused[3]
    assert any("kernels/qkv_rope.py does not take" in m and "head_dim 24" in m for m in said), said
    if device == "cpu":
        _assert_same_bits(refused, stock)
        return
    (loss_r, grads_r, rng_r, _), (loss_s, grads_s, rng_s, _) = refused, stock
    assert rng_r == rng_s and _rel(loss_r, loss_s) <= STEP_REL, (loss_r, loss_s)
    assert set(grads_r) == set(grads_s) and any("lora_B" in n for n in grads_s)
    for name, g in grads_s.items():
        assert _rel(grads_r[name], g) <= STEP_REL, (name, _rel(grads_r[name], g))


@pytest.mark.parametrize("reentrant", [False, True])
def test_node_under_gradient_checkpointing(device, tiny_dir, autocast_ctx, reentrant):
    """training.gradient_checkpointing with transformers' checkpoint function (torch's checkpoint,
    reentrant or not): the node checkpoints itself (keeps the input and the generator's state,
    recomputes in its own backward) and its recompute draws the same dropout masks: the bits of
    the node without checkpointing, and the generator ends where stock's checkpointed run leaves it."""
    batch = _batch(device, [30, 12, 33])
    node = _step(tiny_dir, device, batch, True, autocast_ctx, ckpt=reentrant)
    plain = _step(tiny_dir, device, batch, True, autocast_ctx)
    stock = _stock(tiny_dir, device, batch, autocast_ctx, ckpt=reentrant)
    _assert_same_bits(node, plain)
    _assert_node_against_stock(node, stock)
    # each layer's node: the forward, then the recompute; the input gradient of both layers (the
    # embedding's output requires grad under checkpointing)
    assert node[3][NODE] == 4 and node[3]["qkv_grad_sum"] == 2
    assert node[3][CKPT] == 2  # both layers through the node's own checkpointing


def test_node_inside_another_checkpoint_function(device, tiny_dir, autocast_ctx, monkeypatch):
    """A checkpoint function the node's own checkpointing does not reproduce (here torch's with a
    context_fn, as a caller's wrapper would be): the node runs inside that function, as stock's
    layer would, with the bits of the node without checkpointing."""
    import functools

    import torch.utils.checkpoint as tuc

    from solution.step import layer as layer_node

    assert layer_node.own_checkpoint(functools.partial(tuc.checkpoint, use_reentrant=False))
    assert layer_node.own_checkpoint(functools.partial(tuc.checkpoint, use_reentrant=True, preserve_rng_state=True))
    custom = functools.partial(tuc.checkpoint, use_reentrant=False, context_fn=tuc.noop_context_fn)
    assert not layer_node.own_checkpoint(custom)
    assert not layer_node.own_checkpoint(functools.partial(tuc.checkpoint, use_reentrant=False,
                                                           preserve_rng_state=False))
    assert not layer_node.own_checkpoint(lambda fn, *a, **k: tuc.checkpoint(fn, *a, use_reentrant=False, **k))

    from transformers.modeling_utils import PreTrainedModel

    enable = PreTrainedModel.gradient_checkpointing_enable

    def with_context_fn(self, gradient_checkpointing_kwargs=None):
        kw = dict(gradient_checkpointing_kwargs or {}, context_fn=tuc.noop_context_fn)
        return enable(self, gradient_checkpointing_kwargs=kw)

    monkeypatch.setattr(PreTrainedModel, "gradient_checkpointing_enable", with_context_fn)
    batch = _batch(device, [30, 12, 33])
    node = _step(tiny_dir, device, batch, True, autocast_ctx, ckpt=False)
    plain = _step(tiny_dir, device, batch, True, autocast_ctx)
    _assert_same_bits(node, plain)
    assert node[3][NODE] == 4 and node[3].get(CKPT, 0) == 0  # inside torch's checkpoint, not its own


def test_hooked_layer_runs_stock(device, tiny_dir, autocast_ctx, monkeypatch):
    """A forward hook on one projection: the node does not take that layer, so the whole step runs
    stock's forward (the hook fires once); the refusal is kept with the layer."""
    import solution
    from solution.patches.qwen2_lm_head_loss import fused_lm_head_requested
    from solution.settings import Settings
    from solution.step import layer as layer_node

    batch = _batch(device, [30, 17])
    solution.revert()
    solution.apply(verbose=False, settings=Settings(cuda_graphs="0", precompile=False))
    try:
        model = qlora_tiny_model(tiny_dir, device)
        fired = []
        layers = model.base_model.model.model.layers
        layers[1].self_attn.k_proj.register_forward_hook(lambda *a: fired.append(1))
        _launches.reset()
        with autocast_ctx(), fused_lm_head_requested():
            out = model(input_ids=batch[0], attention_mask=batch[1], labels=batch[2], use_cache=False)
        out.loss.backward()
        assert fired == [1]
        assert _launches.LAUNCHES[NODE] == 0
        assert isinstance(layer_node._PLANS.get(layers[1]), tuple)  # its refusal, kept
    finally:
        solution.revert()
        layer_node.forget()


def test_a_layer_with_other_trainable_parameters_runs_stock(device, tiny_dir, autocast_ctx):
    """The node computes gradients for q / v's LoRA A and B only: once another parameter of a layer
    requires a gradient (here a norm weight, unfrozen after a step the node took), the plan is invalid
    and the whole step runs stock's forward, which gives that parameter its gradient."""
    import solution
    from solution.patches.qwen2_lm_head_loss import fused_lm_head_requested
    from solution.settings import Settings
    from solution.step import layer as layer_node

    ids, mask, labels = _batch(device, [30, 17])
    solution.revert()
    solution.apply(verbose=False, settings=Settings(cuda_graphs="0", precompile=False))
    try:
        model = qlora_tiny_model(tiny_dir, device)
        norm = model.base_model.model.model.layers[1].input_layernorm.weight
        launches = []
        for unfrozen in (False, True):
            norm.requires_grad_(unfrozen)
            _launches.reset()
            with autocast_ctx(), fused_lm_head_requested():
                out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
            (out.loss * LOSS_SCALE).backward()
            launches.append(_launches.LAUNCHES.get(NODE, 0))
        assert launches[0] > 0 and launches[1] == 0, launches  # the node, then stock's forward
        assert norm.grad is not None and bool(torch.isfinite(norm.grad).all()) and bool(norm.grad.abs().sum() > 0)
    finally:
        solution.revert()
        layer_node.forget()


class _SeededMasks:
    """A dropout mask source (packing.DropoutMaskSource's ``take``) as a CUDA graph's slots are one:
    masks handed out in call order, here drawn from a seeded CPU generator; counts its calls."""

    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)
        self.calls = 0

    def take(self, p, x):
        self.calls += 1
        return (torch.rand(x.shape, generator=self.gen) >= p).to(x.device)


def test_checkpointed_node_takes_its_masks_again_from_a_source(device, tiny_dir, autocast_ctx, monkeypatch):
    """Inside a CUDA graph the dropout masks come from the graph's slots (drawn before each
    replay, as stock draws them). Under gradient checkpointing the node then keeps the masks its
    forward took and its recompute takes them again; it reads and sets no generator state (which
    a capture does not allow). With the masks from a source, the checkpointed node must give the
    plain node's bits (output, input gradient, every LoRA gradient), take each mask once, and leave
    the generators where they were. On the CPU the source path is opened for the test (on CUDA
    it is dropout's native path)."""
    import solution
    from solution.kernels import lora_nf4
    from solution.settings import Settings
    from solution.step import cuda_graphs, packing

    monkeypatch.setattr(lora_nf4, "_dropout_is_native", lambda x: True)
    lengths = _lengths(device, [30, 12, 33])
    ids, _, _ = _right_padded_batch(lengths, max(lengths), vocab=100, device=device)
    solution.revert()
    solution.apply(verbose=False, settings=Settings(cuda_graphs="0", precompile=False))
    try:
        model = qlora_tiny_model(tiny_dir, device)
        dec = model.base_model.model.model
        info = packing.make_unpadded(lengths, max(lengths), torch.device(device))
        g = torch.Generator().manual_seed(5)
        grad = (torch.randn(1, info.n_tokens, dec.config.hidden_size, generator=g) * 0.1).to(device)

        def run(ckpt: bool):
            if ckpt:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                model.train()
            model.zero_grad(set_to_none=True)
            h = dec.embed_tokens(packing.unpad_rows(ids.reshape(-1), info).unsqueeze(0)).detach().float()
            h.requires_grad_(True)
            cos, sin = dec.rotary_emb(h, info.positions.unsqueeze(0))
            source = _SeededMasks(7)
            _launches.reset()
            cpu_rng = torch.get_rng_state()
            cuda_off = torch.cuda.default_generators[0].get_offset() if device == "cuda" else None
            with autocast_ctx(), packing.dropout_masks_from(source):
                out = cuda_graphs.run_layers(dec.layers, h, info, cos, sin)
            out.backward(grad)
            assert torch.equal(torch.get_rng_state(), cpu_rng)
            if device == "cuda":
                assert torch.cuda.default_generators[0].get_offset() == cuda_off
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            return out.detach(), h.grad, grads, source.calls, dict(_launches.LAUNCHES)

        plain = run(False)
        ckpt = run(True)
    finally:
        solution.revert()
    assert plain[4].get(NODE) == 2 and plain[4].get(CKPT, 0) == 0, plain[4]
    assert ckpt[4].get(NODE) == 4 and ckpt[4].get(CKPT) == 2, ckpt[4]  # the forward, then the recompute
    assert plain[3] == ckpt[3] == 4  # q's and v's mask per layer, each taken once
    assert torch.equal(ckpt[0], plain[0]) and torch.equal(ckpt[1], plain[1])
    assert set(ckpt[2]) == set(plain[2]) and any("lora_B" in n for n in plain[2])
    for name, g in plain[2].items():
        assert torch.equal(ckpt[2][name], g), name
