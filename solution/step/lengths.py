"""The training run's row lengths, and the CUDA-graph buckets its batches are likely to need.

Why: a CUDA-graph bucket captured on first sight inside the timed steps costs about one eager
pass of the layers on the host (docs/cuda_graphs.md). The buckets a run will need are not known
before its batches come, but their distribution is: the Trainer's tokenized dataset holds every
row's length, the batch size and the step count are in its arguments, and the sampler draws each
epoch as a random permutation of the rows. ``bucket_uses`` simulates such permutations with its
own seeded generator (``random.Random``: the global torch / Python / NumPy generators are never
touched, so the run's batch order and dropout are unchanged) and gives how many batches of the
run each bucket is expected to hold. A capture pays only where the bucket is used often enough
(``MIN_USES``, measured): cuda_graphs.py captures those buckets ahead, in the step that turns
graphs on (step 2: outside steps 3-64, inside Soup's duration, which counts every capture), and
runs a batch of a rarer bucket eagerly instead of capturing it; a bucket the profile does not
name (or any bucket, without a profile) is captured when it first comes.

``note`` is called by patches/trainer_lengths.py when ``Trainer.train`` starts; it only reads.
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
    """Record this run's profile (the last call wins); None (and nothing recorded) when the
    figures are not usable."""
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


# A bucket is worth a capture when the run is expected to use it at least MIN_USES times: a capture
# costs about one eager pass of the layers plus the graphs' instantiation, each use saves one eager
# pass minus a replay. Measured on the H200 (shipped run of 90905ac, docs/runs/latest.json of
# 2026-12-02): the 1792-token bucket's capture ahead took 0.18 s, a replayed step saved 0.115 s
# against the eager step (61 against 176 ms): 1.57 uses to break even.
MIN_USES = 1.6


def bucket_uses(prof: LengthProfile, bucket_of, runs: int = 200, seed: int = 0) -> dict[int, float]:
    """How many of the run's batches fall in each bucket (``bucket_of(tokens in a batch)``), the mean
    over ``runs`` simulated runs: each run takes the rows in a random order, epoch after epoch,
    ``prof.batch`` at a time (the last batch of an epoch may be shorter, as a DataLoader without
    drop_last gives it), for ``prof.steps`` batches. Pure: its own generator, nothing global."""
    rng = random.Random(seed)
    n_rows, b = len(prof.lengths), prof.batch
    seen: dict[int, int] = {}
    for _ in range(runs):
        steps = 0
        while steps < prof.steps:
            order = list(range(n_rows))
            rng.shuffle(order)
            for start in range(0, n_rows, b):
                if steps >= prof.steps:
                    break
                k = bucket_of(sum(prof.lengths[i] for i in order[start:start + b]))
                seen[k] = seen.get(k, 0) + 1
                steps += 1
    return {k: c / runs for k, c in sorted(seen.items())}


def worth_a_capture(uses: dict[int, float], bucket: int) -> bool:
    """The run is expected to use ``bucket`` at least MIN_USES times (``uses``: ``bucket_uses``)."""
    return uses.get(bucket, 0.0) >= MIN_USES


def predicted_buckets(uses: dict[int, float]) -> list[int]:
    """The buckets of ``bucket_uses`` worth a capture ahead (``worth_a_capture``), ascending."""
    return sorted(k for k in uses if worth_a_capture(uses, k))
