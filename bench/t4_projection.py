"""T4 projection: what the measured H200 or H100 runs would take on a T4. A MODEL, NOT A MEASUREMENT.

No T4 was available to the project; every GPU report is measured on an H200 or an H100 (SXM) made to
take the T4's code paths (bench/run_one.py: emulate_t4_paths). Below, "the H200" stands for the
measured machine; an H100's runs take the same steps with its own peaks (SOURCES). This module turns one such report's
figures into an estimate of the 64-step training time on a T4, with a simple "roofline" model.
Every step of it, in plain words:

1. GPU time. The profiled pass lists every GPU kernel with its total seconds over steps 3..N
   (result.json: profile.kernel_times_s). Each kernel is put in one of three classes by its name:
   - FLOP-bound: matrix multiplications (cuBLAS / CUTLASS GEMMs, bench/own_kernels.py's
     "matmul" category) and attention (PyTorch's memory-efficient SDPA kernels, "attention").
     Attention is counted as FLOP-bound: its inner work is tensor-core matmuls on tiles held in
     on-chip memory, and at head size 128 and rows up to 512 tokens it does far more arithmetic
     per byte read than either GPU's balance point (~200 FLOP/byte on both). cuBLAS's split-K
     reduction kernels (names with "splitKreduce") only add partial sums: memory-bound.
   - transfer: copies between the host and the GPU ("Memcpy HtoD" / "Memcpy DtoH"): scaled by
     the PCIe link (the T4 has PCIe 3.0 x16, the H200 PCIe 5.0 x16: 4x slower).
   - memory-bound: everything else (our Triton kernels, bitsandbytes' dequantization, PyTorch's
     elementwise / copy / cast / softmax / reduction / optimizer kernels, memsets, device copies):
     they read and write much and compute little.
   A FLOP-bound kernel's seconds are multiplied by (H200 achievable FLOP/s) / (T4 achievable
   FLOP/s); a memory-bound kernel's by (H200 achievable bandwidth) / (T4 achievable bandwidth).
   "Achievable" = the datasheet peak times a fraction (the constants below say which fractions
   have a source and which are assumptions). The sum, divided by the profiled steps, is the
   projected T4 GPU time per step (kernels are taken to run one after another, as on one
   stream; kernels that overlapped on the H200 are counted in full). Not modelled: that a kernel tuned for the H200 may pick other
   tiles on a T4, caches of other sizes, launch latency, and that small kernels reach neither
   machine's peak (one calibration factor, step 4, absorbs the average of these errors).
2. Host time. What the CPU spends per step (Python, PyTorch's dispatcher, kernel launches) is not
   recorded as such; it is derived: on the H200 the GPU is busy a small part of each step (it waits
   for the host), so the timed pass's wall time per step (train_excl_first2_s / (steps - 2)) is
   taken as the host time per step. It is an upper bound: it includes the wait for the last kernels
   at each step's end. Seconds of CUDA-graph captures inside the timed steps (a one-time cost) are
   taken out first. The Kaggle T4 machine's CPU is assumed KAGGLE_CPU_FACTOR times slower.
   With and without CUDA graphs: the solution's timed run uses graphs where its first step measured
   host-bound (solution/step/cuda_graphs.py: decide()); its wall time is then the host time *with*
   graphs. Its host time *without* graphs (eager) is measured by its own run with graphs off
   (bench.compare's run "shipped-graphs-off": the solution with SOLUTION_CUDA_GRAPHS=0, timed): on
   the H200 that eager step is host-bound, so its wall time per step is its host time. The result
   names the run it came from. Without that run the baseline's host time per step stands in (an
   upper bound: the solution's eager step does the stock step's host work or less), said in the
   result. On the T4 decide() would say "off" (GPU-bound) when
   the projected GPU time exceeds GPU_BOUND_RATIO times the eager host time: then the eager host
   time is the one that counts, and so is the GPU time *without* graphs: a graphs run replays
   every batch in a bucket of tokens, whose filler tokens are GPU work the eager step does not do.
   bench/compare.py profiles the solution a second time with graphs off (SOLUTION_CUDA_GRAPHS=0,
   "solution-profiled-eager", as a GPU-bound T4 runs) for that figure; without that pass the graphs profile stands in
   for it (an upper bound, said in the result).
3. Step time = max(host, GPU) per step: the slower side sets the pace (the other one waits).
   64-step training time = 64 x the step time (the first two steps' extra costs, compiles and
   warm-up, are not modelled separately).
4. Calibration. The official T4 figure for the baseline is ~80 s of training for 64 steps (~900
   tokens/s, ~14 GB). One factor = 80 s / (projected baseline) is applied to both runs: the
   calibrated baseline is 80 s by construction, and the raw projection's distance from 80 s
   (the calibration error) says how far the bare model was off. The solution's calibrated figure
   assumes that the model errs by the same factor for both runs, which is itself an assumption
   (the two runs have different kernel mixes).

The same model, pointed at a measured machine (predict_partition): bench.compare's run
"gpu-bound-sm16" confines both variants to 16 of the H200's SMs (bench/partition.py), a GPU-bound
machine that can be measured. The model's constants are then that partition's measured rates:
FLOP-bound kernels scaled by (whole GPU's measured matmul TFLOP/s) / (the partition's),
memory-bound ones by the ratio of the measured copy rates, host and PCIe unchanged (the same CPU
and link), no calibration. Its prediction from the whole-GPU runs, beside the partition's
measured steps, checks the model's structure (step = max(host, GPU), the graphs decision, the
split by bound) against a machine that exists.

Usage: project(base_timed, base_profiled, sol_timed, sol_profiled) -> dict (bench/compare.py puts
it in report.json under "t4_projection"; bench/report.py renders it and copies it to summary.json);
predict_partition(...) -> dict (the partition run's "prediction").
Pure: it reads the result dicts of bench/run_one.py and computes; no GPU, no files.
"""
from __future__ import annotations

