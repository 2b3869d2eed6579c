"""bench/t4_projection.py: the T4 roofline model (pure arithmetic on synthetic result dicts; no GPU)."""
import json
from types import SimpleNamespace

import pytest

from bench import compare, report
from bench import t4_projection as t4
from workload.config import load_workload

GEMM = "ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_stages_32x5_tn"
NVJET = "nvjet_sm90_hsh_192x128_64x5_1x2_h_bz_coopB_NNT"
ATTN = ("fmha_cutlassB_f16_aligned_128x128_k128_sm80(PyTorchMemEffAttention::AttentionBackwardKernel"
        "<cutlass::arch::Sm80, cutlass::half_t, true, false, true, 128, 128, 128, false>::Params)")
COPY = "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)>"
DEQUANT = "void kDequantizeBlockwise<__half, 512, 64, 8, 2>(float*, unsigned char*, float*, __half*, int, int)"
H2D = "Memcpy HtoD (Pageable -> Device)"
STEPS = 64


def timed(per_step, graphs=False, capture_s=0.0, n=STEPS, tokens=64567, mem=13.17 * 2**30):
    steps = [0.8, 0.5] + [per_step] * (n - 2)
    g = ({"captures": [{"tokens": 1792, "seconds": 0.3 + capture_s, "step": 2}], "failed": [],
          "capture_s_excl_first2": capture_s} if graphs else None)
    logs = [{"step": i + 1, "loss": 2.0 - 0.01 * i, "num_tokens": 1000 * (i + 1)} for i in range(n)]
    return {"variant": "x", "device": "NVIDIA H200", "steps": n, "step_times_s": steps,
            "train_excl_first2_s": sum(steps[2:]), "trainer_logs": logs, "tokens_total": tokens, "peak_mem_allocated_bytes": mem, "cuda_graphs": g}


def profiled(kernel_times, n=STEPS):
    return {"step_times_s": [1.0] * n, "profile": {"window_s": 20.0, "kernel_times_s": kernel_times}}


@pytest.mark.parametrize("name, cls", [
    (GEMM, t4.FLOP), (NVJET, t4.FLOP), ("turing_fp16_s1688gemm_fp16_128x128_ldg8_f2f_tn", t4.FLOP),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_f16_s161616gemm_f16_32x32_128x2_tn_align8>(Params)", t4.FLOP),
    (ATTN, t4.FLOP), ("fmha_cutlassF_f16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel)", t4.FLOP),
    ("void splitKreduce_kernel<32, 16, int, __half, __half, float, __half, true, false>(cublasSplitKParams<float>)",
     t4.MEMORY),
    ("nf4_dequant_kernel", t4.MEMORY), ("_swiglu_fwd_kernel", t4.MEMORY), ("_lm_head_ce_rows_kernel", t4.MEMORY),
    (COPY, t4.MEMORY), (DEQUANT, t4.MEMORY),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>", t4.MEMORY),
    ("void at::native::multi_tensor_apply_kernel<at::native::FusedAdamMathFunctor>", t4.MEMORY),
    (H2D, t4.TRANSFER), ("Memcpy DtoH (Device -> Pinned)", t4.TRANSFER),
    ("Memcpy DtoD (Device -> Device)", t4.MEMORY), ("Memset (Device)", t4.MEMORY),
])
def test_kernels_are_classed_by_their_bound(name, cls):
    assert t4.kernel_class(name) == cls


def test_scales_are_the_stated_roofline_ratios():
    assert t4.FLOP_SCALE == pytest.approx(989e12 * 0.70 / 24e12)  # T4 sustains 24 of its 65 TFLOP/s
    assert t4.MEM_SCALE == pytest.approx(4.8e12 * 0.85 / (320e9 * 0.80))
    assert t4.PCIE_SCALE == 4.0
    assert 20 < t4.FLOP_SCALE < 40 and 10 < t4.MEM_SCALE < 20


