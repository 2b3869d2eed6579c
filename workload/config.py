"""The fixed workload (workload/workload.yaml) rendered into a real Soup 0.77.0 YAML.

The rendered YAML is validated by Soup's own loader (``load_config_from_string``), which in
0.77.0 rejects unknown keys, and the step count is checked to be exactly the workload's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import yaml

WORKLOAD_FILE = Path(__file__).with_name("workload.yaml")

_ALLOWED = {
    "soup_version": None,
    "model": {"name", "standin_seed"},
    "quantization": {"mode", "compute_dtype"},
    "lora": {"r", "alpha", "target_modules"},
    "training": {"batch_size", "max_length", "examples", "steps", "epochs",
                 "gradient_accumulation_steps", "val_split", "lr", "seed", "logging_steps", "precision"},
    "data": {"format"},
}


class WorkloadConfigError(ValueError):
    """A workload file that is malformed or names a key we do not know."""


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
            },
            "output": str(output),
        }

    def soup_yaml(self, base: str, data: str, output: str) -> str:
        text = yaml.safe_dump(self.soup_dict(base, data, output), sort_keys=False, allow_unicode=True)
        validate_with_soup(text)
        return text


def load_workload(path: Path | str = WORKLOAD_FILE) -> Workload:
    path = Path(path)
    if not path.is_file():
        raise WorkloadConfigError(f"workload file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise WorkloadConfigError(f"{path}: not valid YAML: {exc}") from exc
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
            missing = allowed - set(value)
            if missing:
                raise WorkloadConfigError(f"{path}: missing {key}.{sorted(missing)[0]}")
    w = Workload(raw)
    t = raw["training"]
    expected_steps = math.ceil(t["examples"] / (t["batch_size"] * t["gradient_accumulation_steps"])) * t["epochs"]
    if expected_steps != t["steps"] or t["val_split"] != 0:
        raise WorkloadConfigError(
            f"{path}: examples/batch/accumulation/epochs give {expected_steps} steps with val_split "
            f"{t['val_split']}, but the workload says {t['steps']} steps (val_split must be 0)")
    return w


def validate_with_soup(yaml_text: str) -> None:
    """Parse the rendered YAML with Soup's own schema (raises ValueError on any problem)."""
    from soup_cli.config.loader import load_config_from_string

    load_config_from_string(yaml_text)
