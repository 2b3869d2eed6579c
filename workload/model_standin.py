"""Randomly initialised stand-ins for Qwen2.5-1.5B-Instruct, written as local HF model dirs.

The real weights cannot be downloaded here. Time and memory depend on shapes, not on weight
values, so the full-size stand-in has the exact Qwen2.5-1.5B-Instruct configuration (the
config.json values below are that model's) and a seeded random initialisation. The tiny
variant keeps the architecture (GQA, q/k/v bias, tied embeddings, the full 151936 vocabulary)
at a size the CPU can train in seconds, for CI.

Profiles: "default", the seeded random initialisation; "outliers", the same weights plus the
real model's fp16 extremes (massive activations and super weights, from published measurements;
docs/outliers.md), so that fp16 training meets values near or past fp16's range as the real model
does. Numerics only: shapes, and so time and memory, are the default's.

    python -m workload.model_standin --size full --out .cache/models/qwen2.5-1.5b-standin
    python -m workload.model_standin --size full --profile outliers --out DIR [--outlier-scale 1]

The "outliers" profile reproduces these measurements of Qwen2.5-1.5B-Instruct (bf16, hidden
states after each decoder layer, 5,000 samples; Chen et al. 2026, "Measuring Maximum Activations
in Open Large Language Models", arXiv 2605.15572, code and data github.com/clx1415926/Max_act_llm,
results/Qwen2.5-it/logs/Qwen2.5-1.5B-Instruct.log and json/Qwen2.5-1.5B-Instruct_activation_stats.json):
  * two residual channels, one negative, one positive (the maxima -7968 and +6368);
  * created by the MLPs of layers 1 and 2 (MLP outputs -4192 / +3376 and -3584 / +2832; layers 3-5
    add ~-60 / +50 each), constant through layer 25 (-7936 / +6336), cancelled by layer 26's MLP
    (output +7648 / -6144; hidden state after it -400 / +328);
  * layer 1's largest gate pre-activation 36 (the unit that makes the massive value), hidden-state
    RMS ~5 elsewhere.
As Sun et al. 2024 ("Massive Activations in Large Language Models", COLM 2024, arXiv 2402.17762)
found across LLMs: a few fixed channels, values 10^3-10^4 (~10^4 x the median), on the starting
token and delimiter tokens ("." / "\n"), appearing abruptly in an early layer, nearly constant
across inputs and layers, acting as biases. As Yu et al. 2024 ("The Super Weight in Large
Language Models", arXiv 2411.07191) found: each is written by a single large scalar of an early
layer's mlp.down_proj (a "super weight", layer 2 in Llama-7B) from one intermediate unit whose
input is huge (the "super activation"), and is carried by the residual stream. Qwen2 in fp16 is
reported to overflow: Qwen2-1.5B-Instruct's activations turn NaN after layer 1 in fp16 inference
(QwenLM/Qwen3 issue 826), Qwen2-7B-Instruct's fp16 fine-tuning gives NaN losses (issues 670, 868;
the Qwen team: fp16 needs fused kernels with fp32 accumulation), and eager attention's fp16 Q K^T
overflows (huggingface/transformers PR 33317).

The stand-in's mechanism (random attention cannot single out the first token as a trained model's
does, so the trigger is the token itself): the published triggers, "<|im_start|>" (every
sequence's first token under the ChatML template) and "\n", carry TRIGGER_VALUE in a trigger
channel of their own; in layer 1 one gate / up unit per massive channel reads it and writes the
published MLP output through its super weight; layers 2-5 and 26 read the negative massive channel
the same way. Every channel involved is dedicated (no other token ever holds a value there), so
the units open on trigger tokens only. Every occurrence of a trigger token gets the massive values
(the real model gives them to the first delimiter only): more massive tokens per sequence than
the real model, never fewer.

With the workload's fp32 residual stream and fused attention, the published magnitudes stay inside
fp16's range (docs/outliers.md: the largest fp16 value the full-size stand-in's forward meets is
~7,700, its largest gradient at the GradScaler's initial scale far below 65504). So that stock
fp16 training does meet an overflow, as Qwen2 is reported to, one rarer delimiter, "«", is a
raised trigger: its layer-1 massive values are the published ones times ``outlier_scale``
(DEFAULT_OUTLIER_SCALE, 20: 4192 x 20 = 83,840 > 65504), so stock's fp16 forward overflows on
the steps whose batch holds one (5 of the 256 shipped examples) and the GradScaler skips them.
``outlier_scale=1`` keeps every value at the published magnitude.
"""
from __future__ import annotations