from bench.own_kernels import categorize

# --- the machines ---------------------------------------------------------------------------------
# NVIDIA T4 datasheet: 65 TFLOPS mixed-precision (fp16 in, fp32 accumulate) tensor-core peak,
# 320 GB/s GDDR6, PCIe 3.0 x16, 70 W.
T4_FP16_TENSOR_FLOPS = 65e12
T4_MEM_BW = 320e9
# NVIDIA H200 SXM datasheet: 1,979 TFLOPS fp16/bf16 tensor "with sparsity", i.e. ~989 dense;
# 4.8 TB/s HBM3e; PCIe 5.0 x16.
H200_FP16_TENSOR_FLOPS = 989e12
H200_MEM_BW = 4.8e12
# NVIDIA H100 SXM5 datasheet ("NVIDIA H100 80GB HBM3" as the driver names it): the same ~989 dense
# fp16 TFLOPS as the H200, 3.35 TB/s HBM3, PCIe 5.0 x16. (The H100 PCIe and NVL cards have other
# figures and are not taken.)
H100_FP16_TENSOR_FLOPS = 989e12
H100_MEM_BW = 3.35e12

# --- achievable fractions of those peaks ------------------------------------------------------------
# T4 FLOP: SOURCED. A cuBLAS fp16 GEMM of 4096 x 4096 x 4096 on a T4 sustains ~24 TFLOP/s (37% of
# 65): the 70 W power cap lowers the clock under continuous matrix work (NVIDIA developer forums,
# "About GPU peak performance", forums.developer.nvidia.com/t/about-gpu-peak-performance/264462,
# with NVIDIA's answer that this is expected).
T4_FLOP_FRACTION = 24 / 65
# T4 bandwidth: ASSUMPTION. A streaming copy on a GDDR6 card typically reaches ~75-85% of the
# datasheet bandwidth; 80% (256 GB/s) is assumed, not measured.
T4_BW_FRACTION = 0.80
# Hopper FLOP (H200 and H100 SXM): ASSUMPTION. Large dense fp16 GEMMs on Hopper reach ~65-75% of
# the dense peak; 70% (~690 TFLOP/s) is assumed, not measured on these machines.
HOPPER_FLOP_FRACTION = 0.70
# Hopper bandwidth: ASSUMPTION. HBM3 / HBM3e streaming reaches ~85-90% of the datasheet; 85% (~4.1
# TB/s on the H200, ~2.8 on the H100) is assumed, not measured on these machines.
HOPPER_BW_FRACTION = 0.85
# PCIe: T4 3.0 x16 (~15.8 GB/s a direction) against the Hopper cards' 5.0 x16 (~63 GB/s), the same
# achievable fraction assumed on both: transfers 4x slower on the T4.
PCIE_SCALE = 4.0

# The measured machines the model takes: {name: (the driver's device name contains, dense fp16 FLOP/s,
# memory bandwidth)}; the same achievable fractions for both.
SOURCES = {"H200": ("H200", H200_FP16_TENSOR_FLOPS, H200_MEM_BW),
           "H100": ("H100 80GB HBM3", H100_FP16_TENSOR_FLOPS, H100_MEM_BW)}


def source_of(device: str | None) -> str | None:
    """The SOURCES key of a device name (None: a machine the model does not take)."""
    return next((k for k, (match, _, _) in SOURCES.items() if device and match in device), None)


