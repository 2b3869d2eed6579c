"""No work on padding (solution/step/packing.py, solution/patches/qwen2_unpad.py).

The packed step runs a right-padded batch's real tokens only, every decoder layer through the
decoder-layer node; everything the trainer sees must agree with stock: the loss and every LoRA
gradient (within fp16 noise: the packed path computes the same products in another order), the
random numbers of LoRA's dropout (exactly: drawn over stock's padded shape), and where the packed
step does not apply (left padding, eval, a cache) stock's forward runs unchanged.
"""
from __future__ import annotations

import pytest
import torch

from solution.step import packing
from tests._qlora_step import run_qlora
from tests.conftest import rel_err
from tests.test_lm_head_loss import tiny_qwen2

# Norm-wise relative limit between two QLoRA steps of the tiny stand-in that compute the same
# operations in fp16 with fp32 accumulation but in other shapes (packed rows against the padded
# batch, a graph's filler rows, layers on another card): other summation orders, so other
# roundings. Over the stand-in's two layers, forward and backward, about twenty fp16 roundings of
# 2^-11 each separate the two at most. That holds where the gradients are normal fp16 numbers: the
# backward starts from loss x LOSS_SCALE, as fp16 training's GradScaler makes it (1024 and more in
# its first steps); unscaled, the tiny model's fp16 gradients on a GPU are subnormal (~1e-5), where
# one rounding is no longer 2^-11 of the value and not even stock holds this limit against itself.
STEP_REL = 20 * 2.0 ** -11
LOSS_SCALE = 1024.0

IGNORE = -100


def _right_padded_batch(lengths, seqlen, vocab=998, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), seqlen), vocab, dtype=torch.long)  # pad id = vocab (998 = tiny pad)
    mask = torch.zeros((len(lengths), seqlen), dtype=torch.long)
    labels = torch.full((len(lengths), seqlen), IGNORE, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(0, vocab, (n,), generator=g)
        mask[b, :n] = 1
        labels[b, n // 3:n] = ids[b, n // 3:n]  # loss on the "completion" only
    return ids.to(device), mask.to(device), labels.to(device)


def test_right_padded_lengths():
    m = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    assert packing.right_padded_lengths(m) == [3, 1, 4]
    assert packing.right_padded_lengths(m.bool()) == [3, 1, 4]
    assert packing.right_padded_lengths(torch.tensor([[0, 1, 1]])) is None  # left padding
    assert packing.right_padded_lengths(torch.tensor([[1, 0, 1]])) is None  # a hole
    assert packing.right_padded_lengths(torch.tensor([[1, 2, 0]])) is None  # not a 0/1 mask
    assert packing.right_padded_lengths(torch.ones(2, 3, 4, dtype=torch.long)) is None
    info = packing.make_unpadded([3, 1], 4, torch.device("cpu"))
    assert info.idx.tolist() == [0, 1, 2, 4] and info.positions.tolist() == [0, 1, 2, 0]
    rows = torch.arange(4.0).view(4, 1).requires_grad_()
    padded = packing.pad_rows(rows, info)
    assert padded.view(-1).tolist() == [0.0, 1.0, 2.0, 0.0, 3.0, 0.0, 0.0, 0.0]
    packing.unpad_rows(padded, info).sum().backward()
    assert rows.grad.view(-1).tolist() == [1.0] * 4


def _packed_dropout_against_stock(lengths, seqlen, hidden, p, seed, device):
    """Our lora_dropout on the packed real tokens against stock's own draw: peft's LoRA layer
    calls ``nn.Dropout`` on the padded input [batch, seqlen, hidden]. Stock runs twice from the
    same seed, on the input (its value) and on ones (its scaled keep mask, 0 where dropped: the
    CPU's Bernoulli noise / (1 - p) itself, CUDA's mask * 1 / (1 - p)); ours must give the real
    rows of both and leave the generator where stock's leaves it."""
    from solution.kernels.lora_nf4 import lora_dropout
    from tests.test_lora_nf4 import stock_dropout_draw

    info = packing.make_unpadded(lengths, seqlen, torch.device(device))
    x_pad = torch.randn(len(lengths), seqlen, hidden, device=device)
    x_packed = packing.unpad_rows(x_pad.view(-1, hidden), info).view(1, -1, hidden)
    drop = torch.nn.Dropout(p).train()
    value_stock, after_stock, keep_stock = stock_dropout_draw(drop, x_pad, seed)
    torch.manual_seed(seed)
    xd, keep, _, scale = lora_dropout(drop, x_packed, packed=info)
    after_ours = torch.rand(1, device=device)
    real = lambda t: packing.unpad_rows(t.reshape(-1, hidden), info)  # noqa: E731 - the real tokens' rows
    assert torch.equal(xd.view(-1, hidden), real(value_stock))
    if keep.dtype == torch.bool:  # CUDA: native_dropout's mask
        assert torch.equal(keep.view(-1, hidden), real(keep_stock) != 0) and scale == 1.0 / (1.0 - p)
    else:  # CPU: the noise, already scaled
        assert torch.equal(keep.view(-1, hidden), real(keep_stock))
    assert torch.equal(after_stock, after_ours)  # the generator advanced by the same amount


def test_dropout_draws_over_the_padded_shape():
    """lora_dropout on packed rows keeps exactly the rows of the draw stock's nn.Dropout makes over
    the padded tensor (CPU: Bernoulli noise; the CUDA native_dropout case is in the GPU test below)."""
    _packed_dropout_against_stock([5, 2, 7], 7, 6, 0.3, seed=5, device="cpu")


@pytest.mark.gpu
def test_dropout_draws_over_the_padded_shape_cuda(device):
    if device != "cuda":
        pytest.skip("native_dropout is the CUDA path")
    _packed_dropout_against_stock([300, 17, 512, 64], 512, 1536, 0.05, seed=7, device="cuda")


@pytest.fixture
def unpad_patched():
    """Install the LM-head and unpad patches; ``swaps.restore()`` is stock again (also at the end)."""
    from solution.patches import qwen2_lm_head_loss, qwen2_unpad
    from solution.patches._base import Swaps

    assert qwen2_unpad.check() is None, qwen2_unpad.check()
    swaps = Swaps()
    qwen2_lm_head_loss.install(swaps)
    qwen2_unpad.install(swaps)
    yield swaps
    swaps.restore()


def _lora_model(device, dropout=0.0):
    """A tiny Qwen2 in fp32 with plain peft LoRA on q/v (no 4-bit weights: the decoder-layer node
    does not take it, so with the patches installed its forward is stock's; tests/test_several_gpus.py
    and tests/test_decoder_graphs.py use it for what does not depend on the node)."""
    from peft import LoraConfig, get_peft_model

    model = tiny_qwen2(device)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, task_type="CAUSAL_LM",
                                            target_modules=["q_proj", "v_proj"]))