def test_gpu_time_is_each_kernel_scaled_by_its_bound_per_profiled_step():
    g = t4.gpu_split(profiled({GEMM: 1.0, ATTN: 0.5, COPY: 2.0, DEQUANT: 1.0, H2D: 0.1}))
    n = STEPS - 2  # the profile covers steps 3..64
    assert g["profiled_steps"] == n
    assert g["measured_s_per_step"][t4.FLOP] == pytest.approx(1.5 / n)
    assert g["t4_s_per_step"][t4.FLOP] == pytest.approx(1.5 / n * t4.FLOP_SCALE)
    assert g["t4_s_per_step"][t4.MEMORY] == pytest.approx(3.0 / n * t4.MEM_SCALE)
    assert g["t4_s_per_step"][t4.TRANSFER] == pytest.approx(0.1 / n * t4.PCIE_SCALE)
    assert g["t4_gpu_s_per_step"] == pytest.approx(sum(g["t4_s_per_step"].values()))


def test_step_is_the_slower_of_host_and_gpu():
    gpu_bound = t4.project_run(timed(0.25), profiled({COPY: 3.0}))  # 3 s x15.9 / 62 = 0.77 s > 0.5 s
    assert gpu_bound["t4"]["bound"] == "GPU"
    assert gpu_bound["t4"]["step_s"] == pytest.approx(3.0 / 62 * t4.MEM_SCALE)
    host_bound = t4.project_run(timed(0.25), profiled({COPY: 0.3}))
    assert host_bound["t4"]["bound"] == "host"
    assert host_bound["t4"]["step_s"] == pytest.approx(0.25 * t4.KAGGLE_CPU_FACTOR)
    assert host_bound["measured"]["host_s_per_step"] == pytest.approx(0.25)
    assert host_bound["train_s_raw"] == pytest.approx(STEPS * 0.25 * t4.KAGGLE_CPU_FACTOR)


def test_graph_captures_in_the_timed_steps_are_not_host_time_per_step():
    r = t4.project_run(timed(0.1, graphs=True, capture_s=6.2), profiled({COPY: 0.1}), eager_host_measured=0.3)
    assert r["measured"]["host_graphs_s_per_step"] == pytest.approx(0.1 - 6.2 / 62)


def test_a_gpu_bound_t4_runs_the_solution_without_graphs():
    """decide() would say off: the eager host time counts (here the baseline's, an upper bound)."""
    r = t4.project_run(timed(0.05, graphs=True), profiled({COPY: 3.0}), eager_host_measured=0.2)
    assert r["measured"]["graphs"] is True and r["t4"]["graphs"] is False
    assert r["t4"]["host_s_per_step"] == pytest.approx(0.2 * t4.KAGGLE_CPU_FACTOR)
    assert r["t4"]["bound"] == "GPU"
    # a host-bound T4 step keeps the graphs, and their (smaller) host time counts
    r = t4.project_run(timed(0.05, graphs=True), profiled({COPY: 0.3}), eager_host_measured=0.2)
    assert r["t4"]["graphs"] is True
    assert r["t4"]["host_s_per_step"] == pytest.approx(0.05 * t4.KAGGLE_CPU_FACTOR)
    with pytest.raises(ValueError, match="eager host time"):
        t4.project_run(timed(0.05, graphs=True), profiled({COPY: 0.3}))


def test_the_bound_ratio_is_the_solutions_own():
    from solution.step import graph_decision

    assert t4.GPU_BOUND_RATIO == graph_decision.GPU_BOUND_RATIO


def _pair():
    base_k = {COPY: 1.9, NVJET: 0.9, ATTN: 0.36, DEQUANT: 0.26, H2D: 0.06}
    sol_k = {NVJET: 0.7, "nf4_dequant_cast_kernel": 0.47, ATTN: 0.19, COPY: 0.13, H2D: 0.04}
    return timed(15.5 / 62), profiled(base_k), timed(4.0 / 62, graphs=True), profiled(sol_k)


