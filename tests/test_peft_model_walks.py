"""patches/peft_model_walks: PeftModel.parameters / zero_grad / train in one walk over the
modules' dicts. CPU only (no kernels): the same parameter objects in torch's order, gradients
cleared as torch clears them, training flags as torch sets them, and stock wherever the patch's
conditions do not hold."""
from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")

from solution.patches import peft_model_walks as walks  # noqa: E402
from solution.patches._base import Swaps  # noqa: E402


class _Tree(torch.nn.Module):
    """Shared submodule, a parameter tied across modules, None slots (a child and a parameter)."""

    def __init__(self):
        super().__init__()
        shared = torch.nn.Linear(3, 3)
        self.a = torch.nn.Sequential(torch.nn.Linear(3, 4), shared, torch.nn.Dropout(0.1))
        self.b = torch.nn.ModuleDict({"x": shared, "y": torch.nn.Linear(4, 3, bias=False)})
        self.c = torch.nn.Linear(4, 3, bias=False)
        self.c.weight = self.b["y"].weight  # tied
        self.register_module("gone", None)
        self.register_parameter("empty", None)
        self.scale = torch.nn.Parameter(torch.ones(1))


def test_walk_is_torchs_parameters():
    m = _Tree()
    want = list(torch.nn.Module.parameters(m))
    got = walks.walk_parameters(m)
    assert len(got) == len(want) and all(a is b for a, b in zip(got, want))
    assert [id(x) for x in walks._modules(m)] == [id(x) for _, x in m.named_modules()]


def test_walk_steps_aside_for_a_class_that_walks_its_own_way():
    class Own(torch.nn.Linear):
        def named_parameters(self, *a, **k):
            return super().named_parameters(*a, **k)

    m = torch.nn.Sequential(torch.nn.Linear(2, 2), Own(2, 2))
    assert walks.walk_parameters(m) is None


def _peft_model():
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(0)
    model = get_peft_model(Qwen2ForCausalLM(cfg), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05,
                                                             task_type="CAUSAL_LM",
                                                             target_modules=["q_proj", "v_proj"]))
    return model.train()


@pytest.fixture
def installed():
    assert walks.check() is None
    swaps = Swaps()
    walks.install(swaps)
    yield
    swaps.restore()
    from peft import PeftModel

    assert all(n not in PeftModel.__dict__ for n in ("parameters", "zero_grad", "train"))


def test_parameters_zero_grad_train_as_torch(installed):
    model = _peft_model()
    want = list(torch.nn.Module.parameters(model))
    got = list(model.parameters())
    assert walks.walk_parameters(model) is not None  # the fast path, not stock
    assert len(got) == len(want) and all(a is b for a, b in zip(got, want))
    assert list(model.parameters(recurse=False)) == list(torch.nn.Module.parameters(model, recurse=False))

    ids = torch.randint(0, 64, (2, 7))
    model(input_ids=ids, labels=ids).loss.backward()
    with_grad = [p for p in want if p.grad is not None]
    assert with_grad
    model.zero_grad()
    assert all(p.grad is None for p in want)
    model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=False)  # stock: zeroed, not dropped
    assert all(p.grad is not None and not p.grad.any() for p in with_grad)

    flags = lambda: [m.training for m in model.modules()]  # noqa: E731
    assert model.train() is model and all(flags())
    model.base_model.model.model.layers[1].self_attn.training = False  # one flag differs: stock walks
    model.train()
    assert all(flags())
    model.eval()
    assert not any(flags())
    model.train(True)
    assert all(flags())
    with pytest.raises(ValueError):
        model.train("yes")  # stock's check of the argument


def test_train_goes_to_stock_for_a_class_with_its_own_train(installed, monkeypatch):
    model = _peft_model()
    calls = []
    lin = model.base_model.model.lm_head

    class Own(type(lin)):
        def train(self, mode=True):
            calls.append(mode)
            return super().train(mode)

    monkeypatch.setattr(lin, "__class__", Own)
    model.train()
    assert calls == [True]


def test_reviewed_pretrained_train():
    from transformers.modeling_utils import PreTrainedModel

    assert walks._reviewed_train(PreTrainedModel.train)
    assert not walks._reviewed_train(torch.nn.Module.train)


def test_on_the_workload_stack(installed, tmp_path):
    """bnb NF4 weights (Params4bit: __torch_function__ on every attribute read) under peft LoRA, as
    bench/step_walks.py builds them on the CPU."""
    pytest.importorskip("bitsandbytes")
    from bench.step_walks import _model

    model = _model(2, str(tmp_path))
    want = list(torch.nn.Module.parameters(model))
    got = list(model.parameters())
    assert len(got) == len(want) and all(a is b for a, b in zip(got, want))
    trainable = [p for p in want if p.requires_grad]
    for p in trainable:
        p.grad = torch.ones_like(p)
    model.zero_grad()
    assert all(p.grad is None for p in want)
    assert model.train() is model and all(m.training for m in model.modules())