def flop_scale(source: str = "H200") -> float:
    """A FLOP-bound kernel's T4 seconds per measured second on ``source``."""
    return SOURCES[source][1] * HOPPER_FLOP_FRACTION / (T4_FP16_TENSOR_FLOPS * T4_FLOP_FRACTION)


def mem_scale(source: str = "H200") -> float:
    """A memory-bound kernel's T4 seconds per measured second on ``source``."""
    return SOURCES[source][2] * HOPPER_BW_FRACTION / (T4_MEM_BW * T4_BW_FRACTION)


FLOP_SCALE = flop_scale("H200")
MEM_SCALE = mem_scale("H200")

# --- the host --------------------------------------------------------------------------------------
# ASSUMPTION: Kaggle's T4 sessions run on a 2.0-2.2 GHz Intel Xeon (a few vCPUs); the H200 and H100
# machines' hosts are current server CPUs boosting well above 3 GHz. Single-thread Python and launch work is
# taken as 2x slower on Kaggle (the pessimistic end of a 1.5-2x guess; not measured).
KAGGLE_CPU_FACTOR = 2.0
# solution/step/cuda_graphs.py: GPU_BOUND_RATIO (a copy, checked equal by tests/test_t4_projection.py):
# decide() turns graphs off when the GPU time exceeds this many times the host time.
GPU_BOUND_RATIO = 1.15

# --- the official T4 baseline (the challenge's figures, 64 steps of the workload) -----------------
OFFICIAL_BASELINE_TRAIN_S = 80.0
OFFICIAL_BASELINE_TOKENS_PER_S = 900.0
OFFICIAL_BASELINE_MEMORY_GB = 14.0

SKIP_STEPS = 2  # bench/run_one.py: the profile and the timed figures cover steps 3..N
LABEL = "T4 projection (a model, not a measurement)"

FLOP, MEMORY, TRANSFER = "flop-bound", "memory-bound", "transfer"


def kernel_class(name: str) -> str:
    """FLOP, MEMORY or TRANSFER for one profiled kernel name (see the module docstring, step 1)."""
    low = name.lower()
    if low.startswith("memcpy htod") or low.startswith("memcpy dtoh"):
        return TRANSFER
    if "splitkreduce" in low:
        return MEMORY
    cat = categorize(name)
    if cat.startswith("matmul") or cat.startswith("attention"):
        return FLOP
    return MEMORY


SCALE = {FLOP: FLOP_SCALE, MEMORY: MEM_SCALE, TRANSFER: PCIE_SCALE}  # from the H200


def t4_machine(source: str = "H200") -> dict:
    """project_run's ``machine`` for a T4 projected from runs measured on ``source`` (a SOURCES key)."""
    return {"name": "T4", "scale": {FLOP: flop_scale(source), MEMORY: mem_scale(source), TRANSFER: PCIE_SCALE},
            "host_factor": KAGGLE_CPU_FACTOR, "source": source}


def _timed_steps(result: dict) -> int:
    """Steps 3..N of a run (its step_times_s)."""
    return max(len(result.get("step_times_s") or []) - SKIP_STEPS, 0)


def gpu_split(profiled: dict, scale: dict | None = None) -> dict:
    """The profiled pass's kernel seconds per step by class, on the H200 and projected on the T4
    (``scale``: seconds multiplied per class; default SCALE, the T4's)."""
    scale = SCALE if scale is None else scale
    times = profiled["profile"]["kernel_times_s"]
    steps = _timed_steps(profiled)
    if not steps:
        raise ValueError("the profiled pass has no steps after the first two")
    measured = {FLOP: 0.0, MEMORY: 0.0, TRANSFER: 0.0}
    for name, t in times.items():
        measured[kernel_class(name)] += t
    measured = {k: v / steps for k, v in measured.items()}
    t4 = {k: v * scale[k] for k, v in measured.items()}
    return {"profiled_steps": steps, "window_s": profiled["profile"].get("window_s"),
            "measured_s_per_step": measured, "measured_gpu_s_per_step": sum(measured.values()),
            "t4_s_per_step": t4, "t4_gpu_s_per_step": sum(t4.values())}


def host_per_step(timed: dict) -> float:
    """The timed pass's wall time per step 3..N, less CUDA-graph captures inside them (module
    docstring, step 2): the H200 host time per step (an upper bound)."""
    steps = _timed_steps(timed)
    wall = timed.get("train_excl_first2_s")
    if not steps or not wall:
        raise ValueError("the timed pass has no timed steps")
    captures = (timed.get("cuda_graphs") or {}).get("capture_s_excl_first2") or 0.0
    return (wall - captures) / steps


