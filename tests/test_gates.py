"""The gates of the mirrored library functions and of the private calls (docs/GATES.md).

- Every name in solution/patches/_sources.py's ACCEPTED is checked by some patch, and the
  installed sources are accepted.
- Each gated patch refuses (check() returns a reason naming the function) when the function it
  mirrors is another one (a plain wrapper: other source text).
- The private ATen ops the package calls have the schemas they were reviewed with; another schema
  refuses variable-length attention (the padded layout is kept).
- The private torch names apply() needs are there (env.torch_internals_reason).
"""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from solution.patches import PATCHES
from solution.patches import _sources

REPO = Path(__file__).resolve().parent.parent

pytest.importorskip("transformers")


def _checks_names(monkeypatch) -> tuple[set, dict]:
    """(every ACCEPTED name some patch's check() asked about, {patch: its check()'s answer})."""
    asked: set = set()
    reason = _sources._reason

    def spy(name, digest):
        asked.add(name)
        return reason(name, digest)

    monkeypatch.setattr(_sources, "_reason", spy)
    answers = {}
    for module_name in PATCHES:
        module = importlib.import_module(module_name)
        answers[module.NAME] = module.check()
    # checked when training starts, not by check(): PreTrainedModel.train (peft_model_walks)
    from transformers.modeling_utils import PreTrainedModel

    from solution.patches import peft_model_walks

    peft_model_walks._reviewed_train(PreTrainedModel.train)
    return asked, answers


def test_every_accepted_name_is_checked_and_installed_sources_pass(monkeypatch):
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("trl")
    asked, answers = _checks_names(monkeypatch)
    assert {name: why for name, why in answers.items() if why is not None} == {}
    assert set(_sources.ACCEPTED) - asked == set(), "ACCEPTED names no patch checks"
    assert asked - set(_sources.ACCEPTED) == set()


def test_every_accepted_name_is_in_the_docs():
    for doc in ("docs/GATES.md", "docs/ru/GATES.md"):
        text = (REPO / doc).read_text(encoding="utf-8")
        missing = [name for name in _sources.ACCEPTED if f"`{name}`" not in text]
        assert missing == [], f"{doc} lacks {missing}"


def test_accepted_entries_are_hashes_with_versions():
    for name, hashes in _sources.ACCEPTED.items():
        assert hashes, name
        for digest, versions in hashes.items():
            assert len(digest) == 64 and int(digest, 16) >= 0, name
            assert versions and versions[0].isdigit(), name


def _other(fn):
    """A function that behaves like ``fn`` but whose source is other text (no ``__wrapped__``)."""
    def other(*args, **kwargs):
        return fn(*args, **kwargs)

    return other


def _targets():
    """(patch module, owner, attribute, ACCEPTED name) for each function a patch's check() gates."""
    from transformers.models.qwen2 import modeling_qwen2 as mq

    out = [
        ("qwen2_layer_node", mq.Qwen2RMSNorm, "forward", "transformers.Qwen2RMSNorm.forward"),
        ("qwen2_layer_node", mq.Qwen2DecoderLayer, "forward", "transformers.Qwen2DecoderLayer.forward"),
        ("qwen2_layer_node", mq, "apply_rotary_pos_emb", "transformers.apply_rotary_pos_emb"),
        ("qwen2_layer_node", mq, "rotate_half", "transformers.rotate_half"),
        ("qwen2_layer_node", mq.Qwen2MLP, "forward", "transformers.Qwen2MLP.forward"),
        ("qwen2_layer_node", mq.Qwen2Attention, "forward", "transformers.Qwen2Attention.forward"),
        ("qwen2_unpad", mq.Qwen2Model, "forward", "transformers.Qwen2Model.forward"),
        ("qwen2_lm_head_loss", mq.Qwen2ForCausalLM, "forward", "transformers.Qwen2ForCausalLM.forward"),
    ]
    import torch.nn.utils.clip_grad as clip_grad
    import torch.utils.checkpoint as torch_checkpoint
    import transformers
    from transformers.loss import loss_utils
    from transformers.modeling_utils import PreTrainedModel

    out += [
        ("qwen2_layer_node", torch_checkpoint, "checkpoint", "torch.utils.checkpoint.checkpoint"),
        ("qwen2_lm_head_loss", loss_utils, "ForCausalLMLoss", "transformers.ForCausalLMLoss"),
        ("qwen2_lm_head_loss", loss_utils, "fixed_cross_entropy", "transformers.fixed_cross_entropy"),
        ("trainer_flops", transformers.Trainer, "floating_point_ops", "transformers.Trainer.floating_point_ops"),
        ("trainer_flops", PreTrainedModel, "num_parameters", "transformers.PreTrainedModel.num_parameters"),
        ("trainer_clip", transformers.Trainer, "_clip_grad_norm", "transformers.Trainer._clip_grad_norm"),
        ("trainer_clip", clip_grad, "clip_grad_norm_", "torch.nn.utils.clip_grad_norm_"),
        ("trainer_clip", clip_grad, "_get_total_norm", "torch.nn.utils.clip_grad._get_total_norm"),
        ("trainer_clip", clip_grad, "_clip_grads_with_norm_", "torch.nn.utils.clip_grad._clip_grads_with_norm_"),
    ]
    out += [("peft_model_walks", torch.nn.Module, m, f"torch.nn.Module.{m}")
            for m in ("named_modules", "named_parameters", "_named_members", "parameters", "train", "zero_grad")]
    try:
        from accelerate import Accelerator
    except ImportError:
        pass
    else:
        out += [("trainer_clip", Accelerator, "clip_grad_norm_", "accelerate.Accelerator.clip_grad_norm_"),
                ("trainer_clip", Accelerator, "_clip_grad_norm_dtensor_aware",
                 "accelerate.Accelerator._clip_grad_norm_dtensor_aware")]
    try:
        import trl.trainer.sft_trainer as sft_module
    except ImportError:
        pass
    else:
        out += [("qwen2_lm_head_loss", sft_module.SFTTrainer, "compute_loss", "trl.SFTTrainer.compute_loss"),
                ("qwen2_lm_head_loss", sft_module, "entropy_from_logits", "trl.entropy_from_logits")]
    try:
        import bitsandbytes as bnb
        from peft.tuners.lora import bnb as lora_bnb
    except ImportError:
        pass
    else:
        out += [("qwen2_layer_node", bnb.nn.Linear4bit, "forward", "bitsandbytes.nn.Linear4bit.forward"),
                ("qwen2_layer_node", bnb, "matmul_4bit", "bitsandbytes.matmul_4bit"),
                ("qwen2_layer_node", lora_bnb.Linear4bit, "forward", "peft.tuners.lora.bnb.Linear4bit.forward")]
    return out


