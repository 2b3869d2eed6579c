"""Achieved bandwidth of each kernel in a profiled training pass (the table in docs/PERFORMANCE.md,
"each kernel's achieved bandwidth, from the training profile").

The per-op benchmarks (bench/kernels/) time one call from Python, and at the workload's sizes
most of them time the host's launches, not the GPU (their "host ms" column says so). This table
takes the GPU time of each kernel from the training profile itself (bench/run_one.py --profile:
``profile.kernel_times_s``, steps 3-64, every call of the step) and divides the bytes that kernel
must move in one step by it. The bytes are a model of the workload, stated per kernel below
(``BYTE_MODEL``): Qwen2.5-1.5B's shapes, 28 layers, T = the mean token count the layers run on
(with CUDA graphs: the bucket, filler included), R = the mean real token count (the LM head's
rows), R_lab = the rows with a label. Times are measured; bytes and rates are computed.

    python -m bench.kernel_rates RESULT_JSON [--copy-gbs 4178 | --measure-copy]

RESULT_JSON: a profiled run's result.json (the solution-profiled folder of a compare). The copy
bandwidth is bench_nf4's device copy (512 MiB) on the same GPU: 4178 GB/s on the H200, or
measured here with --measure-copy (bench_nf4's own copy, on this machine's GPU: on a T4, run it
there; scripts/t4_run.sh does). Transfers of a few MB per call do
not reach it (bench_nf4's same-size copies on the H200: 1.0 MB in ~4.5 us, 5.9 MB in ~8.5 us, 34.6 MB
in ~16 us; docs/PERFORMANCE.md, NF4 dequantization against a copy of the same bytes): compare a
kernel's us per call with a copy of its MB per call.
"""
from __future__ import annotations

import argparse
import json
import sys

LAYERS, H, I, KV, V, R_ = 28, 1536, 8960, 256, 151936, 16  # R_: the LoRA rank
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 2  # packed codes, one u8 absmax per 64, the fp16 output


def _w(params: float) -> float:
    return params * NF4_BYTES_PER_PARAM


Q, KVW, MLP = H * H, KV * H, H * I  # weight sizes (q_proj = o_proj, k_proj = v_proj, gate/up/down)

# kernel -> (calls a step: the model's structure, as bench.op_origins counts them; None: not
# fixed (the LM head's chunks), bytes moved in one step as a function of (T, R, R_lab), what the
# model counts)
BYTE_MODEL = {
    "nf4_dequant_kernel": (7 * LAYERS,
        lambda t, r, rl: LAYERS * (5 * _w(MLP) + 2 * _w(Q)),
        "per layer: up/down forward, gate/up/down backward, o_proj forward and backward (fp16 input and "
        "gradient: nothing to cast): 7 weights"),
    "nf4_dequant_cast_kernel": (7 * LAYERS,
        lambda t, r, rl: LAYERS * (2 * _w(Q) + 4 * _w(KVW) + _w(MLP) + 38 * t * H + 14 * t * KV),
        "per layer: q/k/v forward and backward, gate forward (7 weights) + the fp16 casts in the same "
        "launches: x (fp32 -> fp16) for q, k, v and gate, dropout(x) for q and v (mask read), the fp32 "
        "gradients of q, k, v (and the scaled copy for q, v): 38 bytes per [T, H] element, 14 per [T, KV]"),
    "pair_cast_kernel": (4 * LAYERS,
        lambda t, r, rl: LAYERS * 2 * 6 * (2 * R_ * H + R_ * H + R_ * KV),
        "q and v: A and B to fp16 (forward), their gradients back to fp32 (backward): 6 bytes an element"),
    "_swiglu_fwd_kernel": (LAYERS, lambda t, r, rl: LAYERS * 6 * t * I, "read gate, up (fp16), write h (fp16)"),
    "_swiglu_bwd_kernel": (LAYERS, lambda t, r, rl: LAYERS * 10 * t * I, "read gate, up, dh; write dgate, dup (fp16)"),
    "_lm_head_ce_rows_kernel": (None, 
        lambda t, r, rl: 2 * V * (2 * r + rl),
        "fp16 logits: one read of every row, a second read of the labelled rows, one write (the gradient)"),
    "fp32_add_kernel": (2 * LAYERS, lambda t, r, rl: 2 * LAYERS * 12 * t * H, "2 a layer: two fp32 [T, H] in, one out"),
    "_add_rmsnorm_fwd_kernel": (LAYERS, lambda t, r, rl: LAYERS * 16 * t * H, "residual, x in; h, y out (fp32)"),
    "_add_rmsnorm_bwd_kernel": (LAYERS, lambda t, r, rl: LAYERS * 16 * t * H, "dy, h, the residual's gradient in; dh out"),
    "_rmsnorm_fwd_kernel": (LAYERS, lambda t, r, rl: LAYERS * 8 * t * H, "x in, y out (fp32); each layer's input norm"),
    "_rmsnorm_bwd_dx_kernel": (LAYERS, lambda t, r, rl: LAYERS * 12 * t * H, "dy, x in; dx out"),
}


