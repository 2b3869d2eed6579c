"""One real Soup training run in this process, measured. Used by bench.compare, one fresh
process per run, so patches and allocator state never leak from one run into another.

    python -m bench.run_one --variant baseline|solution --model DIR --data FILE --workdir DIR [--profile]

What it does: (solution only) calls solution.apply(); adds a measurement callback to every
transformers Trainer built in this process (the same for baseline and solution: it only reads
clocks, logs and memory counters); renders the workload into a Soup YAML and runs
`soup train --config <yaml> --yes` in-process through Soup's own CLI; then reads back Soup's
SQLite tracker and output files, and writes result.json into the workdir. result.json holds, for
bench.rules' comparison with the baseline, every Trainer log row, the fp16 GradScaler's decisions
(skipped_steps: the 1-based steps whose optimizer step it skipped; scaler_scales: its scale after
each step, null without a GradScaler) and rewind.jsonl's rows (outputs.rewind).
With BENCH_DETERMINISTIC=1 in the environment (diagnosis only), PyTorch's deterministic algorithms
are on (warn_only), to check whether two runs of the same code give the same bits.
With --host-split FILE, the wall time of steps 3..end is split by Trainer phase (bench/host_split.py).
With --compile-log FILE, every Triton JIT compile is logged with its step and duration (bench/compile_log.py).
With --memory-peak FILE, the allocator history is recorded and what is alive at the peak is
written to FILE (bench/memory_peak.py).
With --profile, torch.profiler records GPU kernels from step 3 to the end (a separate pass:
the timed runs are never profiled).
With --sms N, every CUDA stream of this process comes from one green context of N SMs (a GPU-bound
machine on a big GPU; bench/partition.py) from the moment Soup builds its Trainer (the model is
loaded and quantized by then) to the end of Soup's run; measured before Soup starts (entered,
measured, left): the partition's and the whole GPU's matmul and copy rates, and a GEMM on every
path a step uses (result.json: "partition"). Not earlier: with the model loaded inside the
partition, gpu-bound-sm16's baseline logged loss 0 and grad_norm NaN at every step in two calls in
a row (H200), and a model loaded and quantized inside it gave non-finite hidden
states from the fourth layer's output on, while the same model loaded on the whole GPU and run
inside the partition gave the whole GPU's loss. The cause, read in bitsandbytes 0.50.2
(backends/cuda/ops.py): its quantize kernels (`quantize_4bit`, `quantize_blockwise`) take no
stream argument and run on the legacy default stream, while the tensors they read and write are
made on the current stream, the partition's, which does not wait for the default stream (a green
context's streams are non-blocking); its dequantize kernels take the current stream, so training
is not affected. Loading is not part of the steps timed.
"""
from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import time
from pathlib import Path

SKIP_STEPS = 2  # the challenge measures training time excluding the first two steps


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _pools():
    """Reserved / allocated bytes per allocator pool at the end of training (bench/memory_peak.py)."""
    import torch

    if not torch.cuda.is_available():
        return None
    from bench import memory_peak

    segments = torch.cuda.memory_snapshot()
    memory_peak.remember_private_ranges(segments)  # for --memory-peak's replay (the graphs may be gone by then)
    return memory_peak.pool_split(segments)


