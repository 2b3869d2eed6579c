"""The fixed workload (workload/workload.yaml) rendered into a real Soup 0.77.0 YAML.

``load_workload`` checks the file before anything runs, each problem as one line naming the key:
unknown or missing keys; every value's type and range (integers are integers, ``lr`` a positive
number, ``target_modules`` a list of module names, ``val_split`` 0); the step count, which must be
exactly ceil(examples / (batch_size * gradient_accumulation_steps)) * epochs; ``data.format``
alpaca (the format workload/data/validate.py checks the dataset in); then the values as
Soup will receive them, through Soup's own schema (``load_config_from_string``, which in 0.77.0
also rejects unknown keys), so e.g. a quantization mode Soup does not know is refused here and
not in a training child.

Keys that do not become Soup settings:

- ``soup_version`` (required, used): the Soup the file is written for; it must be the installed
  soup-cli's version (the rendered YAML is 0.77.0's schema).
- ``model.standin_seed`` (required, used): the seed of the random stand-in model that
  ``bench.compare`` writes when no ``--model`` is given.
- ``model.name``, ``quantization.compute_dtype``, ``training.precision`` (optional, not used:
  descriptive only). Soup decides precision and compute dtype itself (fp16 on a T4, which every
  GPU is made to take by ``bench/run_one.py``'s T4 emulation; fp32 on a CPU), so when present they
  must say the only values a GPU run has: ``float16`` and ``fp16``.
- ``training.gradient_checkpointing`` (optional, used): true or false, passed to Soup only when
  present (absent: Soup's default, off). For measuring the case where the challenge's YAML sets it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import yaml

WORKLOAD_FILE = Path(__file__).with_name("workload.yaml")

# Every key the file may hold: section -> {key: required?}; None for a top-level scalar key.
_ALLOWED = {
    "soup_version": None,
    "model": {"name": False, "standin_seed": True},
    "quantization": {"mode": True, "compute_dtype": False},
    "lora": {"r": True, "alpha": True, "target_modules": True},
    "training": {"batch_size": True, "max_length": True, "examples": True, "steps": True, "epochs": True,
                 "gradient_accumulation_steps": True, "val_split": True, "lr": True, "seed": True,
                 "logging_steps": True, "precision": False, "gradient_checkpointing": False},
    "data": {"format": True},
}
# Integers, with their smallest allowed value.
_INTS = {"model.standin_seed": 0, "lora.r": 1, "lora.alpha": 1, "training.batch_size": 1,
         "training.max_length": 1, "training.examples": 1, "training.steps": 1, "training.epochs": 1,
         "training.gradient_accumulation_steps": 1, "training.seed": 0, "training.logging_steps": 1}
# Non-empty strings; with the only value accepted where there is one, and why.
_DESCRIPTIVE = "descriptive only (Soup decides it; a GPU run takes the T4's fp16 path)"
_STRINGS = {"soup_version": None, "model.name": None, "quantization.mode": None,
            "data.format": ("alpaca", "the format the dataset check (workload/data/validate.py) reads"),
            "quantization.compute_dtype": ("float16", _DESCRIPTIVE), "training.precision": ("fp16", _DESCRIPTIVE)}
# Soup's location of a setting (its ValidationError "loc") -> the workload's key.
_SOUP_KEYS = {"training -> lr": "training.lr", "training -> batch_size": "training.batch_size",
              "training -> epochs": "training.epochs", "training -> quantization": "quantization.mode",
              "training -> gradient_accumulation_steps": "training.gradient_accumulation_steps",
              "training -> logging_steps": "training.logging_steps", "training -> seed": "training.seed",
              "training -> lora -> r": "lora.r", "training -> lora -> alpha": "lora.alpha",
              "training -> lora -> target_modules": "lora.target_modules", "data -> format": "data.format",
              "data -> max_length": "training.max_length", "data -> val_split": "training.val_split",
              "training -> gradient_checkpointing": "training.gradient_checkpointing"}


class WorkloadConfigError(ValueError):
    """A workload file that is malformed, names a key we do not know, or holds a bad value."""


@dataclass(frozen=True)
class Workload:
    raw: dict

    @property
    def steps(self) -> int:
        return int(self.raw["training"]["steps"])

    @property
    def examples(self) -> int:
        return int(self.raw["training"]["examples"])

    @property
    def batch_size(self) -> int:
        return int(self.raw["training"]["batch_size"])

    @property
    def max_length(self) -> int:
        return int(self.raw["training"]["max_length"])

    @property
    def standin_seed(self) -> int:
        return int(self.raw["model"]["standin_seed"])

    def steps_for(self, rows: int) -> int:
        """The optimizer steps Soup trains on a dataset of ``rows`` rows (val_split 0)."""
        t = self.raw["training"]
        return math.ceil(rows / (t["batch_size"] * t["gradient_accumulation_steps"])) * t["epochs"]

    def soup_dict(self, base: str, data: str, output: str) -> dict:
        t, lora = self.raw["training"], self.raw["lora"]
        return {
            "base": str(base),
            "task": "sft",
            "data": {
                "train": str(data),
                "format": self.raw["data"]["format"],
                "max_length": t["max_length"],
                "val_split": t["val_split"],
            },
            "training": {
                "epochs": t["epochs"],
                "lr": t["lr"],
                "batch_size": t["batch_size"],
                "gradient_accumulation_steps": t["gradient_accumulation_steps"],
                "quantization": self.raw["quantization"]["mode"],
                "logging_steps": t["logging_steps"],
                "seed": t["seed"],
                "lora": {"r": lora["r"], "alpha": lora["alpha"], "target_modules": list(lora["target_modules"])},
                # only when the workload sets it: Soup's default (off) stays Soup's
                **({"gradient_checkpointing": t["gradient_checkpointing"]} if "gradient_checkpointing" in t else {}),
            },
            "output": str(output),
        }

    def soup_yaml(self, base: str, data: str, output: str) -> str:
        text = yaml.safe_dump(self.soup_dict(base, data, output), sort_keys=False, allow_unicode=True)
        validate_with_soup(text)
        return text


def _get(raw: dict, key: str):
    section, _, sub = key.partition(".")
    return raw[section] if not sub else raw[section].get(sub)


def _has(raw: dict, key: str) -> bool:
    section, _, sub = key.partition(".")
    return section in raw if not sub else sub in raw.get(section, {})


def _describe(value) -> str:
    return f"{value!r} (a {type(value).__name__})"


def _check_values(raw: dict) -> str | None:
    """The first bad value's problem, naming its key, or None."""
    for key, low in _INTS.items():
        v = _get(raw, key)
        if isinstance(v, bool) or not isinstance(v, int):
            return f"{key} must be an integer, got {_describe(v)}"
        if v < low:
            return f"{key} must be at least {low}, got {v}"
    for key, only in _STRINGS.items():
        if not _has(raw, key):
            continue
        v = _get(raw, key)
        if not isinstance(v, str) or not v.strip():
            return f"{key} must be a non-empty string, got {_describe(v)}"
        if only is not None and v != only[0]:
            return f"{key} must be {only[0]!r}, {only[1]}, got {v!r}"
    lr = raw["training"]["lr"]
    try:  # YAML reads 2e-4 (no dot) as a string; Soup's schema takes it as the number it spells
        lr_value = float(lr) if isinstance(lr, str) else lr
    except ValueError:
        lr_value = None
    if isinstance(lr_value, bool) or not isinstance(lr_value, (int, float)) or not math.isfinite(lr_value) \
            or lr_value <= 0:
        return f"training.lr must be a positive number, got {_describe(lr)}"
    gc = raw["training"].get("gradient_checkpointing", False)
    if not isinstance(gc, bool):
        return f"training.gradient_checkpointing must be true or false, got {_describe(gc)}"
    vs = raw["training"]["val_split"]
    if isinstance(vs, bool) or not isinstance(vs, (int, float)) or vs != 0:
        return f"training.val_split must be 0 (every row trains), got {_describe(vs)}"
    tm = raw["lora"]["target_modules"]
    if not isinstance(tm, list) or not tm:
        return f"lora.target_modules must be a list of module names, e.g. [q_proj, v_proj], got {_describe(tm)}"
    bad = [m for m in tm if not isinstance(m, str) or not m.strip()]
    if bad:
        return f"lora.target_modules must hold module names (strings), got {_describe(bad[0])}"
    return None


