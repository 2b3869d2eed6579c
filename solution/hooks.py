"""Module hooks, asked one way everywhere: work done without calling the module would skip its hooks, so where
any is present the stock call is kept (patches) or the graph is refused (step/cuda_graphs.py)."""
from __future__ import annotations

from torch.nn.modules import module as _nn_module

OWN_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                "_global_backward_pre_hooks")


def global_hooks() -> bool:
    """A forward / backward hook registered for every module (torch.nn.modules.module's globals)."""
    return any(getattr(_nn_module, a, None) for a in GLOBAL_HOOKS)


def own_hooks(module) -> bool:
    """A hook registered on ``module`` itself (instance dict reads: the node's per-step check asks every module)."""
    d = module.__dict__
    return bool(d.get("_forward_hooks") or d.get("_forward_pre_hooks") or d.get("_backward_hooks")
                or d.get("_backward_pre_hooks"))


def has_hooks(module) -> bool:
    """Any hook that calling ``module(...)`` would fire: its own or a global one."""
    return own_hooks(module) or global_hooks()