def _target_ids():
    try:
        return [f"{p}:{name}" for p, _, _, name in _targets()]
    except ImportError:
        return []


@pytest.mark.parametrize("index", range(len(_target_ids())), ids=_target_ids())
def test_changed_source_is_refused(monkeypatch, index):
    patch, owner, attr, name = _targets()[index]
    module = importlib.import_module(f"solution.patches.{patch}")
    assert module.check() is None
    monkeypatch.setattr(owner, attr, _other(getattr(owner, attr)))
    reason = module.check()
    assert reason is not None and name in reason, reason


def test_unexpected_source_of_a_missing_function():
    assert "does not exist" in _sources.unexpected_source("transformers.Qwen2MLP.forward", None)


# --- private ATen ops -----------------------------------------------------------------------------

# Private ops called outside solution/kernels/attn_varlen.py (whose schemas are its ACCEPTED_SCHEMAS).
OTHER_PRIVATE_OPS = {
    # solution/step/cuda_graphs.py: the captured gradients' copies
    "aten::_foreach_copy_": ("aten::_foreach_copy_(Tensor(a!)[] self, Tensor[] src, bool non_blocking=False) -> ()",),
}


def test_private_aten_schemas_are_the_reviewed_ones():
    from solution.kernels import attn_varlen

    for name, accepted in {**attn_varlen.ACCEPTED_SCHEMAS, **OTHER_PRIVATE_OPS}.items():
        assert attn_varlen.op_schemas(name) == accepted, name
    assert attn_varlen.schema_refusal() is None


def test_every_private_aten_op_called_is_listed():
    """Every ``torch.ops.aten._x`` / ``torch._foreach_x`` call in solution/ has a reviewed schema."""
    import re

    from solution.kernels import attn_varlen

    listed = {n.split("::")[1] for n in {**attn_varlen.ACCEPTED_SCHEMAS, **OTHER_PRIVATE_OPS}}
    called = set()
    for path in (REPO / "solution").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        called |= set(re.findall(r"torch\.ops\.aten\.(_\w+)", text))
        called |= set(re.findall(r"torch\.(_foreach_\w+)", text))
    assert called - listed == set()


def test_changed_schema_refuses_variable_length_attention(monkeypatch):
    from solution.kernels import attn_varlen
    from solution.step import attention

    real = attn_varlen.op_schemas
    monkeypatch.setattr(attn_varlen, "op_schemas", lambda name: real(name) + ("aten::x.other() -> ()",)
                        if name == "aten::_efficient_attention_backward" else real(name))
    refusal = attn_varlen.schema_refusal()
    assert refusal is not None and "aten::_efficient_attention_backward" in str(refusal)

    # step/attention.py: on CUDA the refusal comes before any call of the kernel; the packed step
    # is off from then on (one line said)
    def no_preflight(*args):
        raise AssertionError("the kernel must not run after a schema refusal")

    monkeypatch.setattr(attn_varlen, "preflight", no_preflight)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(attention, "_VARLEN_FAILED", None)
    monkeypatch.setattr(attention, "_PREFLIGHT", {})
    said = []
    monkeypatch.setattr(attention, "say", said.append)
    assert not attention.varlen_works(torch.device("cuda", 0), torch.float16, 128)
    assert not attention.varlen_enabled()
    assert len(said) == 1 and "_efficient_attention_backward" in said[0] and "packed step is off" in said[0]


# --- private torch names read by the whole package ------------------------------------------------

def test_torch_internals_are_there():
    from solution.env import torch_internals_reason

    assert torch_internals_reason() is None


def test_missing_torch_internal_refuses_everything(monkeypatch):
    from torch.nn.modules import module as nn_module

    from solution import env

    monkeypatch.delattr(nn_module, "_global_forward_hooks")
    reason = env.torch_internals_reason()
    assert reason is not None and "_global_forward_hooks" in reason
    support = env.check_support()
    assert not support.ok and "_global_forward_hooks" in support.reason


def test_foreach_copy_fallback_is_public(monkeypatch):
    """cuda_graphs copies the captured gradients with torch._foreach_copy_ where this torch has it,
    else one Tensor.copy_ each (the same values)."""
    from solution.step import cuda_graphs

    assert cuda_graphs._FOREACH_COPY is getattr(torch, "_foreach_copy_", None)