class StepClock:
    """Trainer callback: step end times (after a device sync), logs, optional profiler."""

    def __init__(self, profile: bool, cprofile=None, host_split=None, cprofile_steps=(SKIP_STEPS + 1, None),
                 op_origins=None):
        from transformers import TrainerCallback

        clock = self

        class _CB(TrainerCallback):
            def on_train_begin(self, args, state, control, **kw):
                _sync()
                clock.t_begin = time.perf_counter()

            def on_step_begin(self, args, state, control, **kw):
                if clock.host_split is not None and not clock.host_split.marks:
                    clock.host_split.attach_late(clock.trainer, kw.get("model"))
                if clock.profile and state.global_step == SKIP_STEPS and clock.prof is None:
                    clock.start_profiler()
                if clock.cprofile is not None and state.global_step == clock.cprofile_steps[0] - 1:
                    clock.cprofile.enable()  # host time of the chosen steps only (default 3..end)
                if clock.op_origins is not None and state.global_step == SKIP_STEPS and clock.origins_prof is None:
                    from bench import op_origins

                    clock.origins_prof = op_origins.start()

            def on_step_end(self, args, state, control, **kw):
                _sync()
                clock.note_scaler(state.global_step)
                last = clock.cprofile_steps[1]
                if clock.cprofile is not None and last is not None and state.global_step == last:
                    clock.cprofile.disable()
                clock.step_ends.append(time.perf_counter())
                if clock.host_split is not None:
                    clock.host_split.mark()
                clock.stop_origins(state.global_step)

            def on_log(self, args, state, control, logs=None, **kw):
                clock.logs.append({"step": state.global_step, **(logs or {})})

            def on_train_end(self, args, state, control, **kw):
                _sync()
                clock.t_end = time.perf_counter()
                clock.pools = _pools()
                clock.stop_profiler()
                clock.stop_origins(None)
                if clock.cprofile is not None:
                    clock.cprofile.disable()

        self.callback = _CB()
        self.op_origins = op_origins  # --op-origins FILE (bench/op_origins.py)
        self.origins_prof = None
        self.profile = profile
        self.cprofile = cprofile
        self.cprofile_steps = cprofile_steps
        self.host_split = host_split
        self.trainer = None
        self.linear4bit_layers = None  # NF4 layers of the trained model (count_linear4bit)
        self.prof = None
        self.t_begin = self.t_end = None
        self.pools = None
        self.step_ends: list[float] = []
        self.logs: list[dict] = []
        self.skipped_steps: list[int] = []  # 1-based steps whose optimizer step the GradScaler skipped
        self.scaler_scales: list[float | None] = []  # the GradScaler's scale after each step
        self.kernel_times: dict[str, float] = {}

    def note_scaler(self, step: int) -> None:
        """After optimizer step ``step`` (1-based): whether the GradScaler skipped it, and its scale."""
        skipped, scale = scaler_state(self.trainer)
        if skipped:
            self.skipped_steps.append(step)
        self.scaler_scales.append(scale)

    def start_profiler(self):
        import torch
        from torch.profiler import ProfilerActivity, profile

        # GPU kernels only: CPU-side events would slow the host and add nothing to the split.
        acts = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
        self.prof = profile(activities=acts, record_shapes=False, with_stack=False)
        self.prof.__enter__()
        self.t_prof_begin = time.perf_counter()

    def stop_profiler(self):
        if self.prof is None or getattr(self, "t_prof_end", None):
            return
        _sync()
        self.t_prof_end = time.perf_counter()
        self.prof.__exit__(None, None, None)
        from torch.autograd import DeviceType

        times: dict[str, float] = {}
        for evt in self.prof.events():
            if evt.device_type == DeviceType.CUDA:
                dt_us = evt.time_range.elapsed_us()
                times[evt.name] = times.get(evt.name, 0.0) + float(dt_us) / 1e6
        self.kernel_times = times

    def stop_origins(self, step: int | None) -> None:
        """After ORIGIN_STEPS profiled steps (or at the end of training): write --op-origins' table."""
        from bench import op_origins

        if self.origins_prof is None or (step is not None and step < SKIP_STEPS + op_origins.ORIGIN_STEPS):
            return
        _sync()
        steps = (step if step is not None else SKIP_STEPS + op_origins.ORIGIN_STEPS) - SKIP_STEPS
        rows = op_origins.stop(self.origins_prof, steps)
        self.origins_prof = None
        Path(self.op_origins).write_text(op_origins.format_rows(rows, steps) + "\n", encoding="utf-8")
        Path(self.op_origins).with_suffix(".json").write_text(json.dumps(rows, indent=1), encoding="utf-8")

    def step_times(self) -> list[float]:
        out, prev = [], self.t_begin
        for t in self.step_ends:
            out.append(t - prev)
            prev = t
        return out


