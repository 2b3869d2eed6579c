"""Repeated timed pairs: ``bench.compare --repeat N``.

Why: on the lent machine the host's speed moves between the passes of one call (the baseline's
steps 3-64 on the same data and code took 10.4 to 17.0 s in one call), and both variants' steps
are host-bound there, so one baseline / solution pair gives a ratio good to about +-15%. With
``--repeat N`` each run's timed pass runs N times per variant, interleaved (baseline, solution,
baseline, solution, ...), so that each pair's two passes run close together in time.

What the report takes: the pair whose steps 3-N ratio is the median of the N (the lower middle one
for an even N) stands for the run, in every figure of the report (its timed passes, as a single
pair's would); the report lists every pair with its ratios and their spread, and says which one
was taken. bench.compare and bench.rebuild_report choose with this module, so a rebuilt report
takes the same pair. Passes: the first pair's folders are the run's usual ``baseline`` and
``solution``; pair i > 1 writes ``baseline-timed-i`` and ``solution-timed-i``.
"""
from __future__ import annotations

import statistics

from bench.report import soup_duration
from bench.runs import timed_mode

MAX_REPEAT = 5


def folder(variant: str, i: int) -> str:
    """A variant's folder of its i-th timed pass (bench.compare.run_variant's naming)."""
    return variant if i == 1 else f"{variant}-{timed_mode(i)}"


def _ratio(b, s):
    return s / b if b and s is not None else None


def choose(pairs: list[tuple[dict, dict]]) -> dict:
    """The pairs' figures and the chosen one: {"pairs": [{"pair", "baseline_steps_s",
    "solution_steps_s", "steps_ratio", "baseline_soup_s", "solution_soup_s", "soup_ratio"}],
    "chosen": the 1-based pair with the median steps ratio (lower middle for an even count; the
    first pair when no pair has both timings), "steps_ratio_median", "steps_ratio_min",
    "steps_ratio_max", "soup_ratio_min", "soup_ratio_max"}."""
    rows = []
    for i, (b, s) in enumerate(pairs, 1):
        bs, ss = b.get("train_excl_first2_s"), s.get("train_excl_first2_s")
        bd, sd = soup_duration(b), soup_duration(s)
        rows.append({"pair": i, "baseline_steps_s": bs, "solution_steps_s": ss, "steps_ratio": _ratio(bs, ss),
                     "baseline_soup_s": bd, "solution_soup_s": sd, "soup_ratio": _ratio(bd, sd)})
    timed = sorted((r for r in rows if r["steps_ratio"] is not None), key=lambda r: r["steps_ratio"])
    out = {"pairs": rows, "chosen": timed[(len(timed) - 1) // 2]["pair"] if timed else 1}
    steps = [r["steps_ratio"] for r in timed]
    soup = [r["soup_ratio"] for r in rows if r["soup_ratio"] is not None]
    out.update({"steps_ratio_median": statistics.median(steps) if steps else None,
                "steps_ratio_min": min(steps, default=None), "steps_ratio_max": max(steps, default=None),
                "soup_ratio_min": min(soup, default=None), "soup_ratio_max": max(soup, default=None)})
    return out


def apply_choice(passes: dict, variants=("baseline", "solution")) -> dict | None:
    """Where ``passes`` ({folder name: result}) holds repeated pairs: choose (above), put the
    chosen pair's results under the variants' own names (the run's timed passes from then on) and
    return the choice; None where the run has one pair. Pairs are counted from 2 up while both
    variants' folders of that pair have a result."""
    pairs = [(passes[variants[0]], passes[variants[1]])]
    i = 2
    while all(folder(v, i) in passes for v in variants):
        pairs.append((passes[folder(variants[0], i)], passes[folder(variants[1], i)]))
        i += 1
    if len(pairs) == 1:
        return None
    choice = choose(pairs)
    b, s = pairs[choice["chosen"] - 1]
    passes[variants[0]], passes[variants[1]] = b, s
    return choice