def test_calibration_puts_the_baseline_at_the_official_80_s_and_keeps_the_ratio():
    p = t4.project(*_pair(), device="NVIDIA H200")
    assert p["baseline_train_s"] == pytest.approx(80.0)
    assert p["calibration_factor"] == pytest.approx(80.0 / p["baseline_train_s_raw"])
    assert p["calibration_error"] == pytest.approx(p["baseline_train_s_raw"] / 80.0 - 1)
    assert p["solution_train_s"] == pytest.approx(p["solution_train_s_raw"] * p["calibration_factor"])
    assert p["solution_train_s"] / p["baseline_train_s"] == pytest.approx(
        p["solution_train_s_raw"] / p["baseline_train_s_raw"])
    assert p["baseline"]["train_s_raw"] == pytest.approx(STEPS * p["baseline"]["t4"]["step_s"])
    # the solution's eager host time is the baseline's (its own is not measured with graphs)
    assert p["solution"]["measured"]["host_eager_s_per_step"] == pytest.approx(15.5 / 62)
    assert "applied to both runs" in p["calibration"] and "%" in p["calibration"]
    assert p["checks"]["baseline_tokens_per_s_at_official_time"] == pytest.approx(64567 / 80)


@pytest.mark.parametrize("change, why", [
    (lambda a: a[1].update(profile=None), "no profiled pass of the baseline"),
    (lambda a: a[3]["profile"].update(kernel_times_s={}), "no profiled pass of the solution"),
    (lambda a: a[2].update(step_times_s=[1.0, 1.0]), "no timed steps of the solution"),
    (lambda a: a[1].update(step_times_s=[1.0]), "the baseline's profiled pass has no steps after the first two"),
])
def test_runs_that_cannot_be_projected_say_why(change, why):
    args = list(_pair())
    change(args)
    assert why in t4.project(*args)["skipped"]


def test_an_h100_sxm_run_is_projected_with_the_h100s_bandwidth():
    assert t4.source_of("NVIDIA H100 80GB HBM3") == "H100" and t4.source_of("NVIDIA H200") == "H200"
    assert t4.mem_scale("H100") == pytest.approx(3.35e12 * 0.85 / (320e9 * 0.80))
    assert t4.flop_scale("H100") == pytest.approx(t4.FLOP_SCALE)  # the same dense fp16 peak
    h100, h200 = t4.project(*_pair(), device="NVIDIA H100 80GB HBM3"), t4.project(*_pair(), device="NVIDIA H200")
    assert h100["source"] == "H100" and h200["source"] == "H200"
    assert h100["constants"]["memory_scale"] == pytest.approx(t4.mem_scale("H100"))
    # the same measured seconds of memory-bound work weigh less on a T4 when they came from the slower H100
    b100, b200 = h100["baseline"]["t4"]["by_class_s_per_step"], h200["baseline"]["t4"]["by_class_s_per_step"]
    assert b100[t4.MEMORY] == pytest.approx(b200[t4.MEMORY] * 3.35 / 4.8)
    assert b100[t4.FLOP] == pytest.approx(b200[t4.FLOP])
    assert "H100 time scaled" in "\n".join(t4.section(h100))


def test_only_an_h200_or_h100_sxm_shipped_run_is_projected():
    assert "NVIDIA T4" in t4.project(*_pair(), device="NVIDIA T4")["skipped"]
    assert "NVIDIA H100 PCIe" in t4.project(*_pair(), device="NVIDIA H100 PCIe")["skipped"]
    assert "measured on the CPU" in t4.project(*_pair(), device="cpu")["skipped"]
    assert "main run is long" in t4.project(*_pair(), device="NVIDIA H200", shape="long")["skipped"]


@pytest.fixture
def h200_report(monkeypatch):
    monkeypatch.setattr(compare, "_gpu", lambda: {"name": "NVIDIA H200", "capability": "9.0", "memory_gib": 139.8})
    base, base_prof, sol, sol_prof = _pair()
    return compare.build_report(SimpleNamespace(argv=[]), "stand-in (full)", base, sol, base_prof, sol_prof,
                                load_workload(), shape="shipped", data="k.jsonl")


