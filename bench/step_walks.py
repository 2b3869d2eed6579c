"""Host time of the per-step walk over the decoder layers' modules (solution/step/cuda_graphs.py:
``_scan``), against the two walks with torch's generators it replaced. CPU only: this is Python
work on the host, the same on any machine up to the CPU's speed; no GPU is used.

    python -m bench.step_walks [--layers 28] [--reps 300]

Every step with CUDA graphs, the runner asks three things of the layers before a replay: any hook
(it would run only at capture), the active LoRA dropouts (the masks a forward takes), and the
trainable parameters (the graphs' gradient outputs). Before: ``layer.modules()`` for the first two
and ``layer.parameters()`` for the third (named_modules builds a prefix string for every module and
parameter). Now: one walk over the modules' own dicts. The model: the workload's stack (tiny width:
the module and parameter counts of each layer are the full model's) with ``--layers`` decoder
layers, bnb NF4 on the CPU, peft LoRA on q/v with dropout 0.05. Prints the median microseconds of
each, per step, and checks that both find the same hooks, dropouts and parameters.

Then the Trainer's own per-step walks over the whole peft model (solution/patches/
peft_model_walks.py): ``model.train()``, ``model.zero_grad()`` (after gradients were set on the
trainable parameters) and ``list(model.parameters())`` (what ``clip_grad_norm_`` gets), torch's
against the patch's, with a check that both give the same parameters; and the Trainer's clip
(``Trainer._clip_grad_norm``), stock against solution/patches/trainer_clip.py.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def _model(layers: int, tmp: str):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Qwen2Config, Qwen2ForCausalLM

    from workload.model_standin import standin_config

    cfg = {k: v for k, v in standin_config("tiny").items() if k not in ("architectures", "model_type", "torch_dtype")}
    cfg.update(num_hidden_layers=layers, max_window_layers=layers)
    cfg.pop("layer_types", None)
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**cfg)).to(torch.bfloat16).save_pretrained(tmp)
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=torch.float16)
    model = AutoModelForCausalLM.from_pretrained(tmp, quantization_config=q, dtype=torch.float16, device_map={"": "cpu"})
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, task_type="CAUSAL_LM",
                                             target_modules=["q_proj", "v_proj"]))
    return model.train()


def generator_walks(layers):
    """The walks ``_scan`` replaced: hooks and LoRA dropouts over ``modules()``, then ``parameters()``."""
    from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit

    from solution.hooks import global_hooks, own_hooks

    hooked, dropouts = global_hooks(), 0
    for layer in layers:
        for m in layer.modules():
            if not hooked and own_hooks(m):
                hooked = True
            if isinstance(m, LoraLinear4bit):
                dropouts += sum(1 for d in m.lora_dropout.modules()
                                if isinstance(d, torch.nn.Dropout) and d.training and d.p > 0)
    params = [p for layer in layers for p in layer.parameters() if p.requires_grad]
    return hooked, dropouts, params


def _median_us(fn, reps: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.step_walks", description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--reps", type=int, default=300)
    args = ap.parse_args(argv)
    from solution.step.cuda_graphs import _scan

    with tempfile.TemporaryDirectory() as tmp:
        model = _model(args.layers, tmp)
    layers = model.base_model.model.model.layers
    hooked, dropouts, params = generator_walks(layers)
    scan = _scan(layers)
    same = (scan.hooked, scan.dropouts) == (hooked, dropouts) and len(scan.params) == len(params) \
        and all(a is b for a, b in zip(scan.params, params))
    n_modules = sum(1 for layer in layers for _ in layer.modules())
    before = _median_us(lambda: generator_walks(layers), args.reps)
    after = _median_us(lambda: _scan(layers), args.reps)
    print(f"{args.layers} layers, {n_modules} modules, {len(params)} trainable parameters, {dropouts} active LoRA "
          f"dropouts; same answers: {'yes' if same else 'NO'}")
    print("| walk | host us a step (median) |\n| --- | ---: |")
    print(f"| modules() + parameters() (before) | {before:.0f} |\n| `_scan`, one walk (now) | {after:.0f} |")
    print(f"ratio {after / before:.2f}")
    walks_same = trainer_walks(model, args.reps)
    return 0 if same and walks_same and trainer_clip(model, args.reps) else 1


def trainer_walks(model, reps: int) -> bool:
    """The table of the Trainer's walks, stock against patches/peft_model_walks.py."""
    from solution.patches import peft_model_walks
    from solution.patches._base import Swaps

    trainable = [p for p in model.parameters() if p.requires_grad]

    def zero_grad():
        for p in trainable:
            p.grad = p.data
        model.zero_grad()

    calls = {"model.train()": lambda: model.train(), "model.zero_grad() (grads set first)": zero_grad,
             "list(model.parameters())": lambda: list(model.parameters())}
    stock = {k: _median_us(f, reps) for k, f in calls.items()}
    stock_params = list(model.parameters())
    swaps = Swaps()
    peft_model_walks.install(swaps)
    try:
        ours = {k: _median_us(f, reps) for k, f in calls.items()}
        ours_params = list(model.parameters())
    finally:
        swaps.restore()
    same = len(ours_params) == len(stock_params) and all(a is b for a, b in zip(ours_params, stock_params))
    print(f"\nthe Trainer's walks over the whole model (same parameters: {'yes' if same else 'NO'})")
    print("| call | torch, host us | patched, host us |\n| --- | ---: | ---: |")
    for k in calls:
        print(f"| {k} | {stock[k]:.0f} | {ours[k]:.0f} |")
    print(f"| all three | {sum(stock.values()):.0f} | {sum(ours.values()):.0f} |")
    return same


def trainer_clip(model, reps: int) -> bool:
    """The Trainer's clip (``Trainer._clip_grad_norm``, one process, accelerate on the CPU, no fp16
    scaler here), stock against patches/trainer_clip.py, with peft_model_walks installed under both
    (as in training); max_grad_norm large, so the gradients keep their values between calls."""
    from types import SimpleNamespace

    import transformers
    from accelerate import Accelerator

    from solution.patches import peft_model_walks, trainer_clip as clip_patch
    from solution.patches._base import Swaps

    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p)
    trainer = SimpleNamespace(accelerator=Accelerator(cpu=True), args=SimpleNamespace(max_grad_norm=1e9, fp16=False),
                              _has_mixed_mesh_grads=lambda m: False)
    stock = transformers.Trainer._clip_grad_norm
    ours = clip_patch._make_clip_grad_norm(stock)
    swaps = Swaps()
    peft_model_walks.install(swaps)
    try:
        norms = stock(trainer, model), ours(trainer, model)
        t_stock = _median_us(lambda: stock(trainer, model), reps)
        t_ours = _median_us(lambda: ours(trainer, model), reps)
    finally:
        swaps.restore()
    same = torch.equal(*norms)
    print(f"\nthe Trainer's clip, Trainer._clip_grad_norm (same norm: {'yes' if same else 'NO'})")
    print("| call | stock, host us | patched, host us |\n| --- | ---: | ---: |")
    print(f"| clip (unscale, norm, clip) | {t_stock:.0f} | {t_ours:.0f} |")
    return same


if __name__ == "__main__":
    raise SystemExit(main())
