"""Report rendering: Markdown table (baseline, solution, ratio), summary, PNG plot, summary.json."""
from __future__ import annotations

from bench import t4_projection
from bench.memory_peak import private_reserved_bytes
from bench.own_kernels import CATEGORIES

GIB = 2**30
OWN_CATEGORY = CATEGORIES[0][0]  # our kernels' category in a kernel split (bench/own_kernels.py)


def _fmt(v, unit=""):
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:,.3g}{unit}" if abs(v) < 100 else f"{v:,.1f}{unit}"
    return f"{v}{unit}"


def _mem(r: dict, key: str):
    v = r.get(key)
    return v / GIB if v else None


def soup_duration(r: dict):
    """Soup's own training duration (its tracker's run row)."""
    runs = r.get("tracker", {}).get("runs") or [{}]
    return runs[0].get("duration_secs")


def last_step(rep: dict):
    """The run's real number of steps (the baseline's timed run, else the solution's), for the
    "steps 3-N" labels; the workload's steps for a report without runs; "N" when neither is known."""
    for variant in ("baseline", "solution"):
        r = rep.get(variant) or {}
        if isinstance(r.get("steps"), int) and not isinstance(r.get("steps"), bool):
            return r["steps"]
        if r.get("step_times_s"):
            return len(r["step_times_s"])
    return (rep.get("workload") or {}).get("steps", "N")


def timed_steps(rep: dict) -> str:
    """The steps the timed figures cover: "steps 3-N", N the run's last step (last_step)."""
    return f"steps 3-{last_step(rep)}"


def no_4bit(rep: dict) -> str | None:
    """Why the report's runs had no 4-bit (NF4) quantization, or None when they had it: a run whose
    trained model held no bitsandbytes Linear4bit layer (bench/run_one.py's linear4bit_layers), or,
    in a report from before that count, a CPU run (Soup switches 4-bit off on a CPU)."""
    counts = [(rep.get(v) or {}).get("linear4bit_layers") for v in ("baseline", "solution")]
    if any(c == 0 for c in counts):
        where = " (Soup switches 4-bit off on a CPU)" if (rep.get("gpu") or {}).get("name") == "cpu" else ""
        return f"the trained model had no bitsandbytes NF4 layer{where}"
    if all(c is None for c in counts) and (rep.get("gpu") or {}).get("name") == "cpu":
        return "Soup switches 4-bit off on a CPU"
    return None


def _rows(rep: dict) -> list[tuple[str, object, object, str]]:
    b, s = rep["baseline"], rep["solution"]
    kb, ks = rep["kernel_split"]["baseline"], rep["kernel_split"]["solution"]

    def final_loss(r):
        runs = r.get("tracker", {}).get("runs") or [{}]
        return runs[0].get("final_loss")

    steps = b.get("step_times_s") or []
    return [
        ("total wall time (s)", b.get("wall_s"), s.get("wall_s"), "lower"),
        ("training time, Soup's duration (s)", soup_duration(b), soup_duration(s), "lower"),
        ("training time excl. first 2 steps (s)", b.get("train_excl_first2_s"), s.get("train_excl_first2_s"), "lower"),
        ("mean step time excl. first 2 (ms)",
         1e3 * b["train_excl_first2_s"] / max(len(steps) - 2, 1) if b.get("train_excl_first2_s") else None,
         1e3 * s["train_excl_first2_s"] / max(len(s.get("step_times_s") or []) - 2, 1) if s.get("train_excl_first2_s") else None,
         "lower"),
        ("tokens/s excl. first 2 (non-pad)", b.get("tokens_per_s_excl_first2"), s.get("tokens_per_s_excl_first2"), "higher"),
        ("peak GPU memory allocated (GiB)", _mem(b, "peak_mem_allocated_bytes"), _mem(s, "peak_mem_allocated_bytes"), "lower"),
        ("peak GPU memory reserved (GiB)", _mem(b, "peak_mem_reserved_bytes"), _mem(s, "peak_mem_reserved_bytes"), "lower"),
        (f"GPU kernel time, {timed_steps(rep)} (s)", kb["total_gpu_s"] if kb else None,
         ks["total_gpu_s"] if ks else None, "lower"),
        *([(f"GPU kernel time, graphs off (the T4's path), {timed_steps(rep)} (s)", kb["total_gpu_s"] if kb else None,
            ke["total_gpu_s"], "lower")] if (ke := rep["kernel_split"].get("solution_graphs_off")) else []),
        ("final loss", final_loss(b), final_loss(s), "same"),
    ]