import argparse
import json
import math
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
PROFILES = ("default", "outliers")

# --- the "outliers" profile (the module docstring gives the sources) ---------------------------
# Token ids in Qwen2.5's tokenizer (workload/tokenizer.py; tests/test_standin_outliers.py checks them).
# The published triggers: "<|im_start|>" (every sequence's first token under ChatML) and "\n", in
# every sequence. The raised trigger: "«" (the Kazakh opening quotation mark, a delimiter without
# a leading space), in 5 of the 256 shipped examples: the batches that hold one are the steps
# whose stock fp16 forward overflows once outlier_scale is past OVERFLOW_SCALE.
PUBLISHED_TRIGGERS = (151644, 198)
RAISED_TRIGGERS = (23703,)
# A trigger group's embedding entry in its own trigger channel. The published group's stays small
# enough that the tied LM head's fp16 gradient in that channel (value * GradScaler scale / label
# tokens) stays far below fp16's limit; the raised group's dominates the token's residual norm
# before layer 1's MLP, so its massive values barely depend on the context.
TRIGGER_VALUE = 30.0
RAISED_TRIGGER_VALUE = 200.0
# (layer, MLP output on a trigger token in the negative massive channel, in the positive one):
# Chen et al. 2026's Qwen2.5-1.5B-Instruct figures; layers 3-5 split the rest of the way to the
# plateau -7968 / +6368; layer 26 cancels it (-7968 + 7648 = -320, 6368 - 6144 = 224).
MASSIVE_MLP_OUTPUTS = ((1, -4192.0, 3376.0), (2, -3584.0, 2832.0), (3, -64.0, 54.0), (4, -64.0, 53.0),
                       (5, -64.0, 53.0), (26, 7648.0, -6144.0))
GATE_VALUE = 36.0    # the gate pre-activation of a massive value's unit on a trigger token (layer 1's max)
SUPER_WEIGHT = 2.0   # |mlp.down_proj weight| that writes a massive value (100x the init's std 0.02)
# The raised group's layer-1 massive values are the published ones times outlier_scale; fp16's
# largest finite value is 65504, so its layer-1 down_proj output overflows (inf in stock's fp16
# GEMM) once outlier_scale > 65504 / 4192 = 15.6. The default, 20, overflows with a 28% margin
# for the weights' bf16 storage and NF4 quantization; 1 keeps every value at the published one.
DEFAULT_OUTLIER_SCALE = 20.0
OVERFLOW_SCALE = 65504.0 / 4192.0
# The calibration prompt: what every training sequence starts with under the ChatML template
# (Qwen2.5's default system prompt, then the user turn's header), then "«". The units' weights are
# solved from their key channel's normed value measured on its trigger tokens here, so the
# massive values are the published ones exactly on this prefix, and close to them elsewhere.
CALIBRATION_IDS = (151644, 8948, 198, 2610, 525, 1207, 16948, 11, 3465, 553, 54364, 14817, 13, 1446, 525,
                   264, 10950, 17847, 13, 151645, 198, 151644, 872, 198, 23703)


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


def write_standin(out: Path, size: str = "full", seed: int = 1234, tokenizer_source: str | None = None,
                  profile: str = "default", outlier_scale: float = DEFAULT_OUTLIER_SCALE) -> Path:
    """Write (once) a seeded random model dir with tokenizer files. Returns its path.

    ``profile`` (PROFILES): "default", the seeded random weights; "outliers", the same weights plus
    the massive activations and super weights of the module docstring, the raised trigger's times
    ``outlier_scale`` (> 0; the default overflows fp16 in stock's forward, 1 keeps the published
    magnitudes). Re-running with the same arguments reuses the existing dir (checked by a marker
    file). The weights are rewritten only when size, seed, config, profile or scale differ; the
    tokenizer whenever another one is asked for (``tokenizer_source``: a real tokenizer dir, or None
    for the built-in one; a changed source dir counts as another one), so a cached stand-in always
    has the tokenizer of this call. The weights are stored in the dtype the real checkpoint uses
    (bf16 for full size), since Soup / bitsandbytes quantize from what is stored.
    """
    from workload.tokenizer import check_source

    if profile not in PROFILES:
        raise ValueError(f"unknown stand-in profile {profile!r}; choose one of {', '.join(PROFILES)}")
    if not (isinstance(outlier_scale, (int, float)) and math.isfinite(outlier_scale) and outlier_scale > 0):
        raise ValueError(f"outlier_scale must be a positive number, got {outlier_scale!r}")
    if tokenizer_source is not None:
        check_source(Path(tokenizer_source))  # before anything is written
    out = Path(out)
    want = {"size": size, "seed": seed, "config": standin_config(size)}
    if profile != "default":  # the default's marker stays what it was: existing stand-ins are reused
        want.update(profile=profile, outlier_scale=float(outlier_scale))
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
        _write_weights(out, size, seed, profile, float(outlier_scale))
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


