"""One line per timed run (bench.run_one's result.json): the first two steps, steps 3-N, Soup's
duration, the decoder graphs' captures by where they fell, peak memory, and how fast the run's
host was (bench/host_probe.py). For quick
side-by-side settings runs on a GPU (``bash scripts/gpu_run.sh timed``); the comparison with its
rule checks stays bench.compare's.

    python -m bench.timed_table LABEL=DIR/result.json ...
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.report import GIB, graph_pool_gib, host_probe_us, soup_duration


def row(label: str, r: dict) -> str:
    st = r.get("step_times_s") or []
    graphs = r.get("cuda_graphs") or {}
    caps = graphs.get("captures") or []
    early = sum(c["seconds"] for c in caps if c.get("step", 0) <= 2)
    late = graphs.get("capture_s_excl_first2") or 0.0
    pre = r.get("precompile") or {}
    cells = [label, f"{st[0]:.2f}" if st else "-", f"{st[1]:.2f}" if len(st) > 1 else "-",
             f"{r['train_excl_first2_s']:.2f}" if r.get("train_excl_first2_s") else "-",
             f"{soup_duration(r):.2f}" if soup_duration(r) else "-",
             f"{len(caps)} / {early:.2f} / {late:.2f}",
             f"{(r.get('peak_mem_reserved_bytes') or 0) / GIB:.2f} / {(r.get('peak_mem_allocated_bytes') or 0) / GIB:.2f}"
             f" / {graph_pool_gib(r) or 0:.2f}",
             _seconds(r.get("setup_s")), _seconds(pre.get("training_to_finish_s")),
             _us(host_probe_us(r)),
             "; ".join(d.get("reason", "")[:60] for d in graphs.get("decisions") or []) or "-"]
    return "| " + " | ".join(cells) + " |"


HEADER = ("| run | step 1 (s) | step 2 (s) | steps 3-N (s) | Soup's duration (s) | captures: n / s in steps 1-2 / s after "
          "| peak reserved / allocated / graph pool at end (GiB) | setup before training (s) "
          "| precompile finished, s after training began | host probe (us a call) | graphs decision |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")


def _seconds(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def _us(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def main(argv=None) -> int:
    lines = [HEADER]
    for spec in argv if argv is not None else sys.argv[1:]:
        label, _, path = spec.partition("=")
        try:
            r = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            lines.append(f"| {label} | no result ({type(exc).__name__}) |")
            continue
        lines.append(row(label, r))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
