"""Where the wall time of a training step goes, phase by phase (diagnosis pass only).

On a fast GPU the step is host-bound: the Python side (Trainer, autograd, our launches) takes
longer than the GPU work it queues, so the wall time of each phase is close to its host time.
This wraps a few methods of the one Trainer instance, and the forward of the decoder stack and
of each module class in its layers (at class level), with perf_counter timers; it never
synchronizes the device and changes no computation, but it adds a few microseconds per wrapped
call, so it runs in its own pass (`bench.run_one --host-split`), never in a timed run.

Phases (the wrapped call, in the order the Trainer makes them):
  batch        Trainer.get_batch_samples (data loader, collator, copy to the device)
  forward      Trainer.compute_loss (model forward, loss, TRL's per-step metrics)
    decoder    the decoder stack's forward inside it (28 layers)
  backward     Accelerator.backward (GradScaler scaling + autograd)
  flops        Trainer.floating_point_ops (Trainer's FLOP count for its logs)
  clip         Trainer._clip_grad_norm (unscale + grad norm + clip)
  optimizer    optimizer.step (GradScaler step, AdamW)
  zero_grad    model.zero_grad
  log          Trainer._maybe_log_save_evaluate (logging callbacks, Soup's tracker)
  module X     forward calls of each module class inside the decoder layers, timed by
               class-level wrappers that leave our patches' fused paths on (nested: a
               decoder layer's time includes its attention's, which includes its projections').
               The decoder-layer node runs a whole layer without calling its modules, so a
               step it takes counts no module calls there: see the calls.
               With gradient checkpointing (off in this workload) a recomputation in the
               backward would count here too
  other        the rest of the step (Trainer bookkeeping, the loss NaN check's device sync,
               lr_scheduler.step, callbacks, our StepClock's own sync). The scheduler is not
               wrapped: Trainer pickles its __dict__ into the checkpoint, and a wrapper there
               would break the save.
"""
from __future__ import annotations

import functools
import time
from collections import defaultdict

import torch

TRAINER_PHASES = {
    "get_batch_samples": "batch",
    "compute_loss": "forward",
    "floating_point_ops": "flops",
    "_clip_grad_norm": "clip",
    "_maybe_log_save_evaluate": "log",
}
ORDER = ["batch", "forward", "decoder", "backward", "flops", "clip", "optimizer",
         "zero_grad", "log", "other"]
NESTED = {"decoder"}  # inside another phase: not added to the step's sum
MODULE = "module "  # per-class forward time inside the decoder (nested: a layer includes its parts)


def _class_label(mod) -> str:
    """'peft Linear4bit' vs 'bitsandbytes Linear4bit': same class name, different layers."""
    cls = type(mod)
    return f"{cls.__module__.split('.')[0]} {cls.__name__}"


class HostSplit:
    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.marks: list[tuple[dict, dict]] = []  # (totals, calls) at each step end
        self._classes: dict[type, object] = {}  # class -> its own forward before wrapping (or None)

    def _timed(self, fn, phase: str):
        totals, calls = self.totals, self.calls

        @functools.wraps(fn)
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                totals[phase] += time.perf_counter() - t0
                calls[phase] += 1

        timed._host_split = True
        return timed

    def _wrap(self, obj, attr: str, phase: str):
        """Time ``obj.attr`` (an instance attribute: the Trainer's and the optimizer's methods)."""
        fn = getattr(obj, attr, None)
        if fn is None or getattr(fn, "_host_split", False):
            return
        setattr(obj, attr, self._timed(fn, phase))

    def _wrap_class_forward(self, cls: type, phase: str) -> None:
        """Time ``cls.forward`` for every instance by replacing the CLASS attribute, never an
        instance one: the decoder-layer node takes a layer only when none of its modules has an
        instance-level forward (it checks ``"forward" in module.__dict__``), so instance wrappers
        would time another path. The wrapper keeps the function it times as ``__wrapped__``
        (functools.wraps), which the node's source check unwraps."""
        fn = getattr(cls, "forward", None)
        if cls in self._classes or fn is None or fn is torch.nn.Module.forward or getattr(fn, "_host_split", False):
            return
        self._classes[cls] = cls.__dict__.get("forward")
        timed = self._timed(fn, phase)
        cls.forward = timed

    def attach(self, trainer) -> None:
        """Wrap the trainer's phases; the optimizer and model are wrapped lazily at the first
        step begin, when the Trainer has built (and accelerate has wrapped) them."""
        for attr, phase in TRAINER_PHASES.items():
            self._wrap(trainer, attr, phase)
        self._wrap(trainer.accelerator, "backward", "backward")

    def attach_late(self, trainer, model) -> None:
        if trainer.optimizer is not None:
            self._wrap(trainer.optimizer, "step", "optimizer")
        if model is not None:
            self._wrap(model, "zero_grad", "zero_grad")
            self.wrap_decoder(model)

    def wrap_decoder(self, model) -> None:
        """Time the decoder stack's forward and the forward of each module class inside its
        layers (class-level wrappers; see _wrap_class_forward)."""
        for mod in model.modules():
            if type(mod).__name__.endswith("Model") and "layers" in mod._modules:
                self._wrap_class_forward(type(mod), "decoder")
                for sub in mod.layers.modules():
                    self._wrap_class_forward(type(sub), f"{MODULE}{_class_label(sub)}")
                return

    def detach(self) -> None:
        """Put the wrapped classes' forwards back (the per-instance wrappers die with the Trainer)."""
        for cls, own in self._classes.items():
            if own is None:
                del cls.forward  # it was inherited
            else:
                cls.forward = own
        self._classes.clear()

    def mark(self) -> None:
        self.marks.append((dict(self.totals), dict(self.calls)))

    def summary(self, step_times: list[float], skip: int) -> dict:
        """Seconds per phase over steps skip+1..end (the timed window), and ms per step."""
        if len(self.marks) <= skip:
            return {}
        first_t, first_c = self.marks[skip - 1] if skip else ({}, {})
        last_t, last_c = self.marks[-1]
        n = len(self.marks) - skip
        wall = sum(step_times[skip:])
        names = [p for p in ORDER if p != "other"] + sorted(p for p in last_t if p.startswith(MODULE))
        phases = {p: last_t.get(p, 0.0) - first_t.get(p, 0.0) for p in names}
        calls = {p: last_c.get(p, 0) - first_c.get(p, 0) for p in phases}
        phases["other"] = wall - sum(v for p, v in phases.items() if p not in NESTED and not p.startswith(MODULE))
        return {"steps": n, "wall_s": wall, "phases_s": phases, "calls": calls}


def format_summary(s: dict) -> str:
    if not s:
        return "(no host split: too few steps)\n"
    n, wall = s["steps"], s["wall_s"]
    lines = [f"Host split, steps after the first two ({n} steps, {wall:.2f} s wall, "
             f"{1000 * wall / n:.1f} ms a step)", "",
             "| phase | ms a step | share of the step | calls a step |", "| --- | ---: | ---: | ---: |"]
    modules = [p for p in s["phases_s"] if p.startswith(MODULE)]
    for p in ORDER + modules:
        v = s["phases_s"].get(p, 0.0)
        name = f"  {p} (inside forward)" if p in NESTED or p in modules else p
        c = s["calls"].get(p)
        lines.append(f"| {name} | {1000 * v / n:.1f} | {100 * v / wall:.0f}% | "
                     f"{'' if c is None else f'{c / n:.0f}'} |")
    return "\n".join(lines) + "\n"