# The project's targets: solution at most this fraction of the baseline, per report row
# ("steps 3-N": the run's timed steps, timed_steps); TARGETS_TITLE says them in words.
TARGETS = [
    ("training time excl. first 2 steps (s)", 1 / 3, "1/3"),
    ("training time, Soup's duration (s)", None, None),  # no target of its own: shown beside steps 3-N
    ("peak GPU memory allocated (GiB)", 1 / 2, "1/2"),
    ("peak GPU memory reserved (GiB)", 1 / 2, "1/2"),
    ("GPU kernel time, steps 3-N (s)", 1 / 3, "1/3"),
]
TARGETS_TITLE = ("Against the project's targets (solution at most 1/3 of the baseline's time, "
                 "1/2 of its memory)")


def _targets_section(rep: dict) -> list[str]:
    """Each target row: solution / baseline against the target fraction, and when missed, by how
    much (the solution figure minus the largest one that would meet it)."""
    rows = {name: (b, s) for name, b, s, _ in _rows(rep)}
    out = [f"## {TARGETS_TITLE}", "",
           "| figure | solution / baseline | target | status |", "| --- | ---: | ---: | --- |"]
    for template, frac, label in TARGETS:
        name = template.replace("steps 3-N", timed_steps(rep))
        b, s = rows.get(name, (None, None))
        if not b or not s:
            out.append(f"| {name} | n/a | {'none' if frac is None else '<= ' + label} | not measured |")
            continue
        ratio = s / b
        if frac is None:
            out.append(f"| {name} | {ratio:.3f} | none | shown beside {timed_steps(rep)} |")
            continue
        status = "met" if ratio <= frac else f"missed by {_fmt(s - b * frac)} ({_fmt(b * frac)} needed)"
        out.append(f"| {name} | {ratio:.3f} | <= {label} | {status} |")
    return out + [""]


def _ratio(b, s, better):
    if not b or not s:
        return "n/a"
    if better == "lower":
        return f"{b / s:.2f}x"
    if better == "higher":
        return f"{s / b:.2f}x"
    return f"{(s - b) / abs(b):+.2e} rel"


CPU_FIRST_LINE = ("CPU run: times on a CPU say nothing about the GPU, and Soup switches NF4 (4-bit) off on a CPU: "
                  "the NF4 kernels did not take part (our kernels ran in Triton's interpreter).")
# Soup's precision on a CPU (soup_cli.utils.gpu.bf16_fp16_flags: neither bf16 nor fp16 off CUDA)
CPU_FP32_LINE = ("Soup trains in fp32 on a CPU (fp16 only on a GPU): there is no GradScaler and no fp16 overflow, "
                 "so the rule check's GradScaler row has no skipped steps or loss scale to compare here; "
                 "the GPU run checks them.")


def summary_table(rep: dict) -> str:
    """bench.compare's printed summary: (on a CPU, first, CPU_FIRST_LINE and CPU_FP32_LINE), the
    headline rows, the share, the graphs, the T4 projection, then every run's solution / baseline
    ratios. A report is a CPU run when its "gpu" name is "cpu" (bench.compare's _gpu: no CUDA)."""
    lines = [CPU_FIRST_LINE, CPU_FP32_LINE] if (rep.get("gpu") or {}).get("name") == "cpu" else []
    lines.append(f"{'':40} {'baseline':>12} {'solution':>12} {'gain':>12}")
    for name, b, s, better in _rows(rep):
        lines.append(f"{name:40} {_fmt(b):>12} {_fmt(s):>12} {_ratio(b, s, better):>12}")
    share = rep.get("own_kernel_share")
    lines.append(f"own-kernel share of training time (excl. first 2): "
                 f"{'n/a' if share is None else f'{share:.1%}'}")
    lines += [ln for ln in _cuda_graph_lines(rep) if ln]
    lines.append(t4_projection.console_line(rep.get("t4_projection")))
    shapes = _shapes(rep)
    if len(shapes) > 1:
        lines.append(f"solution / baseline by run (Soup's duration, {timed_steps(rep)}, first step, GPU kernel "
                     "time, peak allocated, peak reserved; loss max rel diff):")
        for key, e in shapes.items():
            r = e.get("ratios") or ratios(e["baseline"], e["solution"])
            figs = ", ".join("n/a" if r.get(k) is None else f"{r[k]:.3f}" for k in RATIO_FIGURES)
            loss = e["solution"].get("loss_max_rel_diff")
            lines.append(f"  {key:<22} {figs}; {'n/a' if loss is None else f'{loss:.2e}'}")
    for key, e in shapes.items():
        if e.get("partition"):
            lines.append(_partition_line(key, e))
    return "\n".join(lines)