def test_report_and_summary_carry_the_projection(h200_report, tmp_path):
    rep = h200_report
    assert rep["t4_projection"]["baseline_train_s"] == pytest.approx(80.0)
    md = report.markdown(rep)
    assert "## T4 projection (a model, not a measurement)" in md
    sec = md.split("## T4 projection")[1].split("\n## ")[0]
    assert "| baseline |" in sec and "| solution |" in sec and "**80.0**" in sec and "Calibration: one factor" in sec
    s = report.summary(rep)["t4_projection"]
    assert {"baseline_train_s", "solution_train_s", "calibration"} <= set(s)
    assert s["baseline_train_s"] == pytest.approx(80.0) and isinstance(s["calibration"], str)
    assert s["solution"]["bound"] in ("GPU", "host") and s["baseline"]["graphs"] is False
    line = next(ln for ln in report.summary_table(rep).splitlines() if ln.startswith("T4 projection"))
    assert line == t4.console_line(rep["t4_projection"])
    assert ("on a T4, 64 training steps would take about 80.0 s with the baseline and " in line
            and "matches the official T4 figure of 80 s (before scaling the model gave " in line
            and line.endswith("the official figure).")), line
    # re-rendered from report.json (bench.report's main): the same section and summary
    path = tmp_path / "report.json"
    path.write_text(json.dumps(rep, default=str), encoding="utf-8")
    assert report.main([str(path)]) == 0
    assert json.loads((tmp_path / "summary.json").read_text(encoding="utf-8"))["t4_projection"] == s
    assert "## T4 projection (a model, not a measurement)" in (tmp_path / "report.md").read_text(encoding="utf-8")


def test_a_report_without_a_projection_says_so(monkeypatch):
    monkeypatch.setattr(compare, "_gpu", lambda: {"name": "NVIDIA H200", "capability": "9.0", "memory_gib": 139.8})
    rep = compare.build_report(SimpleNamespace(argv=[]), "stand-in (tiny)", timed(0.1), timed(0.1), None, None,
                               load_workload())
    assert "no profiled pass" in rep["t4_projection"]["skipped"]
    assert "Not projected: there is no profiled pass" in report.markdown(rep)
    assert (t4.console_line(rep["t4_projection"]) == "T4 projection (a model, not a measurement): not made, because "
            f"{rep['t4_projection']['skipped']}.")
    assert report.summary(rep)["t4_projection"]["skipped"] == rep["t4_projection"]["skipped"]
    rep.pop("t4_projection")  # a report.json from before the projection
    assert "made before bench/t4_projection.py" in report.markdown(rep)
    assert report.summary(rep)["t4_projection"] is None


def test_a_gpu_bound_t4_takes_the_gpu_time_of_the_profile_without_graphs():
    """decide() on the T4 says off: the step is the eager one, host and GPU (the profile with graphs
    off: no bucket filler); the decision itself is made on that eager GPU time."""
    graphs_prof, eager_prof = profiled({COPY: 3.3}), profiled({COPY: 3.0})
    r = t4.project_run(timed(0.05, graphs=True), graphs_prof, eager_host_measured=0.2, eager_profiled=eager_prof)
    assert r["t4"]["graphs"] is False
    assert r["t4"]["gpu_s_per_step"] == pytest.approx(3.0 / 62 * t4.MEM_SCALE)
    assert r["t4"]["gpu_graphs_s_per_step"] == pytest.approx(3.3 / 62 * t4.MEM_SCALE)
    assert r["measured"]["gpu_eager_s_per_step"] == pytest.approx(3.0 / 62)
    assert "graphs off" in r["measured"]["gpu_eager_source"]
    # without that pass the graphs profile stands in, and the result says so
    r = t4.project_run(timed(0.05, graphs=True), graphs_prof, eager_host_measured=0.2)
    assert r["t4"]["gpu_s_per_step"] == pytest.approx(3.3 / 62 * t4.MEM_SCALE)
    assert "upper bound" in r["measured"]["gpu_eager_source"]
    # a host-bound T4 keeps the graphs: their own GPU time counts
    r = t4.project_run(timed(0.05, graphs=True), profiled({COPY: 0.33}), eager_host_measured=0.2,
                       eager_profiled=profiled({COPY: 0.3}))
    assert r["t4"]["graphs"] is True
    assert r["t4"]["gpu_s_per_step"] == pytest.approx(0.33 / 62 * t4.MEM_SCALE)


