"""The $SOLUTION_* settings: read from the environment once, validated, frozen (README "Settings").

This module is solution/'s only reader of the environment (``use_interpreter`` its only writer). apply()
validates the settings before it installs anything and makes them ``current()`` until revert(); patches and the
step read ``current()``; the kernels never do (their callers pass plain arguments).
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")

# The on/off settings: variable -> (Settings field, default), read through parse_bool.
FLAGS = {
    "SOLUTION_PRECOMPILE": ("precompile", True),
}
MEMORY_POLICY_ENV = "SOLUTION_MEMORY_POLICY"
MEMORY_POLICIES = ("speed", "balanced", "memory")
CUDA_GRAPHS_ENV = "SOLUTION_CUDA_GRAPHS"
CUDA_GRAPHS_MODES = ("auto", "0", "1")
GRAPH_BUCKET_ENV = "SOLUTION_GRAPH_BUCKET"
DEFAULT_BUCKET = 256  # the trade-off (captures against filler tokens) measured in docs/cuda_graphs.md
MAX_BUCKET = 4096
SKIP_ENV = "SOLUTION_SKIP_PATCHES"
AUTO_APPLY_ENV = "SOLUTION_AUTO_APPLY"  # solution/autoapply.py: apply() in Soup's process, started by someone else
# Every $SOLUTION_* variable solution/ reads (tests/test_settings.py checks that no other is read).
ALL_ENV = (MEMORY_POLICY_ENV, *FLAGS, CUDA_GRAPHS_ENV, GRAPH_BUCKET_ENV, SKIP_ENV, AUTO_APPLY_ENV)


def parse_bool(name: str, raw: str | None, default: bool) -> bool:
    """``raw`` of the variable ``name`` as on/off: 1/true/on/yes or 0/false/off/no, any case, blanks ignored;
    None or empty: ``default``; anything else: ValueError naming the variable."""
    value = (raw or "").strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"${name}={raw!r} is not an on/off value: expected one of "
                     f"{'/'.join(_TRUE)} or {'/'.join(_FALSE)}")


def check_skip_patches(skip: Iterable[str], known: Iterable[str], raw: str | None = None) -> None:
    """ValueError when a name in ``skip`` is not in ``known``; ``raw``: the variable's text for the message."""
    known = list(known)
    unknown = sorted(set(skip) - set(known))
    if unknown:
        raw = ",".join(sorted(skip)) if raw is None else raw
        raise ValueError(f"${SKIP_ENV}={raw!r} names no patch: {', '.join(unknown)} "
                         f"(known: {', '.join(known)})")