def _partition_line(key: str, e: dict) -> str:
    """One line per run in an SM partition: N, whether it held in each variant's child, and the
    model's predicted steps 3-N ratio beside the measured one."""
    parts = e["partition"]
    held = ", ".join(f"{v} {'held' if (p.get('held_check') or {}).get('held') else 'NOT held'}"
                     for v, p in parts.items())
    pred = e.get("prediction") or {}
    ratio = pred.get("ratio") or {}
    model = ("; model predicted solution / baseline " + ", ".join(
        f"{k} {ratio[k]:.3f}" for k in ("predicted", "measured") if ratio.get(k) is not None)) if ratio else ""
    return f"{key}: {next(iter(parts.values())).get('sms')}-SM partition, {held}{model}"


def _share_context(rep: dict) -> list[str]:
    """What the share is made of (measured figures of this report, nothing new): our kernels'
    share of the solution's GPU kernel time, and how busy the GPU was during the timed steps. A GPU
    busy a small part of the wall time means a host-bound step, where kernel work barely moves the
    share's denominator."""
    ks = rep["kernel_split"].get("solution")
    wall = rep["solution"].get("train_excl_first2_s")
    own = rep.get("own_kernel_gpu_s")
    gpu = ks.get("total_gpu_s") if ks else None
    if not gpu or not wall or own is None:
        return []
    busy = gpu / wall
    return [f"(our kernels: {own:.3f} s = {own / gpu:.1%} of the solution's GPU kernel time; "
            f"GPU kernel time {gpu:.2f} s over {wall:.1f} s of wall time = {busy:.1%} busy: "
            f"{'host-bound' if busy < 0.5 else 'GPU-bound'} steps)"]


def _cuda_graph_lines(rep: dict) -> list[str]:
    """The solution's decoder CUDA graphs (timed run): captures, their seconds inside the timed
    steps, failures; and why peak allocated memory undercounts with graphs."""
    g = rep["solution"].get("cuda_graphs")
    if not g:
        return []
    caps = g.get("captures") or []
    from solution.step.graph_decision import decision_line

    decided = [f"{decision_line(d)}." for d in g.get("decisions") or []]
    if decided:
        lines_head = ["Measured decision (host-bound or GPU-bound eager layers: $SOLUTION_CUDA_GRAPHS=auto): "
                      + " ".join(decided)]
    else:
        lines_head = []
    if not caps:
        why = "; ".join(g.get("failed") or g.get("refused") or []) or "no packed training forward"
        on_graphs = [d for d in g.get("decisions") or [] if d.get("subject", "graphs") == "graphs"]
        if on_graphs and not any(d["graphs"] for d in on_graphs):  # the decision line says why not
            return lines_head + [""]
        return lines_head + [f"CUDA graphs over the decoder layers: not used ({why}).", ""]
    early = sum(1 for c in caps if c["step"] <= 2)
    total = sum(c["seconds"] for c in caps)
    ahead = sum(1 for c in caps if c.get("ahead"))
    lines = [f"CUDA graphs over the decoder layers: {len(caps)} captures ({early} in the first two steps, {ahead} "
             f"of them captured ahead from the dataset's predicted buckets), {total:.2f} s in all, "
             f"{g.get('capture_s_excl_first2', 0.0):.2f} s of them inside the timed steps; "
             f"buckets (tokens): {', '.join(str(c['tokens']) for c in caps)}."]
    if g.get("failed"):
        lines.append(f"Graph failures (eager from then on): {'; '.join(g['failed'])}.")
    lines.append("With graphs the layers' activations live in the graph's memory pool, which peak *allocated* "
                 "memory does not count during replays: read it beside peak *reserved* memory and the pool.")
    return lines_head + lines + [""]


# Per-run figures of the shapes table and of summary.json, in this order (key, column title).
# Memory leads with peak allocated (what the tensors hold; reserved adds the allocator's own choices).
FIGURES = [("soup_duration_s", "Soup's duration (s)"), ("train_excl_first2_s", "steps 3-N (s)"),
           ("first_step_s", "first step (s)"), ("gpu_kernel_s", "GPU kernel time, steps 3-N (s)"),
           ("peak_allocated_gib", "peak allocated (GiB)"), ("peak_reserved_gib", "peak reserved (GiB)"),
           ("graph_pool_gib", "CUDA-graph pool, reserved at the end (GiB)"),
           ("loss_max_rel_diff", "loss max rel diff"),
           ("own_kernel_share", "own-kernel share"),
           ("capture_s_in_timed_steps", "graph captures in steps 3-N (s)"),
           ("first_step_compiles", "Triton compiles in step 1"),
           ("host_probe_us", "host probe (us a call)")]
# The ones whose solution / baseline ratio the report gives.
RATIO_FIGURES = ("soup_duration_s", "train_excl_first2_s", "first_step_s", "gpu_kernel_s",
                 "peak_allocated_gib", "peak_reserved_gib")