def test_project_uses_the_solutions_eager_profile_when_given():
    bt, bp, st, _ = _pair()
    sp = profiled({NVJET: 0.7, "nf4_dequant_cast_kernel": 2.0, COPY: 1.0})  # GPU-bound on the T4
    eager = profiled({k: v * 0.9 for k, v in sp["profile"]["kernel_times_s"].items()})
    with_eager = t4.project(bt, bp, st, sp, device="NVIDIA H200", sol_prof_eager=eager)
    without = t4.project(bt, bp, st, sp, device="NVIDIA H200")
    assert with_eager["baseline_train_s"] == without["baseline_train_s"] == pytest.approx(80.0)
    assert with_eager["solution"]["t4"]["graphs"] is False
    assert with_eager["solution_train_s"] < without["solution_train_s"]
    assert "graphs off" in t4.summary(with_eager)["solution"]["gpu_eager_source"]


def test_the_report_shows_the_solutions_gpu_time_with_graphs_off(monkeypatch):
    """bench.compare's graphs-off profile: its own row, its own category table, the shipped
    shape's "gpu_kernel_s_graphs_off" (and its ratio to the baseline's GPU time) in summary.json."""
    monkeypatch.setattr(compare, "_gpu", lambda: {"name": "NVIDIA H200", "capability": "9.0", "memory_gib": 139.8})
    base, base_prof, sol, sol_prof = _pair()
    eager = profiled({NVJET: 0.65, "nf4_dequant_cast_kernel": 0.45, ATTN: 0.18, COPY: 0.12, H2D: 0.04})
    rep = compare.build_report(SimpleNamespace(argv=[]), "stand-in (full)", base, sol, base_prof, sol_prof,
                               load_workload(), shape="shipped", data="k.jsonl", sol_prof_eager=eager)
    md = report.markdown(rep)
    assert "| GPU kernel time, graphs off (the T4's path), steps 3-64 (s) | 3.48 | 1.44 | 2.42x |" in md
    assert "## Where GPU time goes: solution, CUDA graphs off" in md
    shipped = report.summary(rep)["runs"]["shipped"]
    assert shipped["solution"]["gpu_kernel_s_graphs_off"] == pytest.approx(1.44)
    assert rep["shapes"]["shipped"]["ratios"]["gpu_kernel_s_graphs_off"] == pytest.approx(1.44 / 3.48)
    # without the pass: no such row
    rep = compare.build_report(SimpleNamespace(argv=[]), "stand-in (full)", base, sol, base_prof, sol_prof,
                               load_workload(), shape="shipped", data="k.jsonl")
    assert "graphs off (the T4's path)" not in report.markdown(rep)


# --- the solution's own eager host time (run shipped-graphs-off) ----------------------------------

