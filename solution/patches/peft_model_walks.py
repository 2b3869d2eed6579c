"""``PeftModel.parameters()``, ``zero_grad()`` and ``train()``: the Trainer's per-step walks over the whole
model, made in one pass over the modules' own dicts (torch's walks visit ~1,000 modules every step, building a
name for each; bitsandbytes' 4-bit weights route ``.grad`` reads through ``__torch_function__``):
- ``parameters(recurse=True)``: torch's order (pre-order, children in insertion order, a module or parameter
  met twice taken once, None slots skipped), the same objects;
- ``zero_grad(set_to_none=True)``: that walk, ``p.grad = None`` where set (reads with subclass overrides off:
  the same tensor); ``set_to_none=False`` or a replica: stock;
- ``train(mode)``: returns at once when every module already has ``training == mode`` and each class takes
  torch's ``Module.train`` or the reviewed ``PreTrainedModel.train``; otherwise stock.
A module class with its own walk methods (``_WALK_METHODS``): stock for all three. Tests compare objects and
order with torch's. Refused (check()) unless torch's methods are reviewed sources (sha256, patches/_sources.py).
"""
from __future__ import annotations

import functools

from solution import state

NAME = "peft_model_walks"

_WALK_METHODS = ("named_modules", "named_parameters", "_named_members", "parameters")
_PLAIN_WALK: dict = state.kept({})  # module class -> it walks as torch's Module does (or through this patch)
_PLAIN_TRAIN: dict = state.kept({})  # module class -> its train() is a no-op when the mode does not change


def check() -> str | None:
    try:
        import peft  # noqa: F401
        import torch  # noqa: F401
        from peft import PeftModel
    except Exception as exc:  # noqa: BLE001 - peft missing or broken
        return f"peft not importable ({type(exc).__name__}: {exc})"
    for name in ("parameters", "zero_grad", "train"):
        if name in PeftModel.__dict__:
            return f"peft.PeftModel defines its own {name}()"
    # the walks mirror torch's (order, duplicates, None slots, flags): its methods must be reviewed sources
    from solution.patches._sources import first_unexpected

    module = torch.nn.Module
    return first_unexpected(*((f"torch.nn.Module.{m}", module.__dict__.get(m))
                              for m in _WALK_METHODS + ("train", "zero_grad")))


def _walks_plainly(classes) -> bool:
    """Every class in ``classes`` walks as torch's Module does (torch's methods, or this patch's)."""
    for cls in classes:
        ok = _PLAIN_WALK.get(cls)
        if ok is None:
            import torch

            module = torch.nn.Module
            ok = _PLAIN_WALK[cls] = all(getattr(cls, m) is getattr(module, m)
                                        or getattr(getattr(cls, m), "_solution_walks", False)
                                        for m in _WALK_METHODS)
        if not ok:
            return False
    return True


def _collect(m, seen: set, out: list) -> None:
    out.append(m)
    for c in m._modules.values():
        if c is not None and id(c) not in seen:
            seen.add(id(c))
            _collect(c, seen, out)


def _modules(root) -> list | None:
    """Every module under ``root`` (itself first) in ``named_modules`` order, once; None: a class walks its own way."""
    out: list = []
    _collect(root, {id(root)}, out)
    return out if _walks_plainly({type(m) for m in out}) else None


def _collect_parameters(m, seen: set, seen_p: set, out: list, classes: set) -> None:
    classes.add(type(m))
    for p in m._parameters.values():
        if p is not None and id(p) not in seen_p:
            seen_p.add(id(p))
            out.append(p)
    for c in m._modules.values():
        if c is not None and id(c) not in seen:
            seen.add(id(c))
            _collect_parameters(c, seen, seen_p, out, classes)


def walk_parameters(root) -> list | None:
    """``list(root.parameters())`` as torch gives it (None: a module walks in its own way; ask torch)."""
    out: list = []
    classes: set = set()
    _collect_parameters(root, {id(root)}, set(), out, classes)
    return out if _walks_plainly(classes) else None


def _plain_train(cls) -> bool:
    ok = _PLAIN_TRAIN.get(cls)
    if ok is None:
        import torch

        train = cls.train
        ok = train is torch.nn.Module.train or getattr(train, "_solution_walks", False) or _reviewed_train(train)
        _PLAIN_TRAIN[cls] = ok
    return ok


def _reviewed_train(train) -> bool:
    """transformers' reviewed ``PreTrainedModel.train``: with the mode unchanged it is ``Module.train``."""
    try:
        from transformers.modeling_utils import PreTrainedModel
    except Exception:  # noqa: BLE001
        return False
    if train is not PreTrainedModel.__dict__.get("train"):
        return False
    from solution.patches._sources import unexpected_source

    return unexpected_source("transformers.PreTrainedModel.train", train) is None


def _make_parameters(stock):
    def parameters(self, recurse: bool = True):
        params = walk_parameters(self) if recurse else None
        return stock(self, recurse) if params is None else iter(params)

    functools.update_wrapper(parameters, stock)
    parameters._solution_walks = True
    return parameters


def _make_zero_grad(stock):
    def zero_grad(self, set_to_none: bool = True) -> None:
        if not set_to_none or getattr(self, "_is_replica", False):
            return stock(self, set_to_none)
        params = walk_parameters(self)
        if params is None:
            return stock(self, set_to_none)
        import torch

        with torch._C.DisableTorchFunctionSubclass():
            for p in params:
                if p.grad is not None:
                    p.grad = None
        return None

    functools.update_wrapper(zero_grad, stock)
    zero_grad._solution_walks = True
    return zero_grad


def _make_train(stock):
    def train(self, mode: bool = True):
        if type(mode) is bool:
            modules = _modules(self)
            if modules is not None and all(m.training is mode for m in modules) \
                    and all(_plain_train(cls) for cls in {type(m) for m in modules}):
                return self
        return stock(self, mode)

    functools.update_wrapper(train, stock)
    train._solution_walks = True
    return train


def install(swaps) -> str:
    from peft import PeftModel

    swaps.set(PeftModel, "parameters", _make_parameters(PeftModel.parameters))
    swaps.set(PeftModel, "zero_grad", _make_zero_grad(PeftModel.zero_grad))
    swaps.set(PeftModel, "train", _make_train(PeftModel.train))
    return ("PeftModel.parameters / zero_grad / train: the Trainer's per-step walks in one pass over the "
            "modules' dicts (the same parameters, order and flags as torch's)")