def run_figures(result: dict, split: dict | None = None, base: dict | None = None) -> dict:
    """One run's figures (a timed bench.run_one result; ``split``: compare.kernel_split of its
    profiled pass, None if none; ``base``: the baseline's timed result to take the loss difference
    against, None for the baseline itself). None where not measured. The own-kernel share is our
    kernels' GPU time in the profiled pass over the timed pass's steps 3-N (as the report's
    headline share)."""
    import math

    from bench.rules import loss_diffs

    steps = result.get("step_times_s") or []
    graphs = result.get("cuda_graphs") or {}
    loss = 0.0
    if base is not None:
        loss = loss_diffs(base, result)["max_rel"]
        loss = loss if math.isfinite(loss) else None  # no common step, or a NaN loss
    wall = result.get("train_excl_first2_s")
    return {"soup_duration_s": soup_duration(result),
            "train_excl_first2_s": wall,
            "first_step_s": steps[0] if steps else None,
            "gpu_kernel_s": split["total_gpu_s"] if split else None,
            "peak_allocated_gib": _mem(result, "peak_mem_allocated_bytes"),
            "peak_reserved_gib": _mem(result, "peak_mem_reserved_bytes"),
            "graph_pool_gib": graph_pool_gib(result),
            "loss_max_rel_diff": loss,
            # our kernels' GPU time (profiled pass) over the timed pass's wall time, steps 3..N
            "own_kernel_share": split["by_category_s"].get(OWN_CATEGORY, 0.0) / wall if split and wall else None,
            "capture_s_in_timed_steps": graphs.get("capture_s_excl_first2") if graphs.get("captures") else None,
            "first_step_compiles": _first_step_compiles(result),
            "host_probe_us": host_probe_us(result)}


def host_probe_us(result: dict) -> float | None:
    """How fast a pass's host was (bench/host_probe.py: microseconds a call, lower is faster); None
    for a result from before the probe."""
    return (result.get("host_probe") or {}).get("us_per_call")


def graph_pool_gib(result: dict) -> float | None:
    """Reserved memory of the private allocator pools at the end of training (the decoder graphs'
    pool: its activations are reserved, never counted as allocated during replays); None when the
    run did not record its pools, 0 when it had none."""
    pools = result.get("memory_pools_at_end")
    return None if pools is None else private_reserved_bytes(pools) / GIB


def _first_step_compiles(result: dict) -> int | None:
    """Triton JIT compiles in the first training step, from the run's compile log (None: not logged)."""
    log = result.get("compile_log") or {}
    if not log.get("available"):
        return None
    return (log.get("by_step") or {}).get("1", {}).get("compiles", 0)


def ratios(b: dict, s: dict) -> dict:
    """Solution / baseline of each figure in RATIO_FIGURES (None where either is missing)."""
    return {k: (s[k] / b[k] if b.get(k) and s.get(k) is not None else None) for k in RATIO_FIGURES}


def _shapes(rep: dict) -> dict:
    """The report's runs by key (shipped, long, short, shipped-cold); a report written before
    there were shapes has its one (shipped) run only."""
    if rep.get("shapes"):
        return rep["shapes"]
    ks = rep["kernel_split"]
    b = run_figures(rep["baseline"], ks.get("baseline"))
    s = run_figures(rep["solution"], ks.get("solution"), rep["baseline"])
    return {rep.get("shape", "shipped"): {"baseline": b, "solution": s, "ratios": ratios(b, s)}}


def _shapes_section(rep: dict) -> list[str]:
    """Every run of the report side by side: named runs (bench/runs.py), dataset shapes, the cold pass."""
    from workload.data.kazakh import SHORT_LIMIT

    cols = [title.replace("steps 3-N", timed_steps(rep)) for _, title in FIGURES]
    out = ["## Every run side by side", "",
           "One row per run and variant (timed passes; GPU kernel time and the own-kernel share from the "
           "profiled pass of the same run). shipped: the --data file (default the embedded dataset); long: every "
           "row over max_length tokens (every batch full, no padding); short: every row under "
           f"{SHORT_LIMIT} tokens (workload/data/kazakh.py); shipped-cold: the shipped shape again, each "
           "variant in empty Triton and Inductor caches (no compile of an earlier run is found); the other "
           "runs: the table \"Runs and the calls they came from\". Host probe: how fast the pass's host was, "
           "timed before Soup started (bench/host_probe.py; microseconds a call, lower is faster): a ratio "
           "compares like with like only where both variants' probes are close.", "",
           "| run | variant | " + " | ".join(cols) + " |", "| --- | --- |" + " ---: |" * len(cols)]
    for key, entry in _shapes(rep).items():
        for variant in ("baseline", "solution"):
            f = entry[variant]
            cells = [_cell(k, f.get(k)) for k, _ in FIGURES]
            out.append(f"| {key} | {variant} | " + " | ".join(cells) + " |")
        r = entry.get("ratios") or ratios(entry["baseline"], entry["solution"])
        cells = [("" if k not in RATIO_FIGURES else "n/a" if r.get(k) is None else f"{r[k]:.3f}") for k, _ in FIGURES]
        out.append(f"| {key} | solution / baseline | " + " | ".join(cells) + " |")
    return out + [""]