def test_the_solutions_eager_host_time_is_its_own_graphs_off_run():
    bt, bp, st, sp = _pair()
    eager = timed(6.2 / 62)  # the solution timed with SOLUTION_CUDA_GRAPHS=0: no captures
    p = t4.project(bt, bp, st, sp, device="NVIDIA H200", sol_eager_timed=eager)
    h = p["solution"]["measured"]
    assert h["host_eager_s_per_step"] == pytest.approx(6.2 / 62)  # not the baseline's 15.5 / 62
    assert "run shipped-graphs-off" in h["host_eager_source"] and "SOLUTION_CUDA_GRAPHS=0" in h["host_eager_source"]
    assert p["solution"]["t4"]["host_eager_s_per_step"] == pytest.approx(6.2 / 62 * t4.KAGGLE_CPU_FACTOR)
    assert "run shipped-graphs-off" in t4.summary(p)["solution"]["host_eager_source"]
    assert "run shipped-graphs-off" in "\n".join(t4.section(p))
    # without that run the baseline's stands in, and the result says so
    p = t4.project(bt, bp, st, sp, device="NVIDIA H200")
    assert p["solution"]["measured"]["host_eager_s_per_step"] == pytest.approx(15.5 / 62)
    assert "upper bound" in p["solution"]["measured"]["host_eager_source"]
    # a "graphs off" run that captured graphs anyway is not an eager step
    p = t4.project(bt, bp, st, sp, device="NVIDIA H200", sol_eager_timed=timed(0.05, graphs=True))
    assert p["solution"]["measured"]["host_eager_s_per_step"] == pytest.approx(15.5 / 62)


def test_the_report_takes_the_eager_host_time_from_its_graphs_off_run(monkeypatch):
    monkeypatch.setattr(compare, "_gpu", lambda: {"name": "NVIDIA H200", "capability": "9.0", "memory_gib": 139.8})
    base, base_prof, sol, sol_prof = _pair()
    others = {"shipped-graphs-off": {"data": "k.jsonl", "baseline": timed(15.4 / 62), "solution": timed(6.2 / 62)}}
    rep = compare.build_report(SimpleNamespace(argv=[]), "stand-in (full)", base, sol, base_prof, sol_prof,
                               load_workload(), shape="shipped", data="k.jsonl", others=others)
    assert rep["t4_projection"]["solution"]["measured"]["host_eager_s_per_step"] == pytest.approx(6.2 / 62)


# --- the model pointed at a measured machine: an SM partition -------------------------------------

RATES = {"whole": {"matmul_tflops": 660.0, "copy_gbs": 3900.0}, "partition": {"matmul_tflops": 94.0, "copy_gbs": 1200.0}}


def test_the_partitions_constants_are_its_measured_rates():
    m = t4.partition_machine(RATES)
    assert m["scale"] == {t4.FLOP: pytest.approx(660 / 94), t4.MEMORY: pytest.approx(3900 / 1200), t4.TRANSFER: 1.0}
    assert m["host_factor"] == 1.0


def _whole():
    base_k = {GEMM: 1.0, COPY: 2.0}
    sol_k = {GEMM: 3.2, COPY: 0.4}  # GPU-bound in the partition: its eager step is the one that counts
    return {"baseline": timed(15.5 / 62), "baseline-profiled": profiled(base_k),
            "solution": timed(4.0 / 62, graphs=True), "solution-profiled": profiled(sol_k),
            "solution-profiled-eager": profiled({GEMM: 3.0, COPY: 0.35}), "solution-graphs-off": timed(15.0 / 62)}


def test_the_partition_prediction_stands_beside_the_measurement():
    measured = {"baseline": timed(0.40), "solution": timed(0.25), "baseline-profiled": profiled({GEMM: 20.0})}
    p = t4.predict_partition(_whole(), RATES, measured)
    gpu_b = (1.0 * 660 / 94 + 2.0 * 3900 / 1200) / 62
    assert p["baseline"]["gpu_s_per_step"] == pytest.approx(gpu_b)
    assert p["baseline"]["host_s_per_step"] == pytest.approx(15.5 / 62)  # the same CPU: host x1
    assert p["baseline"]["step_s"] == pytest.approx(max(gpu_b, 15.5 / 62)) and p["baseline"]["bound"] == "host"
    assert p["baseline"]["steps_3_n_s"] == pytest.approx(62 * p["baseline"]["step_s"])
    assert p["baseline"]["measured_steps_3_n_s"] == pytest.approx(62 * 0.40)
    assert p["baseline"]["error"] == pytest.approx(p["baseline"]["steps_3_n_s"] / (62 * 0.40) - 1)
    assert p["baseline"]["measured_gpu_s_per_step"] == pytest.approx(20.0 / 62)
    # the solution's eager step: its own graphs-off run, its graphs-off profile (no filler)
    assert "run shipped-graphs-off" in p["solution_host_eager_source"]
    gpu_s = (3.0 * 660 / 94 + 0.35 * 3900 / 1200) / 62
    assert p["solution"]["graphs"] is False and p["solution"]["gpu_s_per_step"] == pytest.approx(gpu_s)
    assert p["solution"]["host_s_per_step"] == pytest.approx(15.0 / 62) and p["solution"]["measured_graphs"] is False
    assert p["ratio"]["measured"] == pytest.approx(0.25 / 0.40)
    assert p["ratio"]["predicted"] == pytest.approx(p["solution"]["step_s"] / p["baseline"]["step_s"])
    text = "\n".join(t4.partition_section(p))
    assert "measured steps 3-N (s)" in text and "| baseline |" in text and "x7.02" in text


