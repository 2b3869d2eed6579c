"""GPU experiment (measurement only, nothing in solution/ uses it): what CUDA graphs would save on
the host-bound step, and whether LoRA dropout stays stock's inside a graph.

    python bench/kernels/bench_layer_graph.py --out layer_graph.json

The H200 step is host-bound: ~85% of it is Python and launch work inside the decoder layers,
~6-8 ms a layer, for ~0.9 ms of GPU work a layer (docs/PERFORMANCE.md, host split). A CUDA graph
records the kernels of a forward + backward once and replays them with one host call. This
measures that on the workload's stack with every patch of ours on (bench_layer_host.build: bnb
NF4 double quant, peft LoRA r=16 on q/v with dropout 0.05, fp16 autocast), LAYERS decoder layers
at full width on the packed rows of one right-padded batch (lengths 300/120/512/80):

1. eager: wall ms of the layers' forward + backward (median of 15, synchronized);
2. capture: the same forward + backward captured in one torch.cuda.CUDAGraph (after warm-up on a
   side stream, PyTorch's whole-network capture recipe); capture time;
3. replay: wall ms of a replay (median of 15);
4. same numbers: with the CUDA generator reset to one seed before each, the eager run and a
   replay must draw the same dropout masks (PyTorch's graph-safe Philox offsets) and so give the
   same LoRA gradients, up to the attention backward's non-determinism (atomics): max relative
   difference of every LoRA gradient, and whether the layers' outputs are bit-equal.

A failure at any stage (a host sync inside capture, an op that refuses capture) is printed with
its stage and message instead of a number: that is the finding. Prediction (docs/NOTES.md):
replay ~1 ms a layer against ~8.7 ms eager.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from bench.kernels._common import bench_args  # noqa: E402
from bench.kernels.bench_layer_host import LAYERS, LENGTHS, SEQLEN, build, wall_ms  # noqa: E402


def layer_step(decoder, info, h, grad_out, position_embeddings, position_ids):
    """Forward + backward of the decoder layers on packed rows, as qwen2_unpad runs them; returns
    the last layer's output (for the bit-equality check)."""
    from solution.step import packing

    def step():
        # cache_enabled=False: the autocast weight-cast cache must not outlive a capture (PyTorch's
        # graph recipe); it changes no value, only whether a cast is recomputed
        with torch.autocast("cuda", dtype=torch.float16, cache_enabled=False), packing.running_unpadded(info):
            x = h
            for layer in decoder.layers:
                x = layer(x, attention_mask=info, position_embeddings=position_embeddings,
                          position_ids=position_ids, use_cache=False)
        x.backward(grad_out)
        return x
    return step


def main() -> None:
    args = bench_args(__doc__)
    if args is None:
        return
    import solution
    from bench.run_one import emulate_t4_paths
    from solution.step import packing

    emulate_t4_paths()
    solution.apply(verbose=False)
    out: dict = {"device": torch.cuda.get_device_name(0), "layers": LAYERS, "lengths": LENGTHS}
    stage = "build"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model = build(tmp, LAYERS)
            decoder = model.base_model.model.model
            lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
            info = packing.make_unpadded(list(LENGTHS), SEQLEN, torch.device("cuda"))
            n = info.n_tokens
            g = torch.Generator(device="cuda").manual_seed(0)
            h = torch.randn(1, n, decoder.config.hidden_size, device="cuda", generator=g)
            grad_out = torch.randn(1, n, decoder.config.hidden_size, device="cuda", generator=g) * 1e-2
            position_ids = info.positions.unsqueeze(0)
            position_embeddings = decoder.rotary_emb(h, position_ids)
            step = layer_step(decoder, info, h, grad_out, position_embeddings, position_ids)

            def eager():
                model.zero_grad(set_to_none=True)
                return step()

            stage = "eager"
            out["eager_ms"] = wall_ms(eager)  # 3 warm-up steps, then the median of 15
            torch.cuda.manual_seed(1234)
            y_eager = eager().detach().clone()
            grads_eager = {k: p.grad.detach().clone() for k, p in lora.items()}

            stage = "warm-up on a side stream"
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    eager()
            torch.cuda.current_stream().wait_stream(side)

            stage = "capture"
            model.zero_grad(set_to_none=True)  # the gradients are allocated inside the graph's pool
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.cuda.graph(graph):
                y_static = step()
            torch.cuda.synchronize()
            out["capture_ms"] = (time.perf_counter() - t0) * 1e3

            stage = "replay"
            out["replay_ms"] = wall_ms(graph.replay)

            stage = "same numbers"
            torch.cuda.manual_seed(1234)
            graph.replay()
            torch.cuda.synchronize()
            out["output_bit_equal"] = bool(torch.equal(y_static, y_eager))
            rel = {}
            for k, p in lora.items():
                ref = grads_eager[k].float()
                rel[k] = float((p.grad.float() - ref).norm() / ref.norm().clamp_min(1e-30))
            out["lora_grad_max_rel_diff"] = max(rel.values())
            out["lora_grad_rel_diff"] = rel
    except Exception as exc:  # noqa: BLE001 - the failure is the finding; report it and its stage
        out["failed_stage"] = stage
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()[-3000:]
    finally:
        solution.revert()

    print(f"| {LAYERS} decoder layers, {sum(LENGTHS)} tokens | ms |")
    print("| --- | ---: |")
    for key in ("eager_ms", "capture_ms", "replay_ms"):
        if key in out:
            print(f"| {key.replace('_ms', '')} | {out[key]:.2f} |")
    if "eager_ms" in out and "replay_ms" in out:
        print(f"\nhost time per layer: eager {out['eager_ms'] / LAYERS:.2f} ms, replay {out['replay_ms'] / LAYERS:.2f} ms")
    if "lora_grad_max_rel_diff" in out:
        print(f"replay vs eager with the same seed: outputs bit-equal {out['output_bit_equal']}, "
              f"LoRA gradients max rel diff {out['lora_grad_max_rel_diff']:.2e}")
    if "error" in out:
        print(f"FAILED at stage '{out['failed_stage']}': {out['error']}\n{out['traceback']}")
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