def build_model(size: str, seed: int, profile: str = "default", outlier_scale: float = DEFAULT_OUTLIER_SCALE,
                device=None):
    """The stand-in model in memory (fp32): the seeded random initialisation, plus the "outliers"
    profile's weights when asked. ``device``: where to initialise (default: the GPU when there is one,
    1.5B parameters in seconds instead of a minute; the random weights depend on it)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg_dict = dict(standin_config(size))
    config = Qwen2Config(**{k: v for k, v in cfg_dict.items() if k not in ("architectures", "model_type", "torch_dtype")})
    config.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(seed)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    if profile == "outliers":
        add_outliers(model, seed, outlier_scale)
    return model


def _write_weights(out: Path, size: str, seed: int, profile: str = "default",
                   outlier_scale: float = DEFAULT_OUTLIER_SCALE) -> None:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[standin_config(size)["torch_dtype"]]
    model = build_model(size, seed, profile, outlier_scale)
    model.to(dtype)
    model.save_pretrained(out, safe_serialization=True)


def outlier_channels(hidden: int, intermediate: int, seed: int) -> dict:
    """Where the "outliers" profile puts its extremes, drawn from ``seed`` (the published sources do not
    give Qwen2.5-1.5B's channel numbers): residual channels "trigger" (the published triggers'),
    "raised_trigger", "negative" and "positive" (the massive channels); intermediate units, per layer of
    MASSIVE_MLP_OUTPUTS, (negative, positive) in "units", and the raised group's layer-1 pair in
    "raised_units"."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    trigger, raised, negative, positive = torch.randperm(hidden, generator=g)[:4].tolist()
    units = torch.randperm(intermediate, generator=g)[:2 * len(MASSIVE_MLP_OUTPUTS) + 2].tolist()
    return {"trigger": trigger, "raised_trigger": raised, "negative": negative, "positive": positive,
            "units": {layer: (units[2 * i], units[2 * i + 1]) for i, (layer, _, _) in enumerate(MASSIVE_MLP_OUTPUTS)},
            "raised_units": (units[-2], units[-1])}


class _Captured(Exception):
    """Stops a calibration forward once the wanted layer's norm has run."""


def _normed_on_triggers(model, layer_idx: int, channel: int, trigger_ids: tuple) -> float:
    """Layer ``layer_idx``'s post-attention RMSNorm output in ``channel``, averaged over the trigger
    tokens of CALIBRATION_IDS: what that layer's MLP reads there (fp32 forward, no gradient)."""
    import torch

    norm = model.model.layers[layer_idx].post_attention_layernorm
    seen = {}

    def hook(module, args, output):
        seen["y"] = output.detach()
        raise _Captured

    handle = norm.register_forward_hook(hook)
    ids = torch.tensor([CALIBRATION_IDS], device=model.model.embed_tokens.weight.device)
    try:
        with torch.no_grad():
            model.model(input_ids=ids)
    except _Captured:
        pass
    finally:
        handle.remove()
    positions = [i for i, t in enumerate(CALIBRATION_IDS) if t in trigger_ids]
    return float(seen["y"][0, positions, channel].double().mean())