def used_graphs(timed: dict) -> bool:
    """Whether the run's timed pass replayed CUDA graphs (it captured at least one)."""
    return bool((timed.get("cuda_graphs") or {}).get("captures"))


T4 = t4_machine("H200")  # the machine project() targets from H200 runs
BASELINE_HOST = ("the baseline's host time per step (upper bound: this run's eager host time is not measured; "
                 "bench.compare's run shipped-graphs-off measures it)")


def project_run(timed: dict, profiled: dict, eager_host_measured: float | None = None, steps: int = 64,
                eager_profiled: dict | None = None, eager_host_source: str | None = None,
                machine: dict | None = None) -> dict:
    """One run on a T4 (or ``machine``: {"scale": per-class factors, "host_factor"}), uncalibrated.
    ``eager_host_measured``: the measured machine's host time per step without graphs, for a run whose timed pass
    used graphs (None: its own wall time is the eager one), and ``eager_host_source`` where it came
    from (default: the baseline's, BASELINE_HOST). ``eager_profiled``: for such a run, its profiled
    pass with graphs off (the GPU work of the eager step, which the T4 runs where decide() says
    off); None: the graphs profile stands in."""
    machine = T4 if machine is None else machine
    gpu = gpu_split(profiled, machine["scale"])
    host = host_per_step(timed)
    graphs = used_graphs(timed)
    eager_gpu = gpu
    if graphs:
        host_graphs, host_eager = host, eager_host_measured
        eager_source = eager_host_source or BASELINE_HOST
        if eager_profiled is not None:
            eager_gpu = gpu_split(eager_profiled, machine["scale"])
            eager_gpu_source = "this run's profiled pass with graphs off (SOLUTION_CUDA_GRAPHS=0)"
        else:
            eager_gpu_source = ("the graphs pass's profile (upper bound: it includes the buckets' filler "
                                "tokens; no profiled pass with graphs off)")
    else:
        host_graphs, host_eager = None, host
        eager_source = "this run's timed wall time per step (no CUDA graphs)"
        eager_gpu_source = "this run's profiled pass (no CUDA graphs)"
    if host_eager is None:
        raise ValueError("a run with CUDA graphs needs the eager host time (eager_host_measured)")
    t4_gpu_graphs = gpu["t4_gpu_s_per_step"] if graphs else None
    t4_gpu_eager = eager_gpu["t4_gpu_s_per_step"]
    t4_eager = host_eager * machine["host_factor"]
    t4_graphs = None if host_graphs is None else host_graphs * machine["host_factor"]
    # decide() on the T4 times the eager step: graphs stay off where it is GPU-bound
    graphs_on_t4 = t4_graphs is not None and not (t4_gpu_eager > GPU_BOUND_RATIO * t4_eager)
    t4_host, t4_gpu, used = ((t4_graphs, t4_gpu_graphs, gpu) if graphs_on_t4 else (t4_eager, t4_gpu_eager, eager_gpu))
    step = max(t4_host, t4_gpu)
    return {
        "measured": {"gpu_s_per_step": gpu["measured_gpu_s_per_step"], "by_class_s_per_step": gpu["measured_s_per_step"],
                 "gpu_eager_s_per_step": eager_gpu["measured_gpu_s_per_step"],
                 "host_s_per_step": host, "host_eager_s_per_step": host_eager,
                 "host_graphs_s_per_step": host_graphs, "graphs": graphs, "host_eager_source": eager_source,
                 "gpu_eager_source": eager_gpu_source, "profiled_steps": gpu["profiled_steps"]},
        "t4": {"gpu_s_per_step": t4_gpu, "by_class_s_per_step": used["t4_s_per_step"],
               "gpu_eager_s_per_step": t4_gpu_eager, "gpu_graphs_s_per_step": t4_gpu_graphs,
               "host_eager_s_per_step": t4_eager, "host_graphs_s_per_step": t4_graphs,
               "graphs": graphs_on_t4, "host_s_per_step": t4_host, "step_s": step,
               "bound": "GPU" if t4_gpu >= t4_host else "host"},
        "steps": steps,
        "train_s_raw": step * steps,
    }


EAGER_RUN = "shipped-graphs-off"  # bench/runs.py: the solution timed with SOLUTION_CUDA_GRAPHS=0


