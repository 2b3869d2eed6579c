"""The training run's row lengths, and the CUDA-graph buckets its batches are likely to need (docs/cuda_graphs.md,
3b). A bucket first captured inside the timed steps costs about one eager pass; the Trainer's dataset and
arguments give the distribution of the batches, so ``predicted_buckets`` simulates the sampler's permutations
(its own ``random.Random``: the run's generators are never touched) and names the buckets more than P_MIN of the
simulated runs meet (capturing ahead costs one capture outside the timed steps; leaving it, one inside with its
probability). cuda_graphs.py captures those in the step that turns graphs on. ``note`` is called by
patches/trainer_lengths.py when ``Trainer.train`` starts; it only reads.
"""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class LengthProfile:
    """Row lengths (tokens, after truncation), rows per batch, optimizer steps of the run."""
    lengths: tuple[int, ...]
    batch: int
    steps: int


_PROFILE: LengthProfile | None = None
MAX_ROWS = 200_000  # a larger dataset is not read (reading its lengths would cost start-up time)


def note(lengths, batch: int, steps: int, max_length: int | None = None) -> LengthProfile | None:
    """Record this run's profile (the last call wins); None (nothing recorded) when the figures are unusable."""
    global _PROFILE
    lengths = [int(n) for n in lengths]
    if not lengths or len(lengths) > MAX_ROWS or batch < 1 or steps < 1 or min(lengths) < 0:
        return None
    if max_length:
        lengths = [min(n, int(max_length)) for n in lengths]
    _PROFILE = LengthProfile(tuple(lengths), int(batch), int(steps))
    return _PROFILE


def profile() -> LengthProfile | None:
    return _PROFILE


def clear() -> None:
    global _PROFILE
    _PROFILE = None


P_MIN = 0.25


def predicted_buckets(prof: LengthProfile, bucket_of, p_min: float = P_MIN, runs: int = 200,
                      seed: int = 0) -> list[int]:
    """The buckets (``bucket_of(tokens in a batch)``) more than ``p_min`` of ``runs`` simulated runs meet, each
    run taking the rows in random order, epoch after epoch, ``prof.batch`` at a time (last batch of an epoch
    possibly shorter), for ``prof.steps`` batches. Sorted ascending. Pure."""
    rng = random.Random(seed)
    n_rows, b = len(prof.lengths), prof.batch
    seen: dict[int, int] = {}
    for _ in range(runs):
        buckets: set[int] = set()
        steps = 0
        while steps < prof.steps:
            order = list(range(n_rows))
            rng.shuffle(order)
            for start in range(0, n_rows, b):
                if steps >= prof.steps:
                    break
                buckets.add(bucket_of(sum(prof.lengths[i] for i in order[start:start + b])))
                steps += 1
        for k in buckets:
            seen[k] = seen.get(k, 0) + 1
    return sorted(k for k, c in seen.items() if c > p_min * runs)