def scaler_state(trainer) -> tuple[bool, float | None]:
    """The last optimizer step as accelerate saw it: whether the fp16 GradScaler skipped it (it
    found an inf or NaN gradient and did not call the optimizer: accelerate's
    optimizer_step_was_skipped, the signal the Trainer itself uses to hold the LR schedule back)
    and the scale the GradScaler holds after its update (it halves the scale at each skip).
    (False, None) without a GradScaler (fp32 or bf16 training, e.g. Soup on a CPU)."""
    acc = getattr(trainer, "accelerator", None)
    scaler = getattr(acc, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return False, None
    return bool(acc.optimizer_step_was_skipped), float(scaler.get_scale())


def emulate_t4_paths() -> str | None:
    """Make a newer GPU take the T4's code paths for precision and attention (harness only,
    both variants).

    Precision: Soup picks bf16 where the card has bf16 units (sm_80+) and fp16 on a T4. The
    challenge workload is the T4's: fp16 autocast + GradScaler, bnb compute dtype fp16, fp16
    load dtype. We answer Soup's one capability question, soup_cli.utils.gpu.cuda_supports_bf16(),
    with False, so that every decision downstream of it is the T4's.
    Attention: PyTorch's SDPA has flash and cuDNN backends only on sm_80+; on a T4 it runs the
    memory-efficient (or math) backend. We switch the sm_80+-only backends off, so both runs use
    the attention kernels a T4 uses (cuDNN also rebuilds an execution plan for every new
    sequence length, a host cost a T4 never pays).
    Returns a description, or None when nothing needed changing.
    """
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        return None
    import soup_cli.utils.gpu as soup_gpu

    soup_gpu.cuda_supports_bf16 = lambda: False
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    return (f"{torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))}) "
            "made to take the T4's paths: fp16 autocast, fp16 compute and load dtype (Soup), "
            "SDPA memory-efficient/math backends only (flash and cuDNN attention off)")


def install_clock(clock: StepClock, on_trainer=None):
    """Add our callback to every Trainer built from now on (measurement only, both variants).
    ``on_trainer``: called with no arguments as each Trainer is about to be built (before its
    ``__init__``), or None. Returns a function that takes it off again (for callers that go on in
    the same process)."""
    import transformers

    orig_init = transformers.Trainer.__init__

    def init_with_clock(self, *a, **kw):
        if on_trainer is not None:
            on_trainer()
        orig_init(self, *a, **kw)
        self.add_callback(clock.callback)
        clock.trainer = self
        clock.linear4bit_layers = count_linear4bit(self.model)
        if clock.host_split is not None:
            clock.host_split.attach(self)

    transformers.Trainer.__init__ = init_with_clock

    def uninstall():
        transformers.Trainer.__init__ = orig_init
    return uninstall


def count_linear4bit(model) -> int | None:
    """The bitsandbytes Linear4bit (NF4) layers of the model a Trainer trains (peft's LoRA layers
    hold one as their base layer). 0: Soup trained without 4-bit quantization (it switches 4-bit
    off on a CPU); None: no model. Read by class name, so bitsandbytes is never imported here."""
    if model is None:
        return None
    return sum(1 for m in model.modules()
               if any(c.__name__ == "Linear4bit" and c.__module__.startswith("bitsandbytes")
                      for c in type(m).__mro__))


def cuda_graph_summary(step_ends: list[float]) -> dict:
    """The solution's decoder CUDA-graph captures (solution/step/cuda_graphs.py) with the training
    step each fell in (1-based, from the step clock's end times), and their seconds in the steps
    that the timed figures count (after the first SKIP_STEPS)."""
    from solution.step import cuda_graphs

    st = cuda_graphs.stats()
    for c in st["captures"]:
        start = c.pop("t")
        c["step"] = 1 + sum(1 for t in step_ends if t <= start)
    st["capture_s_excl_first2"] = sum(c["seconds"] for c in st["captures"] if c["step"] > SKIP_STEPS)
    return st


def precompile_summary(clock) -> dict:
    """The solution's background precompile (solution/precompile.py): entries, done, failed, its
    seconds, and whether it had finished when training began."""
    from solution import precompile

    st = precompile.wait(timeout=0)
    finished, started, begin = st.get("finished_t"), st.get("started_t"), clock.t_begin
    st["finished_before_training"] = None if finished is None or begin is None else finished <= begin
    # seconds from the precompile's start to training's, and from training's start to its end
    # (negative: it had finished before training began)
    st["start_to_training_s"] = None if started is None or begin is None else begin - started
    st["training_to_finish_s"] = None if finished is None or begin is None else finished - begin
    return st


def partition_unsupported(num_sms: int | None) -> str | None:
    """--sms: why this machine cannot run in an N-SM partition (bench/partition.py), None if it can
    or no partition was asked for."""
    if num_sms is None:
        return None
    from bench.partition import unsupported

    return unsupported(num_sms)


def measure_partition(num_sms: int | None):
    """--sms N: the green context of N SMs (bench/partition.py), entered, measured (rates and
    held-check) and left again, before Soup starts (so the check's seconds are not in Soup's
    duration); the run enters it again for training (``Partition.enter``, the same green
    context) when Soup builds its Trainer, after the model is loaded (the module docstring says
    why not before). None without --sms."""
    if num_sms is None:
        return None
    from bench.partition import Partition

    partition = Partition(num_sms).enter()
    figures = partition.measure()
    partition.exit()
    hc = figures["held_check"]
    print(f"[run_one] {num_sms}-SM partition: matmul {figures['rates']['partition']['matmul_tflops']:.1f} of "
          f"{figures['rates']['whole']['matmul_tflops']:.0f} TFLOP/s; held on every path: {hc['held']}", flush=True)
    return partition


def read_tracker(db_path: Path) -> dict:
    if not db_path.exists():
        return {"error": f"tracker database missing: {db_path}"}
    con = sqlite3.connect(str(db_path))
    con.row_factory = sqlite3.Row
    runs = [dict(r) for r in con.execute("select * from runs order by created_at")]
    metrics = [dict(r) for r in con.execute("select * from metrics order by id")]
    con.close()
    for r in runs:
        r.pop("config_json", None)
    return {"runs": runs, "metrics": metrics}


def output_files(out_dir: Path) -> dict:
    want = ["adapter_model.safetensors", "adapter_config.json", "tokenizer_config.json", "rewind.jsonl"]
    present = {name: (out_dir / name).exists() for name in want}
    rewind = read_rewind(out_dir / "rewind.jsonl")
    rewind_rows = len(rewind) if rewind is not None else 0
    keys = []
    st = out_dir / "adapter_model.safetensors"
    if st.exists():
        from safetensors import safe_open

        with safe_open(str(st), "pt") as f:
            keys = sorted(f.keys())
    return {"present": present, "adapter_keys": keys, "rewind_rows": rewind_rows, "rewind": rewind,
            "dir": str(out_dir)}


def read_rewind(path: Path) -> list[dict] | None:
    """Soup's rewind.jsonl, one dict a line (its header, then a row per micro-batch: step, micro,
    dataset rows, per-row loss and token count), for bench.rules' row-by-row comparison; None when
    the file is missing. A line that is not a JSON object is kept as {"kind": "unreadable"}."""
    if not path.exists():
        return None
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            rows.append(row if isinstance(row, dict) else {"kind": "unreadable", "text": line[:200]})
    return rows


def parse_steps(text: str) -> tuple[int, int | None]:
    """'FIRST-LAST' (1-based, inclusive; LAST may be 'end') -> (first, last or None)."""
    first, sep, last = text.partition("-")
    try:
        lo = int(first)
        hi = None if not sep or last in ("", "end") else int(last)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want FIRST-LAST steps such as 1-1 or 3-end, got {text!r}") from None
    if lo < 1 or (hi is not None and hi < lo):
        raise argparse.ArgumentTypeError(f"want 1 <= FIRST <= LAST, got {text!r}")
    return lo, hi


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.run_one", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", choices=["baseline", "solution"], required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--workload", default=None, help="workload YAML (default: workload/workload.yaml)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--cprofile", help="write a cProfile summary of the host (Python) time of steps 3..end to this file")
    ap.add_argument("--cprofile-steps", type=parse_steps, default=(SKIP_STEPS + 1, None), metavar="FIRST-LAST",
                    help="the steps --cprofile covers, 1-based and inclusive (default 3-end; e.g. 1-1: the first step)")
    ap.add_argument("--host-split", help="write where the wall time of steps 3..end goes, phase by phase "
                    "(Trainer phases and the decoder forward; bench/host_split.py) to this file")
    ap.add_argument("--compile-log", help="write which Triton kernels compiled in which step and how long each "
                    "took (bench/compile_log.py) to this file (+ a .json beside it)")
    ap.add_argument("--memory-peak", help="record the allocator history and write what is alive at the peak "
                    "(grouped by allocating line) to this file (a separate pass: it slows the host)")
    ap.add_argument("--op-origins", help="profile steps 3-5 with CPU ops and Python stacks and write which line "
                    "launches each GPU kernel, with its GPU time (bench/op_origins.py; a separate pass: it slows the "
                    "host; run it with SOLUTION_CUDA_GRAPHS=0)")
    ap.add_argument("--native-precision", action="store_true",
                    help="on an sm_80+ GPU keep Soup's bf16 and PyTorch's flash/cuDNN attention instead of the T4's paths")
    ap.add_argument("--sms", type=int, metavar="N", help="run with every CUDA stream in a green context of N SMs "
                    "(bench/partition.py; torch >= 2.11 on a CUDA GPU)")
    args = ap.parse_args(argv)
    if args.op_origins and args.profile:
        ap.error("--op-origins and --profile are separate passes: give one of them")
    why = partition_unsupported(args.sms)
    if why:
        print(f"error: --sms {args.sms}: {why}", file=sys.stderr)
        return 2

    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    os.environ["SOUP_DB_PATH"] = str(work / "soup.db")
    for stale in (work / "soup.db", work / "result.json"):
        stale.unlink(missing_ok=True)

    import torch

    from bench.rules import PROHIBITED
    from solution.kernels import _launches
    from workload.config import WORKLOAD_FILE, load_workload

    workload = load_workload(args.workload or WORKLOAD_FILE)
    out_dir = work / "output"
    cfg_path = work / "soup.yaml"
    cfg_path.write_text(workload.soup_yaml(args.model, args.data, str(out_dir)), encoding="utf-8")

    emulation = emulate_t4_paths() if not args.native_precision else None
    if os.environ.get("BENCH_DETERMINISTIC") == "1":
        # Diagnosis only (never in the comparison's default runs): PyTorch's deterministic
        # algorithms, e.g. no atomics in memory-efficient attention's backward, to tell run-to-run
        # noise from real differences. warn_only: ops without a deterministic version still run.
        torch.use_deterministic_algorithms(True, warn_only=True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    partition = measure_partition(args.sms)
    from bench.host_probe import probe

    host_probe = probe()  # this pass's host speed, before anything is patched (bench/host_probe.py)

    def enter_for_training():
        # --sms: every stream from the partition as Soup builds its Trainer (the model is loaded;
        # the module docstring says why not before); the solution's side streams are made later
        if partition is not None and not partition.entered:
            partition.enter()

    installed = {}
    t_start = time.perf_counter()
    if args.variant == "solution":
        import solution

        installed = solution.apply()
    cprof = None
    if args.cprofile:
        import cProfile

        cprof = cProfile.Profile()  # enabled by the clock from step 3 to the end of training
    split = None
    if args.host_split:
        from bench.host_split import HostSplit

        split = HostSplit()
    clock = StepClock(profile=args.profile, cprofile=cprof, host_split=split, cprofile_steps=args.cprofile_steps,
                      op_origins=args.op_origins)
    compile_log = None
    if args.compile_log:
        from bench.compile_log import CompileLog

        compile_log = CompileLog(step_of=lambda: len(clock.step_ends) + 1 if clock.t_begin is not None else None)
        compile_log.install()
    uninstall_clock = install_clock(clock, on_trainer=enter_for_training)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    _launches.reset()
    recording = False
    if args.memory_peak:
        from bench import memory_peak

        recording = memory_peak.start_recording()

    from soup_cli.cli import app

    rc = 0
    try:
        app(["train", "--config", str(cfg_path), "--yes"], standalone_mode=False)
    except SystemExit as exc:  # Soup exits through typer on errors
        rc = exc.code if isinstance(exc.code, int) else 1
    finally:  # leave transformers' classes as they were, for callers that go on in this process
        uninstall_clock()
        if split is not None:
            split.detach()
        if compile_log is not None:
            compile_log.uninstall()
            compile_log.write(args.compile_log)
    if partition is not None and partition.entered:
        partition.exit()
    if cprof is not None:
        import io
        import pstats

        buf = io.StringIO()
        stats = pstats.Stats(cprof, stream=buf)
        stats.sort_stats("tottime").print_stats(70)
        stats.sort_stats("cumulative").print_stats(100)
        Path(args.cprofile).write_text(buf.getvalue(), encoding="utf-8")
    wall = time.perf_counter() - t_start
    if recording:
        snap = memory_peak.take_snapshot()
        text = (memory_peak.format_breakdown(memory_peak.peak_breakdown(snap)) + "\n\n"
                + memory_peak.format_reserved(memory_peak.reserved_breakdown(snap)))
        Path(args.memory_peak).write_text(text + "\n", encoding="utf-8")

    steps = clock.step_times()
    timed = steps[SKIP_STEPS:]
    host_split = None
    if split is not None:
        from bench.host_split import format_summary

        host_split = split.summary(steps, SKIP_STEPS)
        Path(args.host_split).write_text(format_summary(host_split), encoding="utf-8")
    tok_logs = [l for l in clock.logs if "num_tokens" in l]
    tokens_total = float(tok_logs[-1]["num_tokens"]) if tok_logs else None
    tokens_after_skip = None
    if tok_logs and len(tok_logs) > SKIP_STEPS:
        by_step = {l["step"]: float(l["num_tokens"]) for l in tok_logs}
        if SKIP_STEPS in by_step:
            tokens_after_skip = tokens_total - by_step[SKIP_STEPS]
    result = {
        "variant": args.variant,
        "rc": rc,
        "installed": installed,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
        "t4_emulation": emulation,
        "linear4bit_layers": clock.linear4bit_layers,
        "wall_s": wall,
        "train_s": (clock.t_end - clock.t_begin) if clock.t_end else None,
        "setup_s": (clock.t_begin - t_start) if clock.t_begin else None,  # apply() and Soup's loading
        "steps": len(steps),
        "step_times_s": steps,
        "train_excl_first2_s": sum(timed) if timed else None,
        "tokens_total": tokens_total,
        "tokens_excl_first2": tokens_after_skip,
        "tokens_per_s": (tokens_total / (clock.t_end - clock.t_begin)) if tokens_total and clock.t_end else None,
        "tokens_per_s_excl_first2": (tokens_after_skip / sum(timed)) if tokens_after_skip and timed else None,
        "peak_mem_allocated_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
        "peak_mem_reserved_bytes": torch.cuda.max_memory_reserved() if torch.cuda.is_available() else None,
        "memory_pools_at_end": clock.pools,
        "trainer_logs": clock.logs,
        "skipped_steps": clock.skipped_steps,
        "scaler_scales": clock.scaler_scales if any(s is not None for s in clock.scaler_scales) else None,
        "tracker": read_tracker(work / "soup.db"),
        "outputs": output_files(out_dir),
        "launches": dict(_launches.LAUNCHES),
        "launches_not_ours": sorted(_launches.NOT_OURS),
        "prohibited_modules_loaded": sorted({m.split(".")[0] for m in sys.modules} & set(PROHIBITED)),
        "profile": None,
        "host_split": host_split,
        "compile_log": compile_log.summary() if compile_log is not None else None,
        "cuda_graphs": cuda_graph_summary(clock.step_ends) if "qwen2_unpad" in installed else None,
        "precompile": precompile_summary(clock) if installed else None,
        "partition": partition.record() if partition is not None else None,
        "host_probe": host_probe,
    }
    if args.profile and clock.kernel_times:
        result["profile"] = {
            "window_s": clock.t_prof_end - clock.t_prof_begin,
            "kernel_times_s": clock.kernel_times,
        }
    (work / "result.json").write_text(json.dumps(result, indent=1, default=str), encoding="utf-8")
    print(f"[run_one] {args.variant}: rc={rc} steps={len(steps)} wall={wall:.1f}s -> {work / 'result.json'}", flush=True)
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