def solution_eager_host(base_timed: dict, sol_eager_timed: dict | None,
                        eager_run: str = EAGER_RUN) -> tuple[float, str]:
    """The solution's H200 host time per step without graphs and where it came from: its own
    timed run with graphs off (``sol_eager_timed``, run ``eager_run``: on the H200 that eager step
    is host-bound, its wall time per step is its host time), else the baseline's (BASELINE_HOST).
    A graphs-off run that captured graphs anyway (the setting did not take) is not used."""
    if sol_eager_timed and _timed_steps(sol_eager_timed) and sol_eager_timed.get("train_excl_first2_s") \
            and not used_graphs(sol_eager_timed):
        return host_per_step(sol_eager_timed), (
            f"the solution's own eager step: run {eager_run}'s timed pass (SOLUTION_CUDA_GRAPHS=0), its wall "
            "time per step 3-N (host-bound on the measured machine)")
    return host_per_step(base_timed), BASELINE_HOST


def skipped(base_timed, base_prof, sol_timed, sol_prof, device: str | None = None,
            shape: str = "shipped") -> str | None:
    """Why no projection can be made from these runs (None: it can)."""
    if shape != "shipped":
        return (f"the report's main run is {shape}, not shipped; the official baseline's figures are the shipped "
                "data's at the defaults")
    if device is not None and source_of(device) is None:
        return (f"these runs were measured on {'the CPU' if device == 'cpu' else device}, and the model turns "
                f"{' or '.join(SOURCES)} (SXM) measurements into T4 estimates (a run on a real T4 needs no "
                "projection)")
    for label, r in (("baseline", base_prof), ("solution", sol_prof)):
        if not r or not (r.get("profile") or {}).get("kernel_times_s"):
            return f"there is no profiled pass of the {label} (its GPU kernel times are the model's input)"
        if not _timed_steps(r):
            return f"the {label}'s profiled pass has no steps after the first two"
    for label, r in (("baseline", base_timed), ("solution", sol_timed)):
        if not r or not _timed_steps(r) or not r.get("train_excl_first2_s"):
            return f"there are no timed steps of the {label}"
    return None


def project(base_timed: dict, base_prof: dict, sol_timed: dict, sol_prof: dict, steps: int = 64,
            device: str | None = None, shape: str = "shipped", sol_prof_eager: dict | None = None,
            sol_eager_timed: dict | None = None) -> dict:
    """Both runs on a T4, calibrated against the official baseline (module docstring). Returns
    {"model", "skipped": why} when the runs cannot be projected (no profile, neither an H200 nor an H100, another
    shape than the shipped one). ``sol_prof_eager``: the solution's profiled pass with graphs off
    (None: its graphs profile stands in, an upper bound). ``sol_eager_timed``: the solution's timed
    run with graphs off (run shipped-graphs-off), whose wall time per step is its eager host time
    (None: the baseline's stands in, an upper bound)."""
    why = skipped(base_timed, base_prof, sol_timed, sol_prof, device, shape)
    if why:
        return {"model": LABEL, "skipped": why}
    source = source_of(device) or "H200"
    machine = t4_machine(source)
    base = project_run(base_timed, base_prof, steps=steps, machine=machine)
    if sol_prof_eager is not None and not (sol_prof_eager.get("profile") or {}).get("kernel_times_s"):
        sol_prof_eager = None
    eager_host, eager_source = solution_eager_host(base_timed, sol_eager_timed)
    sol = project_run(sol_timed, sol_prof, eager_host_measured=eager_host, steps=steps,
                      eager_profiled=sol_prof_eager, eager_host_source=eager_source, machine=machine)
    factor = OFFICIAL_BASELINE_TRAIN_S / base["train_s_raw"]
    error = base["train_s_raw"] / OFFICIAL_BASELINE_TRAIN_S - 1
    for r in (base, sol):
        r["calibrated_step_s"] = r["t4"]["step_s"] * factor
        r["train_s_calibrated"] = r["train_s_raw"] * factor
    tokens = base_timed.get("tokens_total")
    mem = base_timed.get("peak_mem_allocated_bytes")
    return {
        "model": LABEL,
        "source": source,
        "baseline_train_s": base["train_s_calibrated"],
        "solution_train_s": sol["train_s_calibrated"],
        "baseline_train_s_raw": base["train_s_raw"],
        "solution_train_s_raw": sol["train_s_raw"],
        "calibration_factor": factor,
        "calibration_error": error,
        "calibration": (f"one factor {factor:.3f} = {OFFICIAL_BASELINE_TRAIN_S:.0f} s (official T4 baseline, "
                        f"{steps} steps) / {base['train_s_raw']:.1f} s (raw projected baseline), applied to "
                        f"both runs; raw model error on the baseline {error:+.1%}"),
        "steps": steps,
        "speedup": base["train_s_raw"] / sol["train_s_raw"],
        "baseline": base,
        "solution": sol,
        "checks": {  # the official baseline's other figures beside this run's (not part of the model)
            "baseline_tokens_per_s_at_official_time": tokens / OFFICIAL_BASELINE_TRAIN_S if tokens else None,
            "official_tokens_per_s": OFFICIAL_BASELINE_TOKENS_PER_S,
            "baseline_peak_allocated_gb": mem / 1e9 if mem else None,
            "official_memory_gb": OFFICIAL_BASELINE_MEMORY_GB,
        },
        "constants": {"flop_scale": machine["scale"][FLOP], "memory_scale": machine["scale"][MEMORY],
                      "pcie_scale": PCIE_SCALE,
                      "kaggle_cpu_factor": KAGGLE_CPU_FACTOR, "t4_flop_fraction": T4_FLOP_FRACTION,
                      "t4_bw_fraction": T4_BW_FRACTION, "hopper_flop_fraction": HOPPER_FLOP_FRACTION,
                      "hopper_bw_fraction": HOPPER_BW_FRACTION},
    }