def add_outliers(model, seed: int, outlier_scale: float = DEFAULT_OUTLIER_SCALE) -> dict:
    """Give a Qwen2ForCausalLM (the seeded random stand-in) the "outliers" profile, in place.

    Channels (outlier_channels) are dedicated: only the trigger tokens' embeddings write the two
    trigger channels (TRIGGER_VALUE, RAISED_TRIGGER_VALUE), only super weights write the two
    massive channels, so every other token holds exactly 0 there and no unit below ever opens for
    it; the final norm zeroes the trigger channels (the tied LM head never sees them). Units: for
    each (layer, negative, positive) of MASSIVE_MLP_OUTPUTS, one intermediate unit per massive
    channel reads the layer's key channel (first layer: the trigger channel; later: the negative
    massive channel) through gate_proj and up_proj, and writes through its super weight
    (+-SUPER_WEIGHT in down_proj); the raised group gets its own layer-1 pair, reading the raised
    trigger channel, super weights times ``outlier_scale``. Each unit's gate and up weights are
    solved from the key's normed value measured on CALIBRATION_IDS (after the units below it are
    set), so that its gate is GATE_VALUE and its output the planned one. Layers the model does not
    have (the tiny stand-in has two) are left out. Returns outlier_channels()."""
    import torch

    m, cfg = model.model, model.config
    where = outlier_channels(cfg.hidden_size, cfg.intermediate_size, seed)
    t, t_raised, neg, pos = where["trigger"], where["raised_trigger"], where["negative"], where["positive"]
    dedicated = [t, t_raised, neg, pos]
    silu_gate = GATE_VALUE / (1.0 + math.exp(-GATE_VALUE))

    def set_unit(mlp, unit, key, normed, channel, target, scale):
        up = abs(target) / (silu_gate * SUPER_WEIGHT)  # silu(gate) * up * SUPER_WEIGHT = |target|
        for proj, value in ((mlp.gate_proj, GATE_VALUE), (mlp.up_proj, up)):
            proj.weight[unit] = 0.0
            proj.weight[unit, key] = value / normed
        mlp.down_proj.weight[:, unit] = 0.0
        mlp.down_proj.weight[channel, unit] = math.copysign(SUPER_WEIGHT * scale, target)

    with torch.no_grad():
        emb = m.embed_tokens.weight
        emb[:, dedicated] = 0.0
        emb[list(PUBLISHED_TRIGGERS), t] = TRIGGER_VALUE
        emb[list(RAISED_TRIGGERS), t_raised] = RAISED_TRIGGER_VALUE
        for layer in m.layers:
            layer.self_attn.o_proj.weight[dedicated] = 0.0
            layer.mlp.down_proj.weight[dedicated] = 0.0
        m.norm.weight[[t, t_raised]] = 0.0
        first = True
        for layer_idx, out_neg, out_pos in MASSIVE_MLP_OUTPUTS:
            if layer_idx >= len(m.layers):
                continue
            mlp = m.layers[layer_idx].mlp
            key = t if first else neg
            normed = _normed_on_triggers(model, layer_idx, key, PUBLISHED_TRIGGERS)
            if first:
                raised_normed = _normed_on_triggers(model, layer_idx, t_raised, RAISED_TRIGGERS)
            for unit, channel, target in zip(where["units"][layer_idx], (neg, pos), (out_neg, out_pos)):
                set_unit(mlp, unit, key, normed, channel, target, 1.0)
            if first:
                for unit, channel, target in zip(where["raised_units"], (neg, pos), (out_neg, out_pos)):
                    set_unit(mlp, unit, t_raised, raised_normed, channel, target, outlier_scale)
            first = False
    return where


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--tokenizer", default=None, help="path to a real Qwen2.5 tokenizer dir (optional)")
    ap.add_argument("--profile", choices=PROFILES, default="default",
                    help="default: seeded random weights; outliers: plus the real model's fp16 extremes")
    ap.add_argument("--outlier-scale", type=float, default=DEFAULT_OUTLIER_SCALE,
                    help=f"with --profile outliers: the raised trigger's massive values times this (default "
                    f"{DEFAULT_OUTLIER_SCALE:g}: past fp16's range, so stock's forward overflows; 1: the "
                    "published ones)")
    args = ap.parse_args(argv)
    if args.outlier_scale <= 0 or not math.isfinite(args.outlier_scale):
        ap.error(f"--outlier-scale must be a positive number, got {args.outlier_scale}")
    print(write_standin(args.out, args.size, args.seed, args.tokenizer, args.profile, args.outlier_scale))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
