"""Paired on / off timings of one process (bench/kernels/bench_node_sections.py): the order of
each pair and what the pairs say.

A host's speed drifts within a call (by tens of percent on the lent machine), so two settings are
compared in alternating pairs, not in two blocks. ``order`` alternates which arm goes first
(on-off, off-on, ...): a drift that is linear over a pair then adds to the "on" arm in half of the
pairs and to the "off" arm in the other half, instead of always to the second one. ``summary``
gives, beside the medians of the arms and of the pairs' differences, the spread of those
differences (their quartiles) and how many pairs had the "on" arm faster: a median difference
whose quartiles straddle zero, or with about half of the pairs either way, is noise, not a saving.
"""
from __future__ import annotations

import statistics


def order(i: int) -> tuple[bool, bool]:
    """The arms of pair ``i`` in the order they run: (True, False) for even i, else (False, True)."""
    return (True, False) if i % 2 == 0 else (False, True)


def summary(on_ms: list[float], off_ms: list[float]) -> dict:
    """What ``len(on_ms)`` pairs say (on_ms[i] and off_ms[i] from pair i): the medians of the two
    arms (``on``, ``off``), the median of the differences on - off (``diff``), their first and third
    quartiles (``q1``, ``q3``; the median of each half where fewer than 4 pairs) and the number of
    pairs in which the on arm was faster (``on_faster``), with ``n`` the number of pairs.
    ValueError when the lists are empty or of different lengths."""
    if not on_ms or len(on_ms) != len(off_ms):
        raise ValueError(f"pairs: {len(on_ms)} on and {len(off_ms)} off timings (expected the same number, > 0)")
    diffs = [a - b for a, b in zip(on_ms, off_ms)]
    if len(diffs) >= 4:
        q1, _, q3 = statistics.quantiles(diffs, n=4)
    else:
        ds = sorted(diffs)
        half = len(ds) // 2
        q1 = statistics.median(ds[:half] or ds)
        q3 = statistics.median(ds[len(ds) - half:] or ds)
    return {"on": statistics.median(on_ms), "off": statistics.median(off_ms), "diff": statistics.median(diffs),
            "q1": q1, "q3": q3, "on_faster": sum(d < 0 for d in diffs), "n": len(diffs)}


def verdict(s: dict) -> str:
    """One phrase for ``summary``'s result: "on faster" / "on slower" where the quartiles of the
    differences are both below / above zero, else "no difference shown"."""
    if s["q3"] < 0:
        return "on faster"
    if s["q1"] > 0:
        return "on slower"
    return "no difference shown"


def whole_run_table(doc: dict) -> str:
    """A markdown table of whole-run pairs (docs/runs/levers-*.json: ``runs`` label -> figures,
    ``comparisons`` each with the ``off`` and ``default`` labels pair by pair): per comparison the
    arms' medians of steps 3-64, the median of the pairs' differences (off - default) in seconds and
    percent of the default's median, the quartiles, how many pairs had the off arm faster, the verdict
    and the decision taken."""
    rows = ["| option | where | pairs | default, median (s) | off, median (s) | off - default, median of pairs | "
            "quartiles (s) | off faster | verdict | decision |",
            "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | --- | --- |"]
    for c in doc["comparisons"]:
        off = [doc["runs"][label]["steps_3_64_s"] for label in c["off"]]
        default = [doc["runs"][label]["steps_3_64_s"] for label in c["default"]]
        s = summary(off, default)
        said = {"on faster": "off faster", "on slower": "off slower"}.get(verdict(s), verdict(s))
        rows.append(f"| {c['name']} | {c['where']} | {s['n']} | {s['off']:.2f} | {s['on']:.2f} | "
                    f"{s['diff']:+.3f} s ({100 * s['diff'] / s['off']:+.1f}%) | {s['q1']:+.3f} .. {s['q3']:+.3f} | "
                    f"{s['on_faster']} of {s['n']} | {said} | {c['decision']} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """python -m bench.pairs docs/runs/levers-....json: print ``whole_run_table`` of that file."""
    import json
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m bench.pairs LEVERS.json", file=sys.stderr)
        return 2
    with open(args[0], encoding="utf-8") as f:
        doc = json.load(f)
    print(whole_run_table(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