PARTITION_RUN = "gpu-bound-sm8"  # bench/runs.py: the nearest a T4 that can be measured


def against_partition(proj: dict | None, entry: dict | None, run: str = PARTITION_RUN) -> dict | None:
    """The projection's solution / baseline beside the one the 8-SM partition measured (``entry``: that
    run's report entry or summary.json entry; the median of its pairs where repeated), and how far apart
    (projected / measured - 1). ``proj``: the report's projection or its summary.json form (which
    carries the raw trainings, not the speedup). None when either side is missing."""
    if not proj or proj.get("skipped") or not entry:
        return None
    measured = (entry.get("repeats") or {}).get("steps_ratio_median")
    if measured is None:
        measured = (entry.get("ratios") or {}).get("train_excl_first2_s")
    if not measured:
        return None
    speedup = proj.get("speedup") or proj["baseline_train_s_raw"] / proj["solution_train_s_raw"]
    projected = 1 / speedup
    return {"run": run, "projected_ratio": projected, "measured_ratio": measured,
            "difference": projected / measured - 1}


def section(proj: dict | None) -> list[str]:
    """The report's Markdown lines for a projection (bench/report.py)."""
    out = [f"## {LABEL}", ""]
    if not proj:
        return out + ["Not projected: this report was made before bench/t4_projection.py.", ""]
    if proj.get("skipped"):
        return out + [f"Not projected: {proj['skipped']}.", ""]
    c = proj["constants"]
    out += [f"A roofline model (bench/t4_projection.py; its docstring states every assumption), not a T4 "
            f"run: each profiled kernel's {proj.get('source', 'H200')} time scaled by its bound (FLOP-bound GEMMs and attention "
            f"x{c['flop_scale']:.1f}, memory-bound kernels x{c['memory_scale']:.1f}, host transfers "
            f"x{c['pcie_scale']:.0f}), the host time per step (timed pass) x{c['kaggle_cpu_factor']:g} "
            "for a Kaggle CPU, step = max(host, GPU); calibrated on the official T4 baseline "
            f"({OFFICIAL_BASELINE_TRAIN_S:.0f} s for {proj['steps']} steps).", "",
            "| run | T4 GPU s/step | T4 host s/step | graphs on T4 | step s (bound) | "
            f"{proj['steps']}-step training, raw (s) | calibrated (s) |",
            "| --- | ---: | ---: | --- | ---: | ---: | ---: |"]
    for variant in ("baseline", "solution"):
        r = proj[variant]
        t4 = r["t4"]
        out.append(f"| {variant} | {t4['gpu_s_per_step']:.3f} | {t4['host_s_per_step']:.3f} | "
                   f"{'on' if t4['graphs'] else 'off'} | {t4['step_s']:.3f} ({t4['bound']}) | "
                   f"{r['train_s_raw']:.1f} | **{r['train_s_calibrated']:.1f}** |")
    chk = proj["checks"]
    tok = chk.get("baseline_tokens_per_s_at_official_time")
    mem = chk.get("baseline_peak_allocated_gb")
    out += ["", f"Calibration: {proj['calibration']}. Projected solution / baseline: "
            f"{1 / proj['speedup']:.3f} ({proj['speedup']:.2f}x faster).",
            *([_against_line(proj["against"])] if proj.get("against") else []),
            f"Solution's host time without graphs: {proj['solution']['measured']['host_eager_source']}.",
            *([f"Solution's GPU time without graphs: {proj['solution']['measured']['gpu_eager_source']}."]
              if proj['solution']['measured'].get('gpu_eager_source') else []),
            "Beside the official baseline's other figures (not part of the model): this run's tokens at "
            f"{OFFICIAL_BASELINE_TRAIN_S:.0f} s give {'n/a' if tok is None else f'{tok:.0f}'} tokens/s "
            f"(official ~{OFFICIAL_BASELINE_TOKENS_PER_S:.0f}); peak allocated "
            f"{'n/a' if mem is None else f'{mem:.1f}'} GB (official ~{OFFICIAL_BASELINE_MEMORY_GB:.0f} GB).", ""]
    return out