def unpad_patched_request():
    from solution.patches.qwen2_lm_head_loss import fused_lm_head_requested

    return fused_lm_head_requested()


def _count_packed_calls(monkeypatch) -> list:
    from solution.step import decoder

    calls = []
    real_forward = decoder.unpadded_forward
    monkeypatch.setattr(decoder, "unpadded_forward", lambda *a: calls.append(1) or real_forward(*a))
    return calls


def _run(model, ids, mask, labels, fused):
    from solution.patches.qwen2_lm_head_loss import fused_lm_head_requested

    model.train()
    model.zero_grad()
    if fused:
        with fused_lm_head_requested():
            out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False,
                        num_items_in_batch=torch.tensor(11))
    else:  # use_cache=False as trl's compute_loss passes it (with a cache requested the stock path runs)
        out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False,
                    num_items_in_batch=torch.tensor(11))
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def test_check_and_revert():
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Model

    from solution.patches import qwen2_unpad
    from solution.patches._base import Swaps

    assert qwen2_unpad.check() is None
    stock_fwd = Qwen2Model.__dict__["forward"]
    swaps = Swaps()
    qwen2_unpad.install(swaps)
    assert Qwen2Model.__dict__["forward"] is not stock_fwd
    swaps.restore()
    assert Qwen2Model.__dict__["forward"] is stock_fwd


def test_packed_step_is_taken_only_when_it_applies(device, tmp_path, autocast_ctx):
    """apply() at its defaults on the workload's stack (tiny stand-in): a right-padded batch and one
    with no padding run packed (every layer through the node); left padding, a forward with a
    cache requested and a forward without gradients run stock's forward (no node launch)."""
    import solution
    from solution.kernels import _launches
    from solution.patches.qwen2_lm_head_loss import fused_lm_head_requested
    from solution.settings import Settings
    from solution.step.layer import NODE_COUNT
    from workload.model_standin import write_standin

    model_dir = write_standin(tmp_path / "tiny", size="tiny")
    ids, mask, labels = _right_padded_batch([5, 3], 6, vocab=100, device=device)
    solution.revert()
    solution.apply(verbose=False, settings=Settings(cuda_graphs="0", precompile=False))
    try:
        model = qlora_tiny_model(model_dir, device)
        layers = model.config.num_hidden_layers

        def nodes(attention_mask, grad=True, **kw) -> int:
            _launches.reset()
            with autocast_ctx(), fused_lm_head_requested(), torch.set_grad_enabled(grad):
                model(input_ids=ids, attention_mask=attention_mask, labels=labels, **kw)
            return _launches.LAUNCHES[NODE_COUNT]

        assert nodes(mask, use_cache=False) == layers
        assert nodes(torch.ones_like(mask), use_cache=False) == layers  # no padding: packed too
        assert nodes(mask.flip(1), use_cache=False) == 0  # left padding
        assert nodes(mask, use_cache=True) == 0  # a cache requested
        assert nodes(mask, grad=False) == 0  # no gradient (as in evaluation)
    finally:
        solution.revert()