def test_no_partition_prediction_without_the_whole_gpu_runs():
    whole = _whole()
    whole.pop("baseline-profiled")
    assert "baseline-profiled" in t4.predict_partition(whole, RATES, {})["skipped"]
    assert "rates" in t4.predict_partition(_whole(), {}, {})["skipped"]
    assert "not made" in t4.partition_section({"skipped": "x"})[0]


def test_a_partitioned_run_gets_its_section_in_the_report(monkeypatch):
    monkeypatch.setattr(compare, "_gpu", lambda: {"name": "NVIDIA H200", "capability": "9.0", "memory_gib": 139.8})
    from tests.test_partition import _record

    w = _whole()
    part_b, part_s = {**timed(0.40), "partition": _record()}, {**timed(0.25), "partition": _record()}
    others = {"gpu-bound-sm16": {"data": "k.jsonl", "baseline": part_b, "solution": part_s},
              "shipped-graphs-off": {"data": "k.jsonl", "baseline": timed(15.4 / 62), "solution": w["solution-graphs-off"]}}
    rep = compare.build_report(SimpleNamespace(argv=[]), "stand-in (full)", w["baseline"], w["solution"],
                               w["baseline-profiled"], w["solution-profiled"], load_workload(), shape="shipped",
                               data="k.jsonl", others=others, sol_prof_eager=w["solution-profiled-eager"])
    e = rep["shapes"]["gpu-bound-sm16"]
    assert set(e["partition"]) == {"baseline", "solution"} and e["prediction"]["ratio"]["measured"] == pytest.approx(0.625)
    md = report.markdown(rep)
    assert "## GPU-bound machine: run gpu-bound-sm16 in an SM partition" in md
    assert "Model prediction (bench/t4_projection.py" in md and "16 of the GPU's 132 SMs" in md
    run = report.summary(rep)["runs"]["gpu-bound-sm16"]
    assert run["partition"]["baseline"]["held_check"]["held"] is True and "prediction" in run
    assert "gpu-bound-sm16: 16-SM partition, baseline held, solution held" in report.summary_table(rep)


def test_the_projection_is_checked_against_the_8_sm_run():
    p = t4.project(*_pair(), device="NVIDIA H100 80GB HBM3")
    projected = 1 / p["speedup"]
    entry = {"ratios": {"train_excl_first2_s": 0.5},
             "repeats": {"steps_ratio_median": projected / 1.1}}  # the median of the pairs wins over the table's
    a = t4.against_partition(p, entry)
    assert a["run"] == "gpu-bound-sm8" and a["measured_ratio"] == pytest.approx(projected / 1.1)
    assert a["difference"] == pytest.approx(0.1)
    assert t4.against_partition(p, {"ratios": {"train_excl_first2_s": projected}})["difference"] == pytest.approx(0)
    assert t4.against_partition(p, None) is None and t4.against_partition({"skipped": "x"}, entry) is None
    p["against"] = a
    assert "the projection is 10% above the measurement" in "\n".join(t4.section(p))
    assert t4.summary(p)["against"] == a and t4.summary(p)["source"] == "H100"