def _against_line(a: dict) -> str:
    return (f"Checked against run {a['run']} (measured, not a model: the nearest a T4): steps 3-N solution / "
            f"baseline {a['measured_ratio']:.3f} there, {a['projected_ratio']:.3f} projected; the projection is "
            f"{abs(a['difference']):.0%} {'above' if a['difference'] >= 0 else 'below'} the measurement.")


def summary(proj: dict | None) -> dict | None:
    """summary.json's "t4_projection": the calibrated times, the calibration, the raw figures and
    each run's step (None: not in the report)."""
    if not proj:
        return None
    if proj.get("skipped"):
        return {"model": proj["model"], "skipped": proj["skipped"]}
    keys = ("baseline_train_s", "solution_train_s", "calibration", "baseline_train_s_raw", "solution_train_s_raw",
            "calibration_factor", "calibration_error", "steps", "model")
    out = {k: proj[k] for k in keys}
    for key in ("source", "against"):
        if proj.get(key):
            out[key] = proj[key]
    for variant in ("baseline", "solution"):
        t4 = proj[variant]["t4"]
        out[variant] = {"gpu_s_per_step": t4["gpu_s_per_step"], "host_s_per_step": t4["host_s_per_step"],
                        "graphs": t4["graphs"], "step_s": t4["step_s"], "bound": t4["bound"]}
    for key in ("gpu_eager_source", "host_eager_source"):
        src = proj["solution"]["measured"].get(key)
        if src:
            out["solution"][key] = src
    return out


def console_line(proj: dict | None) -> str:
    """bench.compare's printed summary line: one plain sentence, what a T4 would take by the model
    (calibrated), and how far the bare model was from the official baseline; or why there is no
    projection."""
    if not proj:
        return f"{LABEL}: not made (this report is older than the projection)."
    if proj.get("skipped"):
        return f"{LABEL}: not made, because {proj['skipped']}."
    err = proj["calibration_error"]
    return (f"{LABEL}: on a T4, {proj['steps']} training steps would take about {proj['baseline_train_s']:.1f} s "
            f"with the baseline and {proj['solution_train_s']:.1f} s with the solution, after scaling both so "
            f"that the baseline matches the official T4 figure of {OFFICIAL_BASELINE_TRAIN_S:.0f} s (before "
            f"scaling the model gave {proj['baseline_train_s_raw']:.1f} s and {proj['solution_train_s_raw']:.1f} s, "
            f"{abs(err):.1%} {'above' if err >= 0 else 'below'} the official figure).")


# --- the same model, pointed at a measured machine: an SM partition of the same GPU ---------------

def partition_machine(rates: dict) -> dict:
    """The model's constants for an SM partition (bench/partition.py's measured rates: {"whole":
    {"matmul_tflops", "copy_gbs"}, "partition": {...}}): FLOP-bound kernels scaled by the whole
    GPU's matmul rate over the partition's, memory-bound ones by the copy rates' ratio, transfers
    and host unchanged (the same link and CPU)."""
    whole, part = rates["whole"], rates["partition"]
    return {"name": "partition", "host_factor": 1.0,
            "scale": {FLOP: whole["matmul_tflops"] / part["matmul_tflops"], MEMORY: whole["copy_gbs"] / part["copy_gbs"],
                      TRANSFER: 1.0}}


def _gpu_per_step(profiled: dict | None) -> float | None:
    if not profiled or not (profiled.get("profile") or {}).get("kernel_times_s") or not _timed_steps(profiled):
        return None
    return sum(profiled["profile"]["kernel_times_s"].values()) / _timed_steps(profiled)