def test_skip_setting_leaves_a_patch_out(monkeypatch):
    """$SOLUTION_SKIP_PATCHES names patches apply() leaves out (stock path kept)."""
    import solution
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Model

    solution.revert()
    stock_fwd = Qwen2Model.__dict__["forward"]
    monkeypatch.setenv("SOLUTION_SKIP_PATCHES", "qwen2_unpad, cuda_allocator")
    try:
        installed = solution.apply(verbose=False)
        assert "qwen2_unpad" not in installed and "cuda_allocator" not in installed
        assert "qwen2_lm_head_loss" in installed
        assert Qwen2Model.__dict__["forward"] is stock_fwd
    finally:
        solution.revert()


def qlora_tiny_model(model_dir, device="cuda", device_map=None):
    """The workload's stack on the tiny stand-in, on the GPU (or the CPU: bitsandbytes quantizes
    there too, our kernels then run in the interpreter): NF4 double-quant weights
    (bitsandbytes, fp16 compute), prepare_model_for_kbit_training without checkpointing, peft LoRA
    r=16 alpha=32 on q/v with dropout 0.05 (LoRA A drawn after torch.manual_seed(1234): the same A
    in every run), in train mode. ``device_map``: from_pretrained's (None: all on ``device``)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=torch.float16)
    model = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=q, dtype=torch.float16,
                                                 device_map=device_map or {"": 0 if device == "cuda" else "cpu"})
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(1234)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, task_type="CAUSAL_LM",
                                             target_modules=["q_proj", "v_proj"]))
    return model.train()


@pytest.mark.gpu
def test_qlora_model_packed_matches_stock_gpu(device, tmp_path):
    """The workload's stack on a tiny model: NF4 double-quant weights (bitsandbytes), peft LoRA
    r=16 on q/v with dropout 0.05, fp16 autocast, every patch through solution.apply(), a
    right-padded batch: loss and LoRA gradients against stock on the same seed (the dropout masks
    are the same draws). Tolerances: the packed path runs the fp16 GEMMs over N rows instead of
    batch x seqlen (cuBLAS may pick other kernels) and attention with is_causal instead of a mask,
    so results differ at fp16 rounding: loss rel 1e-3, gradients ``STEP_REL`` (its derivation above)."""
    if device != "cuda":
        pytest.skip("bitsandbytes 4-bit needs CUDA")
    from solution.kernels import _launches
    from workload.model_standin import write_standin

    model_dir = write_standin(tmp_path / "tiny", size="tiny")
    batch = _right_padded_batch([40, 17, 64, 9], 64, vocab=100, device="cuda")

    loss_s, grads_s, _ = run_qlora(model_dir, [batch]).steps[0]
    _launches.reset()
    packed = run_qlora(model_dir, [batch], apply=True)
    assert "qwen2_unpad" in packed.installed
    loss_o, grads_o, _ = packed.steps[0]
    assert _launches.LAUNCHES["nf4_dequant_cast"] > 0
    assert _launches.LAUNCHES["efficient_attention_varlen"] > 0
    assert rel_err(loss_o, loss_s) < 1e-3
    assert set(grads_o) == set(grads_s) and any("lora_B" in n for n in grads_s)
    for name, g in grads_s.items():
        assert rel_err(grads_o[name], g) <= STEP_REL, (name, rel_err(grads_o[name], g))


@pytest.mark.gpu
@pytest.mark.parametrize("reentrant", [False, True])
def test_qlora_gradient_checkpointing_matches_stock_gpu(device, tmp_path, monkeypatch, reentrant):
    """The workload's stack with gradient checkpointing on (as Soup's training.gradient_checkpointing
    sets it: prepare_model_for_kbit_training(use_gradient_checkpointing=True)), LoRA dropout 0.05:
    the packed path against stock's checkpointed run on the same seed: the recompute draws the
    same dropout masks as the forward (same generator offsets after the step), loss and LoRA
    gradients within the fp16 tolerances of test_qlora_model_packed_matches_stock_gpu."""
    if device != "cuda":
        pytest.skip("bitsandbytes 4-bit needs CUDA")
    from workload.model_standin import write_standin

    model_dir = write_standin(tmp_path / "tiny", size="tiny")
    batch = _right_padded_batch([40, 17, 64, 9], 64, vocab=100, device="cuda")

    loss_s, grads_s, off_s = run_qlora(model_dir, [batch], ckpt=reentrant).steps[0]
    packed = run_qlora(model_dir, [batch], ckpt=reentrant, apply=True)
    assert "qwen2_unpad" in packed.installed
    loss_o, grads_o, off_o = packed.steps[0]
    assert off_o == off_s
    assert rel_err(loss_o, loss_s) < 1e-3
    assert set(grads_o) == set(grads_s) and any("lora_B" in n for n in grads_s)
    for name, g in grads_s.items():
        assert rel_err(grads_o[name], g) <= STEP_REL, (name, rel_err(grads_o[name], g))
