"""Randomly initialised stand-ins for Qwen2.5-1.5B-Instruct, written as local HF model dirs.

The real weights cannot be downloaded here. Time and memory depend on shapes, not on weight
values, so the full-size stand-in has the exact Qwen2.5-1.5B-Instruct configuration (the
config.json values below are that model's) and a seeded random initialisation. The tiny
variant keeps the architecture (GQA, q/k/v bias, tied embeddings, the full 151936 vocabulary)
at a size the CPU can train in seconds, for CI.

    python -m workload.model_standin --size full --out .cache/models/qwen2.5-1.5b-standin
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

# config.json of Qwen/Qwen2.5-1.5B-Instruct (architecture fields).
QWEN25_15B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "use_sliding_window": False,
    "tie_word_embeddings": True,
    "vocab_size": 151936,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
    "use_cache": True,
}

# Same architecture, CPU-sized. The vocabulary stays 151936 so tokenizer ids and the LM-head
# shape are the real ones.
TINY_OVERRIDES = {
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_window_layers": 2,
    "torch_dtype": "float32",
}

SIZES = {"full": {}, "tiny": TINY_OVERRIDES}
MARKER = "standin.json"


def standin_config(size: str) -> dict:
    if size not in SIZES:
        raise ValueError(f"unknown stand-in size {size!r}; choose one of {sorted(SIZES)}")
    return {**QWEN25_15B_CONFIG, **SIZES[size]}


def tokenizer_marker(tokenizer_source: str | None) -> dict | None:
    """How the stand-in's tokenizer was made, for its marker: None for the built-in one
    (workload/tokenizer.py), else the source directory (absolute) and its files' fingerprint."""
    if tokenizer_source is None:
        return None
    from workload.tokenizer import source_fingerprint

    source = Path(tokenizer_source).resolve()
    return {"source": str(source), "sha256": source_fingerprint(source)}


def write_standin(out: Path, size: str = "full", seed: int = 1234, tokenizer_source: str | None = None) -> Path:
    """Write (once) a seeded random model dir with tokenizer files. Returns its path.

    Re-running with the same arguments reuses the existing dir (checked by a marker file). The
    weights are rewritten only when size, seed or config differ; the tokenizer whenever another
    one is asked for (``tokenizer_source``: a real tokenizer dir, or None for the built-in one;
    a changed source dir counts as another one), so a cached stand-in always has the tokenizer of
    this call. The weights are stored in the dtype the real checkpoint uses (bf16 for full size),
    since Soup / bitsandbytes quantize from what is stored.
    """
    from workload.tokenizer import check_source

    if tokenizer_source is not None:
        check_source(Path(tokenizer_source))  # before anything is written
    out = Path(out)
    want = {"size": size, "seed": seed, "config": standin_config(size)}
    want_tok = tokenizer_marker(tokenizer_source)
    marker = out / MARKER
    try:
        have = json.loads(marker.read_text(encoding="utf-8")) if marker.exists() else None
    except (OSError, ValueError):  # an unreadable marker: the dir is written again
        have = None
    weights_ok = (isinstance(have, dict) and {k: have.get(k) for k in want} == want
                  and (out / "config.json").exists())
    # A marker written before the tokenizer was recorded (no "tokenizer" key) says nothing about it.
    if weights_ok and "tokenizer" in have and have["tokenizer"] == want_tok:
        return out
    if not weights_ok:
        marker.unlink(missing_ok=True)  # a write cut short leaves no marker: written again next time
        _write_weights(out, size, seed)
    marker.write_text(json.dumps(want, indent=1))  # weights done, tokenizer not yet (no "tokenizer" key)
    _replace_tokenizer(out, tokenizer_source)
    marker.write_text(json.dumps({**want, "tokenizer": want_tok}, indent=1))
    return out


def _replace_tokenizer(out: Path, tokenizer_source: str | None) -> None:
    """Write the tokenizer beside ``out`` first, then move its files in (each one replaced in one
    step, so a reader of ``out`` never finds a tokenizer file missing) and delete the tokenizer files
    the new one does not have (a copied source may hold extras, e.g. added_tokens.json)."""
    import tempfile

    from workload.tokenizer import TOKENIZER_FILES, write_tokenizer

    with tempfile.TemporaryDirectory(prefix=".tokenizer-", dir=out) as tmp:
        write_tokenizer(Path(tmp), source=tokenizer_source)
        for name in TOKENIZER_FILES:
            if (Path(tmp) / name).is_file():
                os.replace(Path(tmp) / name, out / name)
            else:
                (out / name).unlink(missing_ok=True)


def _write_weights(out: Path, size: str, seed: int) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    cfg_dict = dict(standin_config(size))
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[cfg_dict["torch_dtype"]]
    config = Qwen2Config(**{k: v for k, v in cfg_dict.items() if k not in ("architectures", "model_type", "torch_dtype")})
    config.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(seed)
    # Initialise on the GPU when there is one (1.5B parameters: seconds instead of a minute).
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(config)
    model.to(dtype)
    model.save_pretrained(out, safe_serialization=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--tokenizer", default=None, help="path to a real Qwen2.5 tokenizer dir (optional)")
    args = ap.parse_args(argv)
    print(write_standin(args.out, args.size, args.seed, args.tokenizer))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