def _soup_problem(raw: dict, message: str) -> str:
    """Soup's ValidationError text ("training -> lr: Input should be ...; ...") as its first
    problem, located by the workload's key and value."""
    first = " ".join(message.split(";")[0].split())
    loc, sep, msg = first.partition(": ")
    if not sep:
        return first
    key = _SOUP_KEYS.get(loc)
    return f"{key} {_get(raw, key)!r}: {msg}" if key else f"{loc}: {msg}"


def load_workload(path: Path | str = WORKLOAD_FILE) -> Workload:
    """Read and check the workload file; WorkloadConfigError("<path>: <problem>") otherwise."""
    path = Path(path)
    if not path.is_file():
        raise WorkloadConfigError(f"workload file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise WorkloadConfigError(f"{path}: not UTF-8 text") from exc
    except yaml.YAMLError as exc:
        raise WorkloadConfigError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from exc
    if not isinstance(raw, dict):
        raise WorkloadConfigError(f"{path}: expected a mapping at the top level")
    for key, value in raw.items():
        if key not in _ALLOWED:
            raise WorkloadConfigError(f"{path}: unknown key {key!r} (known: {sorted(_ALLOWED)})")
        allowed = _ALLOWED[key]
        if allowed is not None:
            if not isinstance(value, dict):
                raise WorkloadConfigError(f"{path}: {key!r} must be a mapping")
            for sub in value:
                if sub not in allowed:
                    raise WorkloadConfigError(f"{path}: unknown key {key}.{sub} (known: {sorted(allowed)})")
    for key, allowed in _ALLOWED.items():
        if key not in raw:
            raise WorkloadConfigError(f"{path}: missing {key}")
        missing = sorted(sub for sub, required in (allowed or {}).items() if required and sub not in raw[key])
        if missing:
            raise WorkloadConfigError(f"{path}: missing {key}.{missing[0]}")
    problem = _check_values(raw)
    if problem:
        raise WorkloadConfigError(f"{path}: {problem}")
    installed = _soup_version()
    if installed is not None and raw["soup_version"] != installed:
        raise WorkloadConfigError(f"{path}: soup_version {raw['soup_version']!r} is not the installed soup-cli "
                                  f"{installed} (the rendered YAML is written for the workload's Soup)")
    w = Workload(raw)
    t = raw["training"]
    expected_steps = w.steps_for(t["examples"])
    if expected_steps != t["steps"]:
        raise WorkloadConfigError(
            f"{path}: examples {t['examples']} / (batch_size {t['batch_size']} * gradient_accumulation_steps "
            f"{t['gradient_accumulation_steps']}) * epochs {t['epochs']} give {expected_steps} steps, "
            f"but the workload says steps: {t['steps']}")
    try:  # the values as Soup will receive them, through Soup's own schema (placeholder paths)
        w.soup_yaml("/model", "/data.jsonl", "/output")
    except ValueError as exc:
        raise WorkloadConfigError(f"{path}: Soup's config schema refuses {_soup_problem(raw, str(exc))}") from exc
    return w


def _soup_version() -> str | None:
    import importlib.metadata as md

    try:
        return md.version("soup-cli")
    except md.PackageNotFoundError:
        return None


def validate_with_soup(yaml_text: str) -> None:
    """Parse the rendered YAML with Soup's own schema (raises ValueError on any problem)."""
    from soup_cli.config.loader import load_config_from_string

    load_config_from_string(yaml_text)
