"""patches/trainer_flops: Trainer.floating_point_ops with the parameter count walked once per run.

CPU only (no kernels): a tiny Qwen2 model, alone and wrapped by peft as Soup wraps it. The
patched floating_point_ops must return stock's integer every step, walk the parameters once per
run state, walk again for a new run state or another model, and leave every other call of
num_parameters (outside floating_point_ops, or only_trainable=True) to stock.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from solution.patches import trainer_flops  # noqa: E402
from solution.patches._base import Swaps  # noqa: E402


def _tiny_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg)


@pytest.fixture
def counted(monkeypatch):
    """PreTrainedModel.num_parameters counting its (stock) walks, then the patch installed over it."""
    from transformers.modeling_utils import PreTrainedModel

    stock = PreTrainedModel.num_parameters
    walks = []

    def num_parameters(self, only_trainable=False, exclude_embeddings=False):
        walks.append((only_trainable, exclude_embeddings))
        return stock(self, only_trainable=only_trainable, exclude_embeddings=exclude_embeddings)

    num_parameters.__wrapped__ = stock  # a counting wrapper of stock: check() reads stock's source
    monkeypatch.setattr(PreTrainedModel, "num_parameters", num_parameters)
    stock_flops = transformers.Trainer.floating_point_ops
    assert trainer_flops.check() is None
    swaps = Swaps()
    trainer_flops.install(swaps)
    yield SimpleNamespace(walks=walks, stock_flops=stock_flops)
    swaps.restore()
    assert PreTrainedModel.num_parameters is num_parameters
    assert transformers.Trainer.floating_point_ops is stock_flops


def _trainer(model):
    return SimpleNamespace(model=model, state=object())


def test_flops_equal_stock_and_walk_once_per_run(counted):
    model = _tiny_model()
    trainer = _trainer(model)
    stock_trainer = _trainer(model)
    for rows in (1, 3, 4, 2):
        inputs = {"input_ids": torch.zeros(rows, 7 + rows, dtype=torch.long)}
        got = transformers.Trainer.floating_point_ops(trainer, inputs)
        want = counted.stock_flops(stock_trainer, inputs)
        assert got == want and isinstance(got, int)
    # stock walked 4 times (its own calls), the patched trainer once
    assert counted.walks.count((False, True)) == 4 + 1

    trainer.state = object()  # train() started again: a new run state
    transformers.Trainer.floating_point_ops(trainer, {"input_ids": torch.zeros(2, 5, dtype=torch.long)})
    assert counted.walks.count((False, True)) == 4 + 2

    other = _tiny_model()
    other.model.layers = other.model.layers[:1]
    trainer.model = other  # another model: counted again, and its count
    got = transformers.Trainer.floating_point_ops(trainer, {"input_ids": torch.zeros(1, 5, dtype=torch.long)})
    assert got == 6 * 5 * other.num_parameters(exclude_embeddings=True)
    assert got != 6 * 5 * model.num_parameters(exclude_embeddings=True)


def test_other_calls_of_num_parameters_stay_stock(counted):
    model = _tiny_model()
    trainer = _trainer(model)
    transformers.Trainer.floating_point_ops(trainer, {"input_ids": torch.zeros(1, 4, dtype=torch.long)})
    before = model.num_parameters()
    model.lm_head.extra = torch.nn.Linear(3, 3)  # outside floating_point_ops: walked, the new count
    assert model.num_parameters() == before + 12
    assert model.num_parameters(only_trainable=True) == before + 12
    for p in model.lm_head.extra.parameters():
        p.requires_grad_(False)
    assert model.num_parameters(only_trainable=True) == before


def test_flops_through_a_peft_model_as_soup_wraps_it(counted):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_tiny_model(), peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    trainer, stock_trainer = _trainer(model), _trainer(model)
    inputs = {"input_ids": torch.zeros(4, 9, dtype=torch.long)}
    for _ in range(3):
        assert (transformers.Trainer.floating_point_ops(trainer, inputs)
                == counted.stock_flops(stock_trainer, inputs) > 0)
    assert counted.walks.count((False, True)) == 3 + 1