def _repeats_section(rep: dict) -> list[str]:
    """The runs whose timed pairs were repeated (bench.compare --repeat; bench/repeats.py): every
    pair with its ratios, the one taken for the run marked, and the spread."""
    rows = [(key, e["repeats"]) for key, e in _shapes(rep).items() if e.get("repeats")]
    if not rows:
        return []

    def f(v, fmt):
        return "n/a" if v is None else format(v, fmt)

    steps = timed_steps(rep)
    out = ["## Repeated pairs (--repeat)", "",
           "Each run's timed pass ran once per pair and variant, interleaved (baseline, solution, baseline, "
           f"solution, ...). The pair with the median {steps} ratio (the lower middle one for an even count) stands "
           "for the run in every other table of this report (bench/repeats.py).", "",
           f"| run | pair | baseline {steps} (s) | solution {steps} (s) | {steps} ratio | Soup's duration ratio | taken |",
           "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for key, c in rows:
        for r in c["pairs"]:
            out.append(f"| {key} | {r['pair']} | {f(r['baseline_steps_s'], '.2f')} | {f(r['solution_steps_s'], '.2f')} | "
                       f"{f(r['steps_ratio'], '.3f')} | {f(r['soup_ratio'], '.3f')} | "
                       f"{'yes' if r['pair'] == c['chosen'] else ''} |")
        out.append(f"| {key} | spread | | | {f(c['steps_ratio_min'], '.3f')}-{f(c['steps_ratio_max'], '.3f')} | "
                   f"{f(c['soup_ratio_min'], '.3f')}-{f(c['soup_ratio_max'], '.3f')} | |")
    return out + [""]


def _cell(key: str, value) -> str:
    if key == "loss_max_rel_diff" and value:
        return f"{value:.2e}"
    if key == "own_kernel_share" and value is not None:
        return f"{value:.1%}"
    return _fmt(value)


def _runs_section(rep: dict) -> list[str]:
    """What each run is and the call it came from (bench.rebuild_report assembles runs of several
    calls into one report)."""
    rows = [(key, e) for key, e in _shapes(rep).items() if e.get("run") or e.get("call")]
    if not rows:
        return []
    out = ["## Runs and the calls they came from", "",
           "| run | what | conditions | commit | date | command |", "| --- | --- | --- | --- | --- | --- |"]
    for key, e in rows:
        run, call = e.get("run") or {}, e.get("call") or {}
        out.append(f"| {key} | {run.get('about', '')} | {run.get('conditions', '')} | {call.get('commit', '')} | "
                   f"{call.get('date', '')} | `{call.get('command', '')}` |")
    return out + [""]


SAME_ALLOCATOR = "shipped-same-allocator"  # bench/runs.py: the baseline with expandable segments


def memory_rows(rep: dict) -> list[tuple[str, str, str, float | None, float | None]]:
    """(run, variant, allocator, peak allocated GiB, peak reserved GiB) of the shipped run and of
    run shipped-same-allocator where the report has it."""
    shapes = _shapes(rep)
    solution_alloc = ("expandable segments (apply())" if "cuda_allocator" in ((rep.get("solution") or {})
                                                                              .get("installed") or {}) else "as set")
    rows = []
    for key, base_alloc in (("shipped", "PyTorch's default"), (SAME_ALLOCATOR, "expandable segments "
                                                               "(PYTORCH_CUDA_ALLOC_CONF)")):
        e = shapes.get(key)
        if not e:
            continue
        for variant, alloc in (("baseline", base_alloc), ("solution", solution_alloc)):
            f = e[variant]
            rows.append((key, variant, alloc, f.get("peak_allocated_gib"), f.get("peak_reserved_gib")))
    return rows


def _memory_section(rep: dict) -> list[str]:
    """Memory on equal terms: peak allocated first (what the tensors hold), peak reserved beside
    it (what the caching allocator keeps mapped, which its settings change), the baseline also
    with the allocator setting apply() gives the solution (run shipped-same-allocator)."""
    rows = memory_rows(rep)
    if not rows or all(a is None for *_, a, _ in rows):
        return []
    out = ["## Memory on equal terms", "",
           "Peak allocated memory is what the tensors hold; peak reserved adds what PyTorch's caching allocator "
           "keeps mapped, which depends on its settings. apply() turns on expandable segments for the solution "
           "(unless $PYTORCH_CUDA_ALLOC_CONF is set); run shipped-same-allocator gives the baseline the same "
           "setting, so that a reserved-memory ratio compares the code, not the allocator.", "",
           "| run | variant | allocator | peak allocated (GiB) | peak reserved (GiB) | reserved / allocated |",
           "| --- | --- | --- | ---: | ---: | ---: |"]
    for key, variant, alloc, allocated, reserved in rows:
        ratio = f"{reserved / allocated:.2f}" if allocated and reserved else "n/a"
        gib = ["n/a" if v is None else f"{v:.2f}" for v in (allocated, reserved)]
        out.append(f"| {key} | {variant} | {alloc} | {gib[0]} | {gib[1]} | {ratio} |")
    out.append("")
    shapes = _shapes(rep)
    for key in ("shipped", SAME_ALLOCATOR):
        e = shapes.get(key)
        if e:
            r = e.get("ratios") or ratios(e["baseline"], e["solution"])
            out.append(f"- {key}: solution / baseline, peak allocated "
                       f"{'n/a' if r.get('peak_allocated_gib') is None else format(r['peak_allocated_gib'], '.3f')}, "
                       f"peak reserved {'n/a' if r.get('peak_reserved_gib') is None else format(r['peak_reserved_gib'], '.3f')}")
    if SAME_ALLOCATOR not in shapes:
        out.append(f"- run {SAME_ALLOCATOR} is not in this report (bench.compare --runs {SAME_ALLOCATOR})")
    pool = (shapes.get("shipped") or {}).get("solution", {}).get("graph_pool_gib")
    if pool:
        out.append(f"- with CUDA graphs the layers' activations live in the graphs' pool ({pool:.2f} GiB reserved at "
                   "the end), which peak allocated does not count during replays: read allocated beside reserved")
    return out + [""]


def _partition_sections(rep: dict) -> list[str]:
    """Each run in an SM partition: the partition's rates beside the whole GPU's, the held-check
    of each variant's child, and the model's prediction beside the measurement."""
    from bench import partition

    out = []
    for key, e in _shapes(rep).items():
        parts = e.get("partition")
        if not parts:
            continue
        out += [f"## GPU-bound machine: run {key} in an SM partition", ""]
        first = next(iter(parts))
        out += [f"Measured in the {first}'s child:", ""] + partition.markdown(parts[first])
        for variant, p in parts.items():
            if variant != first and p.get("held_check"):
                hc = p["held_check"]
                out += [f"The {variant}'s child: held on every path: **{'yes' if hc['held'] else 'NO'}** (" + ", ".join(
                    f"{path} {r['fraction_of_whole']:.3f}" for path, r in hc["paths"].items())
                    + f" of the whole GPU; {p.get('streams_made', 0)} side streams handed out).", ""]
        out += t4_projection.partition_section(e.get("prediction"))
    return out


def summary(rep: dict) -> dict:
    """summary.json: the report's runs, figures only, for comparing sessions by machine. Each run
    under its name: its two variants' figures, and where known what the run is ("run"), the call
    it came from ("call": commit, date, command), its SM partition's measurement ("partition") and
    the model's prediction for it ("prediction") and its repeated pairs ("repeats", bench/repeats.py)."""
    return {"gpu": rep["gpu"]["name"], "date": rep["date"], "commit": rep.get("commit") or "unknown",
            "command": rep.get("command"),
            "runs": {key: _summary_run(e) for key, e in _shapes(rep).items()},
            "t4_projection": t4_projection.summary(rep.get("t4_projection"))}


def _summary_run(e: dict) -> dict:
    out = {"baseline": e["baseline"], "solution": e["solution"]}
    out.update({k: e[k] for k in ("run", "call", "partition", "prediction", "repeats") if e.get(k)})
    return out


def write_summary(rep: dict, path) -> None:
    import json
    from pathlib import Path

    Path(path).write_text(json.dumps(summary(rep), indent=1) + "\n", encoding="utf-8")


def _host_split_section(rep: dict) -> list[str]:
    """Where the wall time of a step goes (host-split passes, bench/host_split.py), both variants
    side by side, in ms a step. Nested rows (the decoder inside the forward, the module classes
    inside the decoder) are indented and not part of the step's sum."""
    hs = rep.get("host_split") or {}
    b, s = hs.get("baseline"), hs.get("solution")
    if not b or not s:
        return []
    from bench.host_split import MODULE, NESTED, ORDER

    def ms(r, p):
        v = r["phases_s"].get(p)
        return "" if v is None else f"{1000 * v / r['steps']:.1f}"

    def calls(r, p):
        v = r.get("calls", {}).get(p)
        return "" if v is None else f"{v / r['steps']:.0f}"

    modules = sorted({p for r in (b, s) for p in r["phases_s"] if p.startswith(MODULE)})
    out = [f"## Where the step's wall time goes (host-split passes, {timed_steps(rep)})", "",
           "Each variant ran once more with timers around the Trainer's phases and the decoder's modules "
           "(bench/host_split.py; no device sync, a few microseconds a call). On a GPU that finishes its "
           "work faster than Python queues it, these wall times are host (CPU) time.", "",
           "A fused path of ours that bypasses a module's call (our LoRA layer runs its bnb base layer "
           "without calling it) does not count for that module: compare the calls.", "",
           "| phase | baseline ms a step | solution ms a step | baseline calls a step | solution calls a step |",
           "| --- | ---: | ---: | ---: | ---: |",
           f"| whole step | {1000 * b['wall_s'] / b['steps']:.1f} | {1000 * s['wall_s'] / s['steps']:.1f} | | |"]
    for p in ORDER + modules:
        label = f"&nbsp;&nbsp;{p}" if p in NESTED or p in modules else p
        out.append(f"| {label} | {ms(b, p)} | {ms(s, p)} | {calls(b, p)} | {calls(s, p)} |")
    return out + [_compile_line(rep), ""]


def _compile_line(rep: dict) -> str:
    """Triton's JIT compiles in the solution's host-split pass: how many, in which steps, seconds."""
    log = (rep.get("compile_log") or {}).get("solution")
    if not log or not log.get("available"):
        return ""
    steps = ", ".join(f"step {k}: {v['compiles']} ({v['seconds']:.1f} s)" for k, v in log["by_step"].items())
    return f"Triton JIT compiles in the solution's host-split pass: {log['compiles']} ({steps or 'none'})."


def markdown(rep: dict) -> str:
    v = rep["versions"]
    why = no_4bit(rep)
    out = [f"# Baseline vs solution: {rep['model']}" + (": seeded random weights, NOT the real Qwen2.5-1.5B-Instruct"
                                                        if str(rep["model"]).startswith("stand-in") else ""), "",
           *([f"- **no 4-bit quantization: these runs trained without NF4** ({why}): the NF4 and LoRA-on-NF4 "
              "kernels did not take part, and the figures are not the QLoRA workload's"] if why else []),
           f"- date: {rep['date']}", f"- GPU: {rep['gpu']['name']}"
           + (f" (sm {rep['gpu']['capability']}" + (f", {rep['gpu']['memory_gib']} GiB" if rep['gpu'].get('memory_gib') else "")
              + ")" if rep['gpu'].get('capability') else "")
           + (f"; runs on {rep['gpu']['runs_on']}" if rep['gpu'].get('runs_on') else ""),
           "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
           f"- command: `{rep['command']}`",
           f"- workload: {rep['workload']['examples']} examples, batch {rep['workload']['batch_size']}, "
           f"max length {rep['workload']['max_length']}, {rep['workload']['steps']} steps",
           f"- T4 paths: {rep['solution'].get('t4_emulation') or 'as Soup and PyTorch choose on this device'}",
           *([f"- dataset shape: {rep['shape']} ({rep['shapes'][rep['shape']].get('data')})"]
             if rep.get("shape", "shipped") != "shipped" else []),
           f"- installed by apply(): {', '.join(rep['solution'].get('installed') or {}) or 'nothing'}", "",
           "| metric | baseline | solution | gain (baseline/solution) |", "| --- | ---: | ---: | ---: |"]
    for name, b, s, better in _rows(rep):
        out.append(f"| {name} | {_fmt(b)} | {_fmt(s)} | {_ratio(b, s, better)} |")
    share = rep.get("own_kernel_share")
    out += ["", f"Own-kernel share of training time excluding the first two steps: "
            f"**{'n/a' if share is None else f'{share:.1%}'}**"
            + ("" if share is not None else f" ({rep.get('own_kernel_share_note')})")]
    out += _share_context(rep)
    out += [f"Own kernels that ran: {', '.join(rep.get('own_kernels_ran') or []) or 'none'}", ""]
    out += _cuda_graph_lines(rep)
    out += _targets_section(rep)
    out += t4_projection.section(rep.get("t4_projection"))  # the T4 projection: a model, not a measurement
    for variant in ("baseline", "solution", "solution_graphs_off"):
        ks = rep["kernel_split"].get(variant)
        if not ks:
            continue
        title = "solution, CUDA graphs off (SOLUTION_CUDA_GRAPHS=0)" if variant == "solution_graphs_off" else variant
        out += [f"## Where GPU time goes: {title} ({timed_steps(rep)}, profiled pass)", "",
                "| category | GPU s | share |", "| --- | ---: | ---: |"]
        for cat, t in ks["by_category_s"].items():
            out.append(f"| {cat} | {t:.3f} | {t / ks['total_gpu_s']:.1%} |")
        out += ["", "Top kernels:", ""]
        out += [f"- {t:.3f} s  `{name[:110]}`" for name, t in ks["top_kernels_s"][:10]]
        out.append("")
    out += _host_split_section(rep)
    out += _memory_section(rep)
    out += _runs_section(rep)
    out += _repeats_section(rep)
    out += _shapes_section(rep)
    out += _partition_sections(rep)
    out += ["## Rule check", ""]
    for r in rep["rules"]:
        status = "PASS" if r["ok"] else ("n/a" if r["ok"] is None else "FAIL")
        out.append(f"- **{status}** {r['check']}: {r['figure']}")
    if rep["gpu"]["name"] == "cpu":
        out += ["", "## What differs from the GPU run", "",
                "- CPU: Soup switches 4-bit quantization off (bitsandbytes NF4 training needs CUDA), so the NF4 "
                "and LoRA-on-NF4 patches do not take part; Soup trains in fp32 (no fp16 autocast), so there is "
                "no GradScaler and no fp16 overflow: the GradScaler rule has nothing to compare on a CPU.",
                "- The model is the tiny stand-in (same architecture and 151936 vocabulary, hidden 64, 2 layers).",
                "- Our kernels run in Triton's CPU interpreter: this checks the wiring and numerics, not speed; "
                "times on the CPU say nothing about the GPU.",
                "- No GPU profiler: the own-kernel share is not measured; kernels that ran are counted by their "
                "launchers."]
    return "\n".join(out) + "\n"


def _series(result: dict, key: str):
    pts = [(int(l["step"]), float(l[key])) for l in result.get("trainer_logs", []) if key in l and "train_runtime" not in l]
    return [p[0] for p in pts], [p[1] for p in pts]


def main(argv=None) -> int:
    """Re-render report.md and summary.json from a report.json, e.g. one fetched from the GPU machine.
    Exit status 0, or 2 with one line `error: ...` for a report that cannot be read or rendered
    (nothing is written then)."""
    import argparse
    import sys
    from pathlib import Path

    from bench.rules import ReportError, load_report

    ap = argparse.ArgumentParser(prog="python -m bench.report", description=main.__doc__)
    ap.add_argument("report_json", type=Path)
    args = ap.parse_args(argv)
    try:
        rep = load_report(args.report_json)
        md, summ = markdown(rep), summary(rep)  # both rendered before either file is written
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:
        print(f"error: report {args.report_json} is incomplete or malformed ({type(exc).__name__}: {exc})",
              file=sys.stderr)
        return 2
    import json

    args.report_json.with_suffix(".md").write_text(md, encoding="utf-8")
    args.report_json.with_name("summary.json").write_text(json.dumps(summ, indent=1) + "\n", encoding="utf-8")
    print(args.report_json.with_suffix(".md"))
    print(args.report_json.with_name("summary.json"))
    return 0


def plot(rep: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    ax = axes[0]
    for variant, style in (("baseline", "-"), ("solution", "--")):
        x, y = _series(rep[variant], "loss")
        ax.plot(x, y, style, label=variant)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("Loss curve (same inputs, same seed)")
    ax.legend()
    ax = axes[1]
    ks = rep["kernel_split"]
    if ks["baseline"] or ks["solution"]:
        cats = sorted({c for v in ks.values() if v for c in v["by_category_s"]})
        bottom = {"baseline": 0.0, "solution": 0.0}
        for cat in cats:
            vals = [(ks[v]["by_category_s"].get(cat, 0.0) if ks[v] else 0.0) for v in ("baseline", "solution")]
            ax.bar(["baseline", "solution"], vals, bottom=[bottom["baseline"], bottom["solution"]], label=cat)
            bottom["baseline"] += vals[0]
            bottom["solution"] += vals[1]
        ax.set_ylabel("GPU time, steps 3-N (s)")
        ax.set_title("Where GPU time goes")
        ax.legend(fontsize=7)
    else:
        steps_b = rep["baseline"].get("step_times_s") or []
        steps_s = rep["solution"].get("step_times_s") or []
        ax.plot(range(1, len(steps_b) + 1), steps_b, label="baseline")
        ax.plot(range(1, len(steps_s) + 1), steps_s, "--", label="solution")
        ax.set_xlabel("step")
        ax.set_ylabel("step time (s)")
        ax.set_title("Step times (no GPU profile on this machine)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
