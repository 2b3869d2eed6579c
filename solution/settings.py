"""The $SOLUTION_* settings: read from the environment once, validated, frozen (README "Settings").

``Settings.from_env()`` is the only reader of the environment in solution/ (with
``interpreter_enabled``, ``allocator_configured`` and ``child_environ`` for the variables of Triton,
PyTorch and child processes). apply() reads the settings once, validates every value before it
installs anything, and makes them the active settings (``current()``) until revert(): patches and
the step read them at install or call time through ``current()``; the kernels under
solution/kernels/ never do: their callers pass plain arguments (``nf4_mlp(policy=...)``).
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")

# The on/off settings: variable -> (Settings field, default). Every one is read through parse_bool,
# so that one spelling rule holds for all of them.
FLAGS = {
    "SOLUTION_PRECOMPILE": ("precompile", True),
    "SOLUTION_ATTN_VARLEN": ("attn_varlen", True),
    "SOLUTION_ATTN_LAYOUT_KERNELS": ("attn_layout_kernels", True),
    "SOLUTION_DIRECT_LAUNCH": ("direct_launch", True),
    "SOLUTION_QKV_ROPE": ("qkv_rope", True),
    "SOLUTION_GRAPHS_VERIFY": ("graphs_verify", False),
    "SOLUTION_GATE_UP_GEMM": ("gate_up_gemm", True),
    "SOLUTION_LORA_BMM": ("lora_bmm", True),
}
MEMORY_POLICY_ENV = "SOLUTION_MEMORY_POLICY"
MEMORY_POLICIES = ("speed", "balanced", "memory")
CUDA_GRAPHS_ENV = "SOLUTION_CUDA_GRAPHS"
CUDA_GRAPHS_MODES = ("auto", "0", "1")
GRAPH_BUCKET_ENV = "SOLUTION_GRAPH_BUCKET"
DEFAULT_BUCKET = 256  # the trade-off (captures against filler tokens) measured in docs/cuda_graphs.md
MAX_BUCKET = 4096
# The eager packed step's token bucket (solution/step/decoder.py): N: the layers run on the packed
# tokens rounded up to a multiple of N, so cuBLAS meets fewer new GEMM shapes (docs/layer_node.md);
# 0 = off; "auto" (the default): step/cuda_graphs.AUTO_EAGER_BUCKET where the model's eager layers
# were measured host-bound, off where GPU-bound (there the filler row is GPU work for nothing).
EAGER_BUCKET_ENV = "SOLUTION_EAGER_BUCKET"
SKIP_ENV = "SOLUTION_SKIP_PATCHES"
PRECOMPILE_MANIFEST_ENV = "SOLUTION_PRECOMPILE_MANIFEST"  # another manifest file (measurements: a scratch one)
AUTO_APPLY_ENV = "SOLUTION_AUTO_APPLY"  # solution/autoapply.py: apply() in Soup's process, started by someone else


def parse_bool(name: str, raw: str | None, default: bool) -> bool:
    """The on/off value ``raw`` of the variable ``name``: 1/true/on/yes or 0/false/off/no, any case,
    surrounding blanks ignored; None or empty: ``default``. ValueError naming the variable for
    anything else (so that no spelling of "off" can read as on)."""
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
    """ValueError when a name in ``skip`` is not in ``known`` (a typo would otherwise leave the
    patch installed without a word); ``raw``: the variable's text for the message (default: the
    names joined by commas)."""
    known = list(known)
    unknown = sorted(set(skip) - set(known))
    if unknown:
        raw = ",".join(sorted(skip)) if raw is None else raw
        raise ValueError(f"${SKIP_ENV}={raw!r} names no patch: {', '.join(unknown)} "
                         f"(known: {', '.join(known)})")


@dataclass(frozen=True)
class Settings:
    """Every $SOLUTION_* setting, typed; the defaults are those of an empty environment. A value
    outside its range raises ValueError at construction (names in skip_patches are checked against
    the patches by from_env(known_patches=...) and apply())."""

    memory_policy: str = "speed"  # $SOLUTION_MEMORY_POLICY: one of MEMORY_POLICIES (kernels/nf4_mlp.py)
    precompile: bool = True  # $SOLUTION_PRECOMPILE (solution/precompile.py)
    attn_varlen: bool = True  # $SOLUTION_ATTN_VARLEN (step/attention.py)
    attn_layout_kernels: bool = True  # $SOLUTION_ATTN_LAYOUT_KERNELS (step/attention.py)
    direct_launch: bool = True  # $SOLUTION_DIRECT_LAUNCH (kernels/_launches.py: repeated launches skip kernel[grid])
    qkv_rope: bool = True  # $SOLUTION_QKV_ROPE (step/layer.py: attention's way in and out through kernels/qkv_rope.py)
    # $SOLUTION_GRAPHS_VERIFY (step/cuda_graphs.py, ``verify``): "auto" graphs dropped again where the first
    # replay costs more GPU time than the eager layers' host time; off until measured on a GPU
    graphs_verify: bool = False
    # $SOLUTION_GATE_UP_GEMM (kernels/nf4_mlp.py, ``gate_up``): the MLP's gate and up as one GEMM each way
    # (changes the backward's order of summation; docs/kernels/nf4_mlp.md)
    gate_up_gemm: bool = True
    # $SOLUTION_LORA_BMM (step/layer.py, ``_lora_pair_forward16``): q's and v's LoRA A GEMMs batched
    # (the forward's dropout(x) @ A^T, the backward's two A and two dropout(x) gradients; docs/layer_node.md)
    lora_bmm: bool = True
    cuda_graphs: str = "auto"  # $SOLUTION_CUDA_GRAPHS: "auto", "0" or "1" (step/cuda_graphs.py)
    graph_bucket: int = DEFAULT_BUCKET  # $SOLUTION_GRAPH_BUCKET: tokens, 1..MAX_BUCKET
    eager_bucket: int | str = "auto"  # $SOLUTION_EAGER_BUCKET: "auto", or tokens: 0 (off) or 1..MAX_BUCKET
    skip_patches: frozenset[str] = field(default_factory=frozenset)  # $SOLUTION_SKIP_PATCHES
    precompile_manifest: Path | None = None  # $SOLUTION_PRECOMPILE_MANIFEST; None: the shipped one

    def __post_init__(self) -> None:
        if self.memory_policy not in MEMORY_POLICIES:
            raise ValueError(f"Settings.memory_policy={self.memory_policy!r}: expected one of "
                             f"{', '.join(MEMORY_POLICIES)}")
        if self.cuda_graphs not in CUDA_GRAPHS_MODES:
            raise ValueError(f"Settings.cuda_graphs={self.cuda_graphs!r}: expected auto, 0 or 1")
        if not (type(self.graph_bucket) is int and 1 <= self.graph_bucket <= MAX_BUCKET):
            raise ValueError(f"Settings.graph_bucket={self.graph_bucket!r}: expected an integer from 1 "
                             f"to {MAX_BUCKET} tokens")
        if not (self.eager_bucket == "auto" or (type(self.eager_bucket) is int and 0 <= self.eager_bucket <= MAX_BUCKET)):
            raise ValueError(f"Settings.eager_bucket={self.eager_bucket!r}: expected \"auto\", 0 (off) or an "
                             f"integer from 1 to {MAX_BUCKET} tokens")
        object.__setattr__(self, "skip_patches", frozenset(self.skip_patches))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None,
                 known_patches: Iterable[str] | None = None) -> Settings:
        """The settings named by ``environ`` (default: os.environ, read now). ValueError, one line
        naming the variable and what it accepts, for the first invalid value, in the order memory
        policy, on/off settings (FLAGS order), $SOLUTION_CUDA_GRAPHS, $SOLUTION_GRAPH_BUCKET,
        $SOLUTION_EAGER_BUCKET, $SOLUTION_SKIP_PATCHES (its names checked only when ``known_patches`` is given)."""
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
        raw_eager = env.get(EAGER_BUCKET_ENV, "").strip()
        eager_bucket = "auto" if raw_eager.lower() in ("", "auto") else _bucket(raw_eager, EAGER_BUCKET_ENV, 0)
        raw_skip = env.get(SKIP_ENV)
        skip = frozenset(name.strip() for name in (raw_skip or "").split(",") if name.strip())
        if known_patches is not None:
            check_skip_patches(skip, known_patches, raw_skip)
        manifest = env.get(PRECOMPILE_MANIFEST_ENV)
        return cls(memory_policy=memory_policy, cuda_graphs=cuda_graphs, graph_bucket=graph_bucket,
                   eager_bucket=eager_bucket,
                   skip_patches=skip, precompile_manifest=Path(manifest) if manifest else None, **flags)


def _bucket(raw: str, name: str = GRAPH_BUCKET_ENV, off: int | None = None) -> int:
    """A bucket variable's text (stripped) as a token count; empty: DEFAULT_BUCKET, or ``off``
    where the variable has an off value (0: $SOLUTION_EAGER_BUCKET, whose "auto" its caller reads)."""
    if not raw:
        return DEFAULT_BUCKET if off is None else off
    try:
        value = int(raw)
    except ValueError:
        value = -1
    low = 1 if off is None else 0
    if value < low or value > MAX_BUCKET:
        what = "an integer from 1" if off is None else "auto, 0 (off) or an integer from 1"
        raise ValueError(f"${name} must be {what} to {MAX_BUCKET} tokens, got {raw!r}")
    return value


# What the decoder CUDA graphs need from attention (solution/step/cuda_graphs.py, ``refusal``):
# a graph replays one capture for every batch of a token bucket, so attention must run on the
# packed rows (variable-length attention, row offsets on the GPU); the padded layout's shape and
# indices change with each batch.
GRAPHS_NEED = ("the decoder CUDA graphs (a graph replays one capture for every batch of its bucket, and only "
               "attention on the packed rows can be replayed so: the padded layout changes with each batch)")


def cross_effects(s: Settings) -> list[str]:
    """One line for each setting in ``s`` that turns another feature off, naming the setting, what
    it does, and what else it turns off. apply() says each line, so that no setting turns a
    feature off unsaid (README "Settings" lists the same)."""
    graphs_on = s.cuda_graphs != "0"
    anyway = f" (the decoder CUDA graphs are off anyway: ${CUDA_GRAPHS_ENV}=0)"
    lines = []
    if not s.attn_layout_kernels:
        lines.append("$SOLUTION_ATTN_LAYOUT_KERNELS=0: torch's index ops around attention instead of our layout "
                     "kernels; this also turns off variable-length attention (it repeats the K/V heads with those "
                     "kernels: attention runs on the padded layout)" + (f" and {GRAPHS_NEED}" if graphs_on else anyway))
    if not s.attn_varlen:
        lines.append("$SOLUTION_ATTN_VARLEN=0: attention on the padded layout instead of variable-length attention "
                     "on the packed rows" + (f"; this also turns off {GRAPHS_NEED}" if graphs_on else anyway))
    if type(s.eager_bucket) is int and s.eager_bucket and not (s.attn_layout_kernels and s.attn_varlen):
        lines.append(f"${EAGER_BUCKET_ENV}={s.eager_bucket} has no effect: attention runs on the padded layout, "
                     "where a filler row would share positions with real tokens")
    return lines


_active: Settings | None = None


def activate(settings: Settings | None) -> None:
    """Make ``settings`` the active settings (apply() does, before installing anything; revert()
    passes None)."""
    global _active
    _active = settings


def current() -> Settings:
    """The active settings (those apply() read); with none active (no apply(), or after
    revert()), Settings.from_env() read now, so that the step and patches used without apply()
    (tests, benchmarks) follow the environment at each call."""
    return _active if _active is not None else Settings.from_env()


def auto_apply_enabled() -> bool:
    """$SOLUTION_AUTO_APPLY (on/off, parse_bool's spellings; default off), read now: whether the
    auto-apply hook of solution/autoapply.py applies the patches in this process. ValueError for
    a value that is neither."""
    return parse_bool(AUTO_APPLY_ENV, os.environ.get(AUTO_APPLY_ENV), False)


def auto_apply_startup_test() -> str:
    """The Python expression the start-up line of solution/autoapply.py's .pth file evaluates (with
    ``os`` imported) before it loads anything: true when $SOLUTION_AUTO_APPLY is set at all (its
    value is checked by auto_apply_enabled() when Soup is imported). Kept here, with the other
    readers of the environment."""
    return f"os.environ.get({AUTO_APPLY_ENV!r}, '').strip()"


def interpreter_enabled() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter ($TRITON_INTERPRET=1, which
    Triton itself reads at each launch: read now, not once)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def c_compiler() -> str | None:
    """$CC: the C compiler Triton builds its kernels' launchers with when it is set (Triton reads it
    at each build: read now, not once); None when unset."""
    return os.environ.get("CC")


def allocator_configured() -> bool:
    """The user configured PyTorch's CUDA allocator ($PYTORCH_CUDA_ALLOC_CONF is set): apply()
    leaves it as it is."""
    return bool(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))


def child_environ(drop: Iterable[str] = ()) -> dict[str, str]:
    """A copy of this process's environment without the variables ``drop``, for a child process."""
    drop = set(drop)
    return {k: v for k, v in os.environ.items() if k not in drop}
