"""Several visible GPUs (Kaggle's "GPU T4 x2"): Soup loads the model with device_map="auto", which
spreads the layers over every visible GPU and wraps each one's forward in an accelerate hook that
moves its inputs there.

A Triton kernel launches on the current CUDA device and its stream, so given another GPU's tensors
it would read them from the wrong GPU (racing that GPU's stream) or fault. The rules under test:
- kernels/_device.py: a CUDA tensor on a device other than the current one takes the stock path
  (``kernel_device_reason``, ``runs_here``, ``cuda_or_runs_here``, nf4_linear's ``input_reason``);
  with one GPU visible the check is one global read;
- step/decoder.py: a model spread over devices, or carrying accelerate hooks, keeps the stock
  Qwen2Model forward (no packed step, no CUDA graphs);
- apply() says so in one line; bench.compare pins one GPU for baseline and solution alike.
The CPU tests fake the device count; the GPU test needs two GPUs (it skips on one).
"""
from __future__ import annotations

import pytest
import torch

from solution.kernels import _device
from tests.conftest import HAS_CUDA, rel_err
from tests.test_unpad import unpad_patched  # noqa: F401 - the fixture: LM-head and unpad patches installed

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


@pytest.fixture
def two_gpus(monkeypatch):
    """_device sees two GPUs with cuda:0 current; both count as sm_75+ (their cached reason None)."""
    monkeypatch.setattr(_device, "_SEVERAL_GPUS", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for cache in _device._REASONS:
        monkeypatch.setitem(cache, CUDA0, None)
        monkeypatch.setitem(cache, CUDA1, None)


def test_only_the_current_gpu_runs_kernels(two_gpus, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the GPU rule: interpreter off
    assert _device.on_current_device(CUDA0) and not _device.on_current_device(CUDA1)
    assert _device.on_current_device(torch.device("cpu"))
    assert _device.on_current_device(torch.device("cuda"))  # no index: the current one
    assert _device.kernel_device_reason(CUDA0) is None and _device.runs_here(CUDA0)
    reason = _device.kernel_device_reason(CUDA1)
    assert reason is not None and "not the current CUDA device" in reason and not _device.runs_here(CUDA1)
    assert _device.kernel_device_reason(CUDA1, current=False) is None  # what a layer's plan keeps
    assert _device.cuda_or_runs_here(CUDA0) and not _device.cuda_or_runs_here(CUDA1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # another thread / device guard
    assert _device.runs_here(CUDA1) and not _device.runs_here(CUDA0)


def test_one_gpu_needs_no_current_device_query(monkeypatch):
    monkeypatch.setattr(_device, "_SEVERAL_GPUS", False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: pytest.fail("asked the current device"))
    assert _device.on_current_device(CUDA1)


def test_nf4_input_on_another_gpu_takes_the_stock_path(monkeypatch):
    """input_reason asks the current device at each call; the plan's own reason leaves it out."""
    from solution.kernels import nf4_linear

    class Plan:  # a plan that accepts everything but the device question
        reason, k, device = None, 8, torch.device("cpu")

    x = torch.zeros(2, 8, dtype=torch.float16)
    assert nf4_linear.input_reason(Plan, x) is None
    monkeypatch.setattr(nf4_linear, "on_current_device", lambda d: False)
    assert "not the current CUDA device" in nf4_linear.input_reason(Plan, x)


def test_apply_names_several_gpus(monkeypatch):
    from solution import env

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    note = env.several_gpus_note()
    assert note.startswith("2 CUDA GPUs visible") and "CUDA_VISIBLE_DEVICES=0" in note
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert env.several_gpus_note() is None


def test_compare_pins_one_gpu_for_both_runs(monkeypatch):
    from bench import compare

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for variant in ("baseline", "solution"):
        assert compare.child_env(variant, environ={})["CUDA_VISIBLE_DEVICES"] == "0"
        assert compare.child_env(variant, environ={"CUDA_VISIBLE_DEVICES": "1"})["CUDA_VISIBLE_DEVICES"] == "1"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert "CUDA_VISIBLE_DEVICES" not in compare.child_env("solution", environ={})


def test_accelerate_hooks_keep_the_stock_forward(device, unpad_patched, monkeypatch):
    """A decoder layer wrapped by accelerate (what device_map="auto" over two GPUs or CPU offload
    does): the packed step is not taken, the loss and gradients are stock's (rel 1e-5: fp32, the
    same stock forward with our LM head); a model with a tensor on another device is refused too."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module, remove_hook_from_module

    from solution.step import decoder
    from tests.test_unpad import _count_packed_calls, _lora_model, _right_padded_batch, _run

    model = _lora_model(device)
    ids, mask, labels = _right_padded_batch([5, 3], 6, device=device)
    calls = _count_packed_calls(monkeypatch)
    _run(model, ids, mask, labels, fused=True)
    assert len(calls) == 1  # the control: this model takes the packed step
    hooked = _lora_model(device)
    layer = hooked.base_model.model.model.layers[1]
    add_hook_to_module(layer, AlignDevicesHook(execution_device=torch.device(device), io_same_device=True))
    out, grads = _run(hooked, ids, mask, labels, fused=True)
    assert len(calls) == 1
    remove_hook_from_module(layer)
    unpad_patched.restore()  # the reference: stock transformers / peft / trl code
    ref_out, ref_grads = _run(_lora_model(device), ids, mask, labels, fused=False)
    assert rel_err(out.loss, ref_out.loss) < 1e-5
    assert set(grads) == set(ref_grads)
    for name, g in grads.items():
        assert rel_err(g, ref_grads[name]) < 1e-5, name
    spread = _lora_model(device).base_model.model.model
    assert decoder._on_one_device(spread)
    spread.layers[0].register_buffer("elsewhere", torch.zeros(1, device="meta"))  # a second device
    assert not decoder._on_one_device(spread)


@pytest.mark.gpu
def test_qlora_model_spread_over_two_gpus_matches_stock_gpu(tmp_path):
    """The workload's stack on the tiny stand-in, layer 1 and the final norm on cuda:1, the rest
    on cuda:0 (device_map as "auto" makes over two cards), every patch through apply(): no crash,
    the packed step not taken, our kernels on cuda:0's layer, loss and LoRA gradients as stock's
    (tests/test_unpad.py's STEP_REL: fp16 GEMMs and sums in other shapes)."""
    if not HAS_CUDA or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    from solution.kernels import _launches
    from solution.step import decoder
    from tests._qlora_step import run_qlora
    from tests.test_unpad import STEP_REL, _right_padded_batch
    from workload.model_standin import write_standin

    model_dir = write_standin(tmp_path / "tiny", size="tiny")
    batch = _right_padded_batch([40, 17, 64, 9], 64, vocab=100, device="cuda")
    spread = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 1,
              "model.norm": 1, "lm_head": 0}
    loss_s, grads_s, _ = run_qlora(model_dir, [batch], device_map=spread).steps[0]
    _launches.reset()
    calls = []
    real = decoder.unpadded_forward
    decoder.unpadded_forward = lambda *a: calls.append(1) or real(*a)
    try:
        packed = run_qlora(model_dir, [batch], device_map=spread, apply=True)
    finally:
        decoder.unpadded_forward = real
    assert "qwen2_unpad" in packed.installed
    loss_o, grads_o, _ = packed.steps[0]
    assert calls == [] and _launches.LAUNCHES["nf4_dequant_cast"] > 0
    assert rel_err(loss_o, loss_s) < 1e-3
    assert set(grads_o) == set(grads_s) and any("layers.1" in n for n in grads_s)
    for name, g in grads_s.items():
        assert rel_err(grads_o[name], g) <= STEP_REL, (name, rel_err(grads_o[name], g))
