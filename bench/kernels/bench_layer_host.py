"""GPU benchmark of the host (CPU) time of whole decoder layers, stock vs ours: where a host-bound
training step spends its Python time, one level below bench/host_split.py.

    python bench/kernels/bench_layer_host.py --out layer_host.json

The workload's stack at full width (hidden 1536, MLP 8960, 12/2 heads) with LAYERS decoder layers:
bnb NF4 double-quant weights, prepare_model_for_kbit_training, peft LoRA r=16 on q/v with dropout
0.05, fp16 autocast, a right-padded batch of 4 rows (lengths 300/120/512/80, ~1,000 real tokens,
the workload's mean). Variants, in the same process: stock; ours with each layer as one node
(the default), both eager (CUDA graphs off: this measures the eager step):
- wall ms of forward + loss + backward (the GPU work of 4 layers is ~1 ms, so the wall time is the
  host's) with LAYERS and with 2 * LAYERS layers, both models built first and their steps timed back
  to back, REPS times: the median of the paired differences over LAYERS is the host time of one
  decoder layer, forward + backward, without the embedding and LM head (two medians taken minutes
  apart carry the host's drift: 4.6 to 8.0 ms for stock's layer);
- then (the node only) a cProfile of 10 steps: the functions with the most own time, to show which
  Python code the per-layer time is made of (cProfile inflates Python-heavy code ~3x: read the
  ranking, not the absolute figures).
"""
from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from bench.kernels._common import bench_args  # noqa: E402

LAYERS = 4
REPS = 31  # pairs of steps (LAYERS and 2 * LAYERS layers), timed back to back
LENGTHS = (300, 120, 512, 80)
SEQLEN = 512


def build(model_dir: str, layers: int):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Qwen2Config, Qwen2ForCausalLM

    from workload.model_standin import standin_config

    path = os.path.join(model_dir, f"l{layers}")
    if not os.path.exists(os.path.join(path, "config.json")):
        cfg = {k: v for k, v in standin_config("full").items() if k not in ("architectures", "model_type", "torch_dtype")}
        cfg.update(num_hidden_layers=layers, max_window_layers=layers)
        torch.manual_seed(0)
        with torch.device("cuda"):
            m = Qwen2ForCausalLM(Qwen2Config(**cfg)).to(torch.bfloat16)
        m.save_pretrained(path)
        del m
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=torch.float16)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=q, dtype=torch.float16, device_map={"": 0})
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, task_type="CAUSAL_LM",
                                             target_modules=["q_proj", "v_proj"]))
    model.train()
    return model


def batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 1000, (len(LENGTHS), SEQLEN), generator=g)
    mask = torch.zeros(len(LENGTHS), SEQLEN, dtype=torch.long)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return ids.cuda(), mask.cuda(), labels.cuda()


def step_fn(model, ids, mask, labels):
    from solution.patches.qwen2_lm_head_loss import fused_lm_head_requested

    def step():
        with torch.autocast("cuda", dtype=torch.float16), fused_lm_head_requested():
            out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
        out.loss.backward()
        model.zero_grad(set_to_none=True)
    return step


def _timed_ms(step) -> float:
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def paired_ms(short, long, reps: int = REPS) -> tuple[float, float, float]:
    """Median wall ms of the ``short`` and the ``long`` model's step, and the median of their
    differences, the two steps timed back to back in each repetition (the host's speed drifts over
    seconds on the lent machine: a difference of two medians taken apart in time carried it)."""
    for _ in range(3):
        short(), long()
    torch.cuda.synchronize()
    a, b, d = [], [], []
    for _ in range(reps):
        ta, tb = _timed_ms(short), _timed_ms(long)
        a.append(ta)
        b.append(tb)
        d.append(tb - ta)
    return statistics.median(a), statistics.median(b), statistics.median(d)


def setup(doc: str):
    """What a layer bench starts with: its command line (``bench_args``: None without CUDA), the
    T4's code paths, the batch. Returns (args, (ids, mask, labels)) or None."""
    args = bench_args(doc)
    if args is None:
        return None
    from bench.run_one import emulate_t4_paths

    emulate_t4_paths()
    return args, batch()


def main() -> None:
    ready = setup(__doc__)
    if ready is None:
        return
    args, (ids, mask, labels) = ready
    import solution

    rows, profile_text = {}, ""
    from solution.settings import Settings

    variants = {"stock": None, "node": Settings(cuda_graphs="0")}
    with tempfile.TemporaryDirectory() as tmp:
        for variant, settings in variants.items():
            solution.revert()
            if settings is not None:
                solution.apply(verbose=False, settings=settings)
            models = {layers: build(tmp, layers) for layers in (LAYERS, 2 * LAYERS)}
            steps = {layers: step_fn(m, ids, mask, labels) for layers, m in models.items()}
            short_ms, long_ms, diff_ms = paired_ms(steps[LAYERS], steps[2 * LAYERS])
            if variant == "node":
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(10):
                    steps[LAYERS]()
                torch.cuda.synchronize()
                prof.disable()
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(35)
                profile_text = buf.getvalue()
            del models, steps
            torch.cuda.empty_cache()
            rows[variant] = {"step_ms": {LAYERS: short_ms, 2 * LAYERS: long_ms}, "per_layer_ms": diff_ms / LAYERS}
        solution.revert()
    print(f"| variant | step ms, {LAYERS} layers | step ms, {2 * LAYERS} layers | host ms per layer (fwd+bwd) |")
    print("| --- | ---: | ---: | ---: |")
    for v, r in rows.items():
        print(f"| {v} | {r['step_ms'][LAYERS]:.2f} | {r['step_ms'][2 * LAYERS]:.2f} | {r['per_layer_ms']:.3f} |")
    print("\ncProfile of the node, 10 steps, by own time:\n" + "\n".join(profile_text.splitlines()[:60]))
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "rows": rows, "lengths": LENGTHS,
                   "profile": profile_text}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