def rows(result: dict, copy_gbs: float) -> list[dict]:
    """One row per modelled kernel that ran: GPU ms a step, bytes a step, GB/s, % of the copy."""
    prof = result.get("profile") or {}
    times = prof.get("kernel_times_s") or {}
    steps = max(len(result.get("step_times_s") or []) - 2, 1)
    t, r, rl = token_counts(result)
    out = []
    for name, (calls, model, what) in BYTE_MODEL.items():
        if name not in times:
            continue
        ms = times[name] / steps * 1e3
        nbytes = model(t, r, rl)
        gbs = nbytes / (ms / 1e3) / 1e9 if ms > 0 else float("nan")
        out.append({"kernel": name, "gpu_ms_per_step": ms, "mb_per_step": nbytes / 1e6, "gb_s": gbs,
                    "pct_of_copy": 100 * gbs / copy_gbs, "calls": calls,
                    "mb_per_call": nbytes / 1e6 / calls if calls else None,
                    "us_per_call": ms * 1e3 / calls if calls else None, "model": what})
    return sorted(out, key=lambda x: -x["gpu_ms_per_step"])


def token_counts(result: dict) -> tuple[float, float, float]:
    """(T, R, R_lab) per step over steps 3-N: T the layers' tokens, R the real tokens (trl's
    num_tokens), R_lab = R x the labelled fraction (result["labelled_fraction"], default 0.64:
    Soup's response-only labels on the shipped data). With CUDA graphs a step of n real tokens ran
    in the smallest bucket the run captured above n (a bucket always holds a filler token), read
    from the run's own captures; a step with none ran eagerly, on its n tokens."""
    nt = [lg["num_tokens"] for lg in result.get("trainer_logs") or [] if "num_tokens" in lg]
    per_step = [b - a for a, b in zip([0.0] + nt[:-1], nt)][2:]
    if not per_step:
        return 0.0, 0.0, 0.0
    buckets = sorted(c["tokens"] for c in (result.get("cuda_graphs") or {}).get("captures") or [])
    layer_tokens = [next((b for b in buckets if b > n), n) for n in per_step]
    r = sum(per_step) / len(per_step)
    return sum(layer_tokens) / len(per_step), r, r * float(result.get("labelled_fraction", 0.64))


def markdown(table: list[dict], copy_gbs: float, tokens: tuple[float, float, float]) -> str:
    t, r, rl = tokens
    lines = [f"T = {t:.0f} layer tokens a step, R = {r:.0f} real tokens, R_lab = {rl:.0f}; copy "
             f"bandwidth {copy_gbs:.0f} GB/s", "",
             "| kernel | GPU ms / step | calls / step | us / call | MB / call (model) | GB/s | % of the copy | bytes counted |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for x in table:
        per = (f"{x['calls']} | {x['us_per_call']:.1f} | {x['mb_per_call']:.1f}" if x["calls"]
               else f"{x['mb_per_step']:.0f} MB a step in a few chunks | | ")
        lines.append(f"| `{x['kernel']}` | {x['gpu_ms_per_step']:.3f} | {per} | {x['gb_s']:.0f} | "
                     f"{x['pct_of_copy']:.0f}% | {x['model']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.kernel_rates", description=__doc__.splitlines()[0])
    ap.add_argument("result")
    ap.add_argument("--copy-gbs", type=float, default=4178.0, help="device copy bandwidth (bench_nf4, H200: 4178)")
    ap.add_argument("--measure-copy", action="store_true",
                    help="measure the copy bandwidth on this machine's GPU (bench_nf4's 512 MiB copy) instead")
    args = ap.parse_args(argv)
    if args.measure_copy:
        import torch

        if not torch.cuda.is_available():
            print("--measure-copy: no CUDA GPU here", file=sys.stderr)
            return 2
        from bench.kernels.bench_nf4 import copy_bandwidth_gbs

        args.copy_gbs = copy_bandwidth_gbs()
    result = json.load(open(args.result, encoding="utf-8"))
    if not (result.get("profile") or {}).get("kernel_times_s"):
        print(f"{args.result}: no profiled kernel times (run_one --profile)", file=sys.stderr)
        return 2
    print(markdown(rows(result, args.copy_gbs), args.copy_gbs, token_counts(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
