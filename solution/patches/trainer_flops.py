"""``transformers.Trainer.floating_point_ops``: the model's parameter count taken once per run.

Every step stock adds ``6 * tokens * num_parameters(exclude_embeddings=True)`` to ``total_flos``, walking
every module and parameter (~6 ms of host time a step on the H200 host) for the same number. Here, inside
``floating_point_ops`` only, ``num_parameters(only_trainable=False)`` answers from a memo that lives as long as
``trainer.state`` (new at each ``train()``) and its model; anything else goes to stock. Risk: parameters
added or removed within one ``train()`` (no Trainer feature does) keep the first count; every compared run
checks total_flos exactly. Refused (check()) unless both functions are reviewed sources (patches/_sources.py).
"""
from __future__ import annotations

import contextvars
import functools

NAME = "trainer_flops"

_KEY = "_solution_flops_memo"
# The memo of the floating_point_ops call in progress ({(id(model), exclude_embeddings): count}), or None.
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("solution_flops_memo", default=None)


def check() -> str | None:
    try:
        import transformers
        from transformers.modeling_utils import PreTrainedModel
    except Exception as exc:  # noqa: BLE001 - transformers missing or broken
        return f"transformers not importable ({type(exc).__name__}: {exc})"
    if not callable(getattr(transformers.Trainer, "floating_point_ops", None)):
        return "transformers.Trainer has no floating_point_ops()"
    if not callable(getattr(PreTrainedModel, "num_parameters", None)):
        return "PreTrainedModel has no num_parameters()"
    # the memo is right only while the count depends on the model's parameters alone: both reviewed
    from solution.patches._sources import first_unexpected

    return first_unexpected(("transformers.Trainer.floating_point_ops", transformers.Trainer.floating_point_ops),
                            ("transformers.PreTrainedModel.num_parameters", PreTrainedModel.num_parameters))


def _memo_of(trainer) -> dict:
    """The trainer's memo for its current run state and model (a new one when either changed)."""
    state, model = getattr(trainer, "state", None), getattr(trainer, "model", None)
    held = trainer.__dict__.get(_KEY)
    if held is None or held[0] is not state or held[1] is not model:
        held = (state, model, {})
        trainer.__dict__[_KEY] = held
    return held[2]


def _make_floating_point_ops(stock):
    def floating_point_ops(self, inputs):
        token = _ACTIVE.set(_memo_of(self))
        try:
            return stock(self, inputs)
        finally:
            _ACTIVE.reset(token)

    functools.update_wrapper(floating_point_ops, stock)
    return floating_point_ops


def _make_num_parameters(stock):
    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        memo = _ACTIVE.get()
        if memo is None or only_trainable:
            return stock(self, only_trainable=only_trainable, exclude_embeddings=exclude_embeddings)
        key = (id(self), bool(exclude_embeddings))
        held = memo.get(key)
        if held is None or held[0] is not self:
            held = memo[key] = (self, stock(self, only_trainable=False, exclude_embeddings=exclude_embeddings))
        return held[1]

    functools.update_wrapper(num_parameters, stock)
    return num_parameters


def install(swaps) -> str:
    import transformers
    from transformers.modeling_utils import PreTrainedModel

    swaps.set(transformers.Trainer, "floating_point_ops",
              _make_floating_point_ops(transformers.Trainer.floating_point_ops))
    swaps.set(PreTrainedModel, "num_parameters", _make_num_parameters(PreTrainedModel.num_parameters))
    return ("Trainer.floating_point_ops: the model's parameter count walked once per run instead of "
            "every step (stock formula; total_flos unchanged)")