@dataclass(frozen=True)
class Settings:
    """Every $SOLUTION_* setting, typed; defaults: an empty environment's. ValueError at construction for a
    value out of range (skip_patches' names are checked by from_env(known_patches=...) and apply())."""

    memory_policy: str = "speed"  # $SOLUTION_MEMORY_POLICY: one of MEMORY_POLICIES (kernels/nf4_mlp.py)
    precompile: bool = True  # $SOLUTION_PRECOMPILE (solution/precompile.py)
    cuda_graphs: str = "auto"  # $SOLUTION_CUDA_GRAPHS: "auto", "0" or "1" (step/cuda_graphs.py)
    graph_bucket: int = DEFAULT_BUCKET  # $SOLUTION_GRAPH_BUCKET: tokens, 1..MAX_BUCKET
    skip_patches: frozenset[str] = field(default_factory=frozenset)  # $SOLUTION_SKIP_PATCHES

    def __post_init__(self) -> None:
        if self.memory_policy not in MEMORY_POLICIES:
            raise ValueError(f"Settings.memory_policy={self.memory_policy!r}: expected one of "
                             f"{', '.join(MEMORY_POLICIES)}")
        if self.cuda_graphs not in CUDA_GRAPHS_MODES:
            raise ValueError(f"Settings.cuda_graphs={self.cuda_graphs!r}: expected auto, 0 or 1")
        if not (type(self.graph_bucket) is int and 1 <= self.graph_bucket <= MAX_BUCKET):
            raise ValueError(f"Settings.graph_bucket={self.graph_bucket!r}: expected an integer from 1 "
                             f"to {MAX_BUCKET} tokens")
        object.__setattr__(self, "skip_patches", frozenset(self.skip_patches))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None,
                 known_patches: Iterable[str] | None = None) -> Settings:
        """The settings named by ``environ`` (default: os.environ, read now). ValueError naming the variable
        and what it accepts for the first invalid value (skip names checked only with ``known_patches``)."""
        env = os.environ if environ is None else environ
        raw = env.get(MEMORY_POLICY_ENV, "")
        memory_policy = raw.strip().lower() or "speed"
        if memory_policy not in MEMORY_POLICIES:
            raise ValueError(f"${MEMORY_POLICY_ENV}={raw!r} is not a memory policy: "
                             f"expected one of {', '.join(MEMORY_POLICIES)}")
        flags = {fld: parse_bool(name, env.get(name), default) for name, (fld, default) in FLAGS.items()}
        cuda_graphs = env.get(CUDA_GRAPHS_ENV, "auto").strip().lower() or "auto"
        if cuda_graphs not in CUDA_GRAPHS_MODES:
            raise ValueError(f"${CUDA_GRAPHS_ENV} must be auto, 0 or 1, got {env.get(CUDA_GRAPHS_ENV)!r}")
        graph_bucket = _bucket(env.get(GRAPH_BUCKET_ENV, "").strip())
        raw_skip = env.get(SKIP_ENV)
        skip = frozenset(name.strip() for name in (raw_skip or "").split(",") if name.strip())
        if known_patches is not None:
            check_skip_patches(skip, known_patches, raw_skip)
        return cls(memory_policy=memory_policy, cuda_graphs=cuda_graphs, graph_bucket=graph_bucket,
                   skip_patches=skip, **flags)


def _bucket(raw: str) -> int:
    """$SOLUTION_GRAPH_BUCKET's text (stripped) as a token count; empty: DEFAULT_BUCKET."""
    if not raw:
        return DEFAULT_BUCKET
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 1 or value > MAX_BUCKET:
        raise ValueError(f"${GRAPH_BUCKET_ENV} must be an integer from 1 to {MAX_BUCKET} tokens, got {raw!r}")
    return value


_active: Settings | None = None


def activate(settings: Settings | None) -> None:
    """Make ``settings`` the active settings (apply(); revert() passes None)."""
    global _active
    _active = settings


def current() -> Settings:
    """The active settings; with none active (no apply(), or after revert()), Settings.from_env() read now."""
    return _active if _active is not None else Settings.from_env()


def auto_apply_enabled() -> bool:
    """$SOLUTION_AUTO_APPLY (on/off, default off), read now: whether solution/autoapply.py's hook applies."""
    return parse_bool(AUTO_APPLY_ENV, os.environ.get(AUTO_APPLY_ENV), False)


def auto_apply_startup_test() -> str:
    """The expression autoapply.py's .pth line evaluates (``os`` imported) before loading anything: true when
    $SOLUTION_AUTO_APPLY is set at all (auto_apply_enabled() checks its value when Soup is imported)."""
    return f"os.environ.get({AUTO_APPLY_ENV!r}, '').strip()"


def interpreter_enabled() -> bool:
    """$TRITON_INTERPRET=1 (Triton's CPU interpreter), read now."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_interpreter() -> None:
    """Set $TRITON_INTERPRET=1 here and for children: kernel modules imported from now on run on the CPU."""
    os.environ["TRITON_INTERPRET"] = "1"


def c_compiler() -> str | None:
    """$CC (the C compiler Triton builds launchers with), read now; None when unset."""
    return os.environ.get("CC")


def allocator_configured() -> bool:
    """$PYTORCH_CUDA_ALLOC_CONF is set (apply() then leaves the allocator as it is)."""
    return bool(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))


def child_environ(drop: Iterable[str] = ()) -> dict[str, str]:
    """A copy of this process's environment without the variables ``drop``, for a child process."""
    drop = set(drop)
    return {k: v for k, v in os.environ.items() if k not in drop}