def predict_partition(whole: dict, rates: dict, measured: dict, steps: int = 64,
                      eager_run: str = EAGER_RUN) -> dict:
    """The model's prediction for an SM partition beside the partition's measurement. ``whole``:
    the whole-GPU shipped runs' results ({"baseline", "solution", "baseline-profiled",
    "solution-profiled"}, optionally "solution-profiled-eager" and "solution-graphs-off": the
    timed run with graphs off); ``rates``: the partition's measured rates (partition_machine);
    ``measured``: the partition run's results ({"baseline", "solution"}, optionally their
    "-profiled" passes). Returns {"skipped": why} when an input is missing."""
    need = ("baseline", "solution", "baseline-profiled", "solution-profiled")
    missing = [k for k in need if not whole.get(k)]
    if missing:
        return {"skipped": f"no whole-GPU shipped {missing[0]} pass in this report (the prediction's input: run "
                           "shipped in the same call, or assemble the calls with bench.rebuild_report)"}
    if not rates or not rates.get("whole") or not rates.get("partition"):
        return {"skipped": "the partition's rates were not measured"}
    why = skipped(whole["baseline"], whole["baseline-profiled"], whole["solution"], whole["solution-profiled"])
    if why:
        return {"skipped": why}
    machine = partition_machine(rates)
    eager_prof = whole.get("solution-profiled-eager")
    if eager_prof is not None and not (eager_prof.get("profile") or {}).get("kernel_times_s"):
        eager_prof = None
    eager_host, eager_source = solution_eager_host(whole["baseline"], whole.get("solution-graphs-off"), eager_run)
    runs = {"baseline": project_run(whole["baseline"], whole["baseline-profiled"], steps=steps, machine=machine),
            "solution": project_run(whole["solution"], whole["solution-profiled"], eager_host_measured=eager_host,
                                    steps=steps, eager_profiled=eager_prof, eager_host_source=eager_source,
                                    machine=machine)}
    out = {"model": "bench/t4_projection.py with the partition's measured rates (no calibration)",
           "constants": {"flop_scale": machine["scale"][FLOP], "memory_scale": machine["scale"][MEMORY],
                         "host_factor": 1.0, "pcie_scale": 1.0},
           "solution_host_eager_source": eager_source}
    for variant, r in runs.items():
        t = r["t4"]
        got = measured.get(variant) or {}
        timed = max(len(got.get("step_times_s") or []) - SKIP_STEPS, 0)
        predicted = t["step_s"] * (timed or steps - SKIP_STEPS)
        meas = got.get("train_excl_first2_s")
        out[variant] = {"gpu_s_per_step": t["gpu_s_per_step"], "host_s_per_step": t["host_s_per_step"],
                        "graphs": t["graphs"], "step_s": t["step_s"], "bound": t["bound"],
                        "steps_3_n_s": predicted, "measured_steps_3_n_s": meas,
                        "measured_gpu_s_per_step": _gpu_per_step(measured.get(f"{variant}-profiled")),
                        "measured_graphs": used_graphs(got) if got else None,
                        "error": (predicted / meas - 1) if meas else None}
    b, s = out["baseline"], out["solution"]
    out["ratio"] = {"predicted": s["steps_3_n_s"] / b["steps_3_n_s"],
                    "measured": (s["measured_steps_3_n_s"] / b["measured_steps_3_n_s"]
                                 if s["measured_steps_3_n_s"] and b["measured_steps_3_n_s"] else None)}
    return out


def partition_section(pred: dict | None) -> list[str]:
    """The report's lines for predict_partition's result."""
    if not pred:
        return []
    if pred.get("skipped"):
        return [f"Model prediction for the partition: not made ({pred['skipped']}).", ""]
    c = pred["constants"]

    def fmt(v, spec=".3f"):
        return "n/a" if v is None else format(v, spec)

    out = [f"Model prediction (bench/t4_projection.py, its constants the partition's measured rates: FLOP-bound "
           f"kernels x{c['flop_scale']:.2f}, memory-bound x{c['memory_scale']:.2f}, host x1; from the whole-GPU "
           "shipped runs of this report, not calibrated) beside the partition's measurement:", "",
           "| variant | predicted GPU s/step | measured GPU s/step | predicted host s/step | graphs predicted / "
           "measured | predicted step s (bound) | predicted steps 3-N (s) | measured steps 3-N (s) | error |",
           "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for variant in ("baseline", "solution"):
        r = pred[variant]
        graphs = f"{'on' if r['graphs'] else 'off'} / " + ("n/a" if r["measured_graphs"] is None else
                                                            "on" if r["measured_graphs"] else "off")
        out.append(f"| {variant} | {fmt(r['gpu_s_per_step'])} | {fmt(r['measured_gpu_s_per_step'])} | "
                   f"{fmt(r['host_s_per_step'])} | {graphs} | {fmt(r['step_s'])} ({r['bound']}) | "
                   f"{fmt(r['steps_3_n_s'], '.2f')} | {fmt(r['measured_steps_3_n_s'], '.2f')} | "
                   f"{fmt(r['error'], '+.1%')} |")
    ratio = pred["ratio"]
    out += ["", f"Solution / baseline, steps 3-N: predicted {ratio['predicted']:.3f}, measured "
            f"{fmt(ratio['measured'])}. The solution's eager host time: {pred['solution_host_eager_source']}.", ""]
    return out
