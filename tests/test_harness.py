"""The workload reproduction and the measurement tools (no GPU needed)."""
import json
from pathlib import Path

import pytest
import yaml

from bench import rules
from bench.own_kernels import categorize, is_own_kernel, own_kernel_names
from workload.config import WORKLOAD_FILE, WorkloadConfigError, load_workload, validate_with_soup

ROOT = Path(__file__).resolve().parent.parent


def _write(tmp_path, data):
    p = tmp_path / "w.yaml"
    p.write_text(yaml.safe_dump(data), encoding="utf-8")
    return p


def test_default_workload_is_the_challenge_workload():
    w = load_workload()
    assert (w.steps, w.examples, w.batch_size, w.max_length) == (64, 256, 4, 512)
    d = w.soup_dict("/m", "/d.jsonl", "/o")
    assert d["training"]["lora"] == {"r": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"]}
    assert d["training"]["quantization"] == "4bit"
    assert d["training"]["gradient_accumulation_steps"] == 1 and d["training"]["epochs"] == 1
    assert d["data"]["val_split"] == 0.0 and d["data"]["max_length"] == 512


def test_rendered_yaml_passes_soups_own_loader():
    text = load_workload().soup_yaml("/m", "/d.jsonl", "/o")
    assert "q_proj" in text


def test_soup_rejects_unknown_key_in_rendered_yaml():
    text = load_workload().soup_yaml("/m", "/d.jsonl", "/o") + "\nnot_a_soup_key: 1\n"
    with pytest.raises(ValueError):
        validate_with_soup(text)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.__setitem__("surprise", 1), "unknown key 'surprise'"),
    (lambda d: d["training"].__setitem__("lr_typo", 1), "unknown key training.lr_typo"),
    (lambda d: d["training"].pop("seed"), "missing training.seed"),
    (lambda d: d["training"].__setitem__("steps", 65), "64 steps"),
])
def test_bad_workload_file_gets_a_clear_error(tmp_path, mutate, message):
    data = yaml.safe_load(WORKLOAD_FILE.read_text(encoding="utf-8"))
    mutate(data)
    path = _write(tmp_path, data)
    before = path.read_bytes()
    with pytest.raises(WorkloadConfigError, match=message.replace(".", r"\.")):
        load_workload(path)
    assert path.read_bytes() == before  # nothing written is lost


def test_missing_workload_file(tmp_path):
    with pytest.raises(WorkloadConfigError, match="not found"):
        load_workload(tmp_path / "nope.yaml")


def test_compare_rejects_missing_model_path(tmp_path, capsys):
    from bench.compare import main

    rc = main(["--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "out")])
    assert rc == 2
    assert f"model directory not found: {tmp_path / 'no-model'}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_compare_refuses_to_overwrite_a_report(tmp_path, capsys):
    from bench.compare import main

    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_text("{}")
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    rc = main(["--model", str(model), "--out", str(out)])
    assert rc == 2 and "already holds a report" in capsys.readouterr().err
    assert (out / "report.json").read_text() == "{}"


def test_static_rules_pass_on_this_repo():
    rows = rules.check_static()
    assert all(r["ok"] for r in rows), rows


def test_own_kernel_discovery_and_categories():
    names = own_kernel_names()
    assert names, "solution/ must hold @triton.jit kernels"
    some = sorted(names)[0]
    assert is_own_kernel(some) and categorize(some).startswith("ours")
    assert categorize("ampere_fp16_s16816gemm_fp16_128x128") .startswith("matmul")
    assert categorize("void at::native::vectorized_elementwise_kernel<4>") .startswith("elementwise")
    assert categorize("fmha_cutlassB_f16_aligned_128x128_k128_sm80(PyTorchMemEffAttention::AttentionBackwardKernel").startswith("attention")


def _fake_result(variant, losses, tokens, grad=1.0):
    logs = [{"step": i + 1, "loss": l, "grad_norm": grad, "entropy": 11.0, "mean_token_accuracy": 0.1,
             "num_tokens": tokens * (i + 1)} for i, l in enumerate(losses)]
    return {"variant": variant, "steps": len(losses), "trainer_logs": logs}


def test_metric_comparison_catches_divergence():
    base = _fake_result("baseline", [2.0, 1.9, 1.8], 100)
    same = _fake_result("solution", [2.0, 1.9, 1.8001], 100)
    off = _fake_result("solution", [2.0, 1.9, 1.5], 100)
    reorder = _fake_result("solution", [2.0, 1.9, 1.8], 101)
    assert all(r["ok"] for r in rules.compare_metrics(base, same))
    assert not all(r["ok"] for r in rules.compare_metrics(base, off))
    assert not all(r["ok"] for r in rules.compare_metrics(base, reorder))


def test_apply_falls_back_without_cuda_or_interpreter(monkeypatch, capsys):
    import solution
    from solution import _apply

    solution.revert()
    monkeypatch.setattr(_apply, "check_support", lambda: type("S", (), {"ok": False, "reason": "no CUDA GPU"})())
    assert solution.apply() == {}
    assert "falling back to the stock path: no CUDA GPU" in capsys.readouterr().out
    solution.revert()


def test_apply_is_idempotent_and_revert_restores(monkeypatch):
    import solution
    from transformers.models.qwen2 import modeling_qwen2

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    solution.revert()
    originals = (modeling_qwen2.Qwen2RMSNorm.forward, modeling_qwen2.apply_rotary_pos_emb,
                 modeling_qwen2.Qwen2MLP.forward)
    first = solution.apply(verbose=False)
    assert first, "on the interpreter at least one patch installs"
    assert solution.apply(verbose=False) == first
    solution.revert()
    assert (modeling_qwen2.Qwen2RMSNorm.forward, modeling_qwen2.apply_rotary_pos_emb,
            modeling_qwen2.Qwen2MLP.forward) == originals
    assert solution.installed() == {}


def test_compare_rejects_a_malformed_dataset_row(tmp_path, capsys):
    from bench.compare import main

    data = tmp_path / "data.jsonl"
    data.write_text('{"instruction": "a", "input": "", "output": "b"}\n{"instruction": "c"\n', encoding="utf-8")
    before = data.read_bytes()
    rc = main(["--data", str(data), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "line 2" in err, err
    assert data.read_bytes() == before and not (tmp_path / "out").exists()


def test_memory_peak_replay_finds_the_peak_and_its_owners():
    from bench.memory_peak import format_breakdown, peak_breakdown

    def ev(action, addr, size, line):
        return {"action": action, "addr": addr, "size": size,
                "frames": [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},
                           {"filename": "/work/main/solution/kernels/a.py", "line": line, "name": "f"}]}

    trace = [ev("alloc", 1, 100, 10), ev("alloc", 2, 50, 20), ev("free_requested", 2, 50, 20),
             ev("free_completed", 2, 50, 20), ev("alloc", 3, 70, 30), ev("alloc", 4, 10, 30),
             ev("free_requested", 1, 100, 10), ev("alloc", 5, 5, 40)]
    br = peak_breakdown({"device_traces": [trace]})
    assert br["peak_bytes"] == 180 and br["event_index"] == 5
    sites = {site: (nbytes, count) for site, nbytes, count in br["by_site"]}
    assert sites == {"solution/kernels/a.py:10 f": (100, 1), "solution/kernels/a.py:30 f": (80, 2)}
    assert "solution/kernels/a.py:30 f" in format_breakdown(br)


def test_triton_older_than_tested_falls_back_with_a_reason():
    from solution.env import triton_too_old

    assert triton_too_old("3.1.0") and "3.2" in triton_too_old("3.1.0")
    assert triton_too_old("2.3.1")
    assert triton_too_old("3.2.0") is None and triton_too_old("3.6.0") is None and triton_too_old("3.8.0") is None
    assert triton_too_old("4.0.0+git1234") is None
    assert "not understood" in triton_too_old("nightly")


def test_triton_that_cannot_build_its_launchers_falls_back_with_a_reason(monkeypatch, tmp_path):
    """env.triton_build_reason: no C compiler, a $CC that is not there, no Python.h, no
    libcuda.so.1 each give a reason (Triton's first launch would fail inside the training step);
    all present gives None; check_support() on a CUDA machine then falls back with it."""
    import shutil
    import sysconfig

    import torch
    from triton.backends.nvidia import driver as nv

    from solution import env

    headers = tmp_path / "include"
    headers.mkdir()
    (headers / "Python.h").write_text("")
    monkeypatch.setattr(sysconfig, "get_paths", lambda scheme=None: {"include": str(headers)})
    monkeypatch.setattr(nv, "libcuda_dirs", lambda: ["/usr/lib"])
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/gcc" if name == "gcc" else None)
    assert env.triton_build_reason() is None
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert "no C compiler" in env.triton_build_reason()
    knobs = pytest.importorskip("triton.knobs")  # Triton >= 3.4: a custom build function is trusted
    monkeypatch.setattr(knobs.build, "impl", lambda *args: "module.so")
    assert env.triton_build_reason() is None
    monkeypatch.setattr(knobs.build, "impl", None)
    monkeypatch.setenv("CC", "/nowhere/cc")
    assert "$CC='/nowhere/cc'" in env.triton_build_reason()
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    assert env.triton_build_reason() is None
    (headers / "Python.h").unlink()
    assert "Python.h" in env.triton_build_reason()
    (headers / "Python.h").write_text("")

    def no_libcuda():
        raise AssertionError("libcuda.so cannot found!\nPlease make sure GPU is set up")

    monkeypatch.setattr(nv, "libcuda_dirs", no_libcuda)
    assert "libcuda.so.1 (libcuda.so cannot found!)" in env.triton_build_reason()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(env, "capability_reason", lambda: None)
    monkeypatch.setattr(env, "interpreter_enabled", lambda: False)
    support = env.check_support()
    assert not support.ok and "libcuda" in support.reason


def test_kernel_device_rule(monkeypatch):
    """solution/kernels/_device.py: CUDA sm_75+ with the interpreter off, the CPU with it on,
    nothing else; answers kept per (device, interpreter on/off), the capability asked once."""
    import torch

    from solution.kernels import _device

    monkeypatch.setattr(_device, "_REASONS", ({}, {}))
    asked = []

    def capability(device=None):
        asked.append(device)
        return {0: (7, 5), 1: (7, 0)}[device.index]

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    cpu, t4, v100 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _device.runs_here(cpu) and _device.kernel_device_reason(cpu) is None
    assert "TRITON_INTERPRET=1" in _device.kernel_device_reason(t4) and asked == []
    assert not _device.runs_here(torch.device("meta"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "without the Triton interpreter" in _device.kernel_device_reason(cpu)
    assert _device.runs_here(t4) and _device.runs_here(t4)
    assert "7.0 < 7.5" in _device.kernel_device_reason(v100) and not _device.runs_here(v100)
    assert asked == [t4, v100]  # once per device
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read at each call
    assert _device.runs_here(cpu) and not _device.runs_here(t4)


def test_apply_installs_nothing_on_an_old_triton(monkeypatch, capsys):
    import triton

    import solution
    from solution import _apply

    monkeypatch.setattr(triton, "__version__", "3.1.0")
    solution.revert()
    try:
        assert solution.apply() == {}
        assert "older than 3.2" in capsys.readouterr().out
        assert not _apply.installed()
    finally:
        solution.revert()


def test_report_puts_the_share_in_context():
    """The report says what the own-kernel share is made of, from the report's own figures."""
    from bench.report import _share_context

    rep = {"kernel_split": {"solution": {"total_gpu_s": 1.5}}, "solution": {"train_excl_first2_s": 12.0},
           "own_kernel_gpu_s": 0.45}
    (line,) = _share_context(rep)
    assert "30.0% of the solution's GPU kernel time" in line and "12.5% busy: host-bound" in line
    rep["solution"]["train_excl_first2_s"] = 2.0
    assert "GPU-bound" in _share_context(rep)[0]
    assert _share_context({"kernel_split": {"solution": None}, "solution": {}}) == []


def test_report_shows_the_host_split_side_by_side():
    """The report's host-split section: both variants in ms a step, nested rows indented, and
    nothing when either pass is missing."""
    from bench.report import _host_split_section

    def split(fwd, dec, bwd, wall):
        return {"steps": 2, "wall_s": wall, "calls": {"forward": 2, "module transformers Qwen2MLP": 56},
                "phases_s": {"forward": fwd, "decoder": dec, "backward": bwd, "other": wall - fwd - bwd,
                             "module transformers Qwen2MLP": dec / 4}}

    rep = {"workload": {"steps": 64}, "host_split": {"baseline": split(0.2, 0.18, 0.2, 0.5),
                                                     "solution": split(0.1, 0.09, 0.08, 0.3)}}
    text = "\n".join(_host_split_section(rep))
    assert "| whole step | 250.0 | 150.0 | | |" in text
    assert "| forward | 100.0 | 50.0 | 1 | 1 |" in text
    assert "| &nbsp;&nbsp;decoder | 90.0 | 45.0 |  |  |" in text
    assert "| &nbsp;&nbsp;module transformers Qwen2MLP | 22.5 | 11.2 | 28 | 28 |" in text
    rep["host_split"]["solution"] = None
    assert _host_split_section(rep) == []


def test_report_says_by_how_much_a_target_is_missed():
    from bench.report import _targets_section

    rep = {"baseline": {"train_excl_first2_s": 15.0, "step_times_s": [1.0] * 64, "peak_mem_allocated_bytes": 10 * 2**30},
           "solution": {"train_excl_first2_s": 6.0, "step_times_s": [1.0] * 64, "peak_mem_allocated_bytes": 4 * 2**30},
           "kernel_split": {"baseline": {"total_gpu_s": 3.0}, "solution": {"total_gpu_s": 0.9}}}
    text = "\n".join(_targets_section(rep))
    assert "| training time excl. first 2 steps (s) | 0.400 | <= 1/3 | missed by 1 (5 needed) |" in text
    assert "| peak GPU memory allocated (GiB) | 0.400 | <= 1/2 | met |" in text
    assert "| peak GPU memory reserved (GiB) | n/a | <= 1/2 | not measured |" in text
    assert "| GPU kernel time, steps 3-64 (s) | 0.300 | <= 1/3 | met |" in text


def test_report_lists_the_cuda_graph_captures():
    """The report says how many decoder-graph captures ran, how much of their time is inside the
    timed steps, and that peak allocated memory does not count the graph pool; or why no graph ran."""
    from bench.report import _cuda_graph_lines

    caps = [{"tokens": 1152, "seconds": 1.0, "step": 1}, {"tokens": 1408, "seconds": 0.2, "step": 2},
            {"tokens": 896, "seconds": 0.18, "step": 5}]
    rep = {"solution": {"cuda_graphs": {"captures": caps, "failed": [], "capture_s_excl_first2": 0.18}}}
    text = "\n".join(_cuda_graph_lines(rep))
    assert ("3 captures (2 in the first two steps, 0 of them captured ahead from the dataset's predicted buckets), "
            "1.38 s in all, 0.18 s of them inside the timed steps") in text
    assert "1152, 1408, 896" in text and "peak *reserved*" in text
    rep = {"solution": {"cuda_graphs": {"captures": [], "failed": [], "refused": ["$SOLUTION_CUDA_GRAPHS is not 1"]}}}
    assert "not used ($SOLUTION_CUDA_GRAPHS is not 1)" in _cuda_graph_lines(rep)[0]
    # graphs decided off: the decision says why
    off = {"graphs": False, "reason": "GPU-bound (x)"}
    rep = {"solution": {"cuda_graphs": {"captures": [], "refused": [], "decisions": [off]}}}
    assert "decoder CUDA graphs off: GPU-bound (x)." in _cuda_graph_lines(rep)[0]
    assert _cuda_graph_lines({"solution": {}}) == []


def test_cuda_graph_captures_are_placed_in_their_steps(monkeypatch):
    from bench import run_one
    from solution.step import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "CAPTURES", [{"tokens": 128, "seconds": 0.5, "t": 0.5},
                                                     {"tokens": 256, "seconds": 0.25, "t": 2.5},
                                                     {"tokens": 384, "seconds": 0.125, "t": 3.5}])
    st = run_one.cuda_graph_summary([1.0, 2.0, 3.0, 4.0])  # step ends
    assert [c["step"] for c in st["captures"]] == [1, 3, 4]
    assert st["capture_s_excl_first2"] == 0.375 and "t" not in st["captures"][0]


def test_compile_log_records_steps_and_restores_triton_hooks(tmp_path):
    """bench/compile_log.py: the hooks go in and come out of triton.knobs, each compile is recorded
    with its step and duration, and the summary / report line count them per step."""
    from types import SimpleNamespace

    from bench.compile_log import CompileLog
    from bench.report import _compile_line

    step = {"now": None}
    log = CompileLog(step_of=lambda: step["now"])
    installed = log.install()
    try:
        from triton import knobs
    except ImportError:
        knobs = None
    if installed:
        assert knobs.runtime.jit_cache_hook == log._before
    fn = SimpleNamespace(module="solution.kernels.rmsnorm", name="_rmsnorm_fwd_kernel")
    for now, key in ((1, "a"), (1, "b"), (5, "c")):
        step["now"] = now
        kw = dict(key=key, repr=f"k[{key}]", fn=fn, compile={"specialization_data": "{}"}, is_manual_warmup=False,
                  already_compiled=False)
        assert log._before(**kw) is None and log._after(**kw) is None
    assert log._after(unexpected="argument") is None and log._before() is None  # never raises
    log.uninstall()
    if installed:
        assert knobs.runtime.jit_cache_hook is None or knobs.runtime.jit_cache_hook != log._before
    s = log.summary()
    assert s["compiles"] == 4 and s["by_step"]["1"]["compiles"] == 2 and s["by_step"]["5"]["compiles"] == 2
    assert s["by_kernel"]["solution.kernels.rmsnorm._rmsnorm_fwd_kernel"] == 3
    log.write(tmp_path / "compiles.md")
    assert "| 1 | 2 |" in (tmp_path / "compiles.md").read_text(encoding="utf-8")
    assert (tmp_path / "compiles.json").is_file()
    line = _compile_line({"compile_log": {"solution": {**s, "available": True}}})
    assert line.startswith("Triton JIT compiles in the solution's host-split pass: 4 (step 1: 2")




def test_cprofile_steps_parse_and_refuse():
    import argparse

    from bench.run_one import parse_steps

    assert parse_steps("1-1") == (1, 1)
    assert parse_steps("3-end") == (3, None)
    assert parse_steps("2") == (2, None)
    for bad in ("0-1", "3-2", "a-b"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_steps(bad)


def test_timed_table_reads_a_result(tmp_path, capsys):
    from bench import timed_table

    r = {"step_times_s": [1.5, 2.5, 0.1], "train_excl_first2_s": 0.1, "tracker": {"runs": [{"duration_secs": 4.2}]},
         "cuda_graphs": {"captures": [{"seconds": 0.2, "step": 2}], "capture_s_excl_first2": 0.0, "decisions": []},
         "peak_mem_reserved_bytes": 2**30, "peak_mem_allocated_bytes": 2**29, "host_probe": {"us_per_call": 6.25}}
    (tmp_path / "r.json").write_text(json.dumps(r), encoding="utf-8")
    timed_table.main([f"a={tmp_path / 'r.json'}", f"b={tmp_path / 'missing.json'}"])
    out = capsys.readouterr().out
    assert "| a | 1.50 | 2.50 | 0.10 | 4.20 | 1 / 0.20 / 0.00 | 1.00 / 0.50 / 0.00 | - | - | 6.2 |" in out, out
    assert "| b | no result" in out


def test_pool_split_by_pool():
    from bench.memory_peak import pool_split

    segs = [{"segment_pool_id": (0, 0), "total_size": 4, "allocated_size": 3},
            {"segment_pool_id": (0, 7), "total_size": 10, "allocated_size": 0},
            {"segment_pool_id": (0, 0), "total_size": 2, "allocated_size": 2}]
    assert pool_split(segs) == [{"pool": "(0, 7)", "reserved_bytes": 10, "allocated_bytes": 0, "segments": 1},
                                {"pool": "(0, 0)", "reserved_bytes": 6, "allocated_bytes": 5, "segments": 2}]


def test_reserved_replay_splits_the_pools_and_names_the_eager_high_water():
    """The segment events are replayed per pool (a private pool known by its segments' addresses):
    the peak reserved total, and the eager pool's highest allocated total between its last shrink
    and that peak, with what is alive in it then."""
    from bench import memory_peak

    here = [{"filename": "/work/main/solution/x.py", "line": 1, "name": "f"}]
    there = [{"filename": "/work/main/solution/y.py", "line": 2, "name": "g"}]
    snap = {"segments": [{"address": 1000, "total_size": 100, "segment_pool_id": (1, 2)}],
            "device_traces": [[
                {"action": "segment_map", "addr": 0, "size": 850},
                {"action": "alloc", "addr": 0, "size": 850, "frames": here},  # an early eager step
                {"action": "free_requested", "addr": 0, "size": 850},
                {"action": "segment_unmap", "addr": 0, "size": 850},  # empty_cache
                {"action": "segment_map", "addr": 0, "size": 500},
                {"action": "alloc", "addr": 0, "size": 400, "frames": here},
                {"action": "segment_map", "addr": 1000, "size": 100},  # the graph pool
                {"action": "alloc", "addr": 1000, "size": 100, "frames": here},
                {"action": "free_requested", "addr": 1000, "size": 100},
                {"action": "free_requested", "addr": 0, "size": 400},
                {"action": "alloc", "addr": 0, "size": 50, "frames": there},
                {"action": "segment_map", "addr": 500, "size": 300},
                {"action": "alloc", "addr": 100, "size": 650, "frames": here},
                {"action": "free_requested", "addr": 100, "size": 650},
            ]]}
    br = memory_peak.reserved_breakdown(snap)
    assert br["peak"]["reserved"] == 900 and br["peak"]["pools_reserved"] == {"eager": 800, "private": 100}
    assert br["peak"]["event"] == 11 and br["peak"]["window_start"] == 4
    assert br["eager_top"]["eager_allocated"] == 700 and br["eager_top"]["event"] == 12
    assert [(site, n) for site, n, _ in br["eager_by_site"]] == [("solution/x.py:1 f", 650), ("solution/y.py:2 g", 50)]
    assert "peak reserved" in memory_peak.format_reserved(br) and "stream 0: " in memory_peak.format_reserved(br)
    assert br["eager_growth_total_by_stream"] == {0: 800} and br["eager_growth"][0][3] == "solution/x.py:1 f"
    assert br["peak"]["eager_reserved_by_stream"] == {0: 800} and br["eager_top"]["eager_allocated_top_by_stream"] == {0: 700}
    # ranges remembered at the end of training count too (the graphs may be gone at the snapshot)
    snap["segments"] = []
    memory_peak.remember_private_ranges([{"address": 1000, "total_size": 100, "segment_pool_id": (1, 2)}])
    try:
        assert memory_peak.reserved_breakdown(snap)["peak"]["pools_reserved"]["private"] == 100
    finally:
        memory_peak._remembered_private.clear()


def test_op_origins_group_ops_by_their_launching_line():
    """bench/op_origins.py: op events grouped by (aten op, innermost non-torch frames), GPU time
    summed, kernel events and ops without GPU work dropped, largest first; an op of the backward
    (no Python frame) is named by its autograd node; the table names op and origin."""
    from types import SimpleNamespace as NS

    from bench import op_origins

    here = ["/usr/lib/python3/site-packages/torch/nn/functional.py(10): linear",
            "/work/main/solution/kernels/nf4_linear.py(143): dequant_and_cast",
            "/work/main/solution/patches/bnb_linear4bit.py(40): forward",
            "/usr/lib/python3/site-packages/transformers/models/qwen2/modeling_qwen2.py(90): forward",
            "/work/main/bench/run_one.py(1): main"]
    node = NS(name="autograd::engine::evaluate_function: MulBackward0", cpu_parent=None)
    cpu = "DeviceType.CPU"
    events = [NS(name="aten::copy_", stack=here, self_device_time_total=300.0, device_type=cpu),
              NS(name="aten::copy_", stack=list(here), self_device_time_total=100.0, device_type=cpu),
              NS(name="aten::mul", stack=["/work/main/solution/kernels/lora_nf4.py(300): backward"],
                 cpu_parent=NS(name="aten::mul_", cpu_parent=node),
                 self_device_time_total=60.0, device_type=cpu),
              NS(name="aten::add", stack=[], cpu_parent=None, self_device_time_total=50.0, device_type=cpu),
              NS(name="some_kernel", stack=[], self_device_time_total=400.0, device_type="DeviceType.CUDA"),
              NS(name="aten::view", stack=here, self_device_time_total=0.0, device_type=cpu)]
    rows = op_origins.rows_from(events)
    assert [(r["op"], r["gpu_ms"], r["calls"]) for r in rows] == [
        ("aten::copy_", 0.4, 2), ("aten::mul", 0.06, 1), ("aten::add", 0.05, 1)]
    assert rows[0]["origin"] == ("solution/kernels/nf4_linear.py(143): dequant_and_cast < solution/patches/"
                                 "bnb_linear4bit.py(40): forward < transformers/models/qwen2/modeling_qwen2.py(90): forward")
    assert rows[1]["origin"] == "backward of MulBackward0: solution/kernels/lora_nf4.py(300): backward"
    assert rows[2]["origin"] == "(no Python frame)"
    text = op_origins.format_rows(rows, steps=3)
    assert "aten::copy_" in text and "78.4%" in text and "launched from" in text
    assert "not matrix products or attention: 0.510 ms a step in 3 rows" in text
    mm = op_origins.rows_from([NS(name="aten::mm", stack=here + ["nn.Module: Qwen2MLP_21"],
                                  self_device_time_total=9.0, device_type=cpu)])
    assert mm[0]["origin"].endswith("< transformers/models/qwen2/modeling_qwen2.py(90): forward")
    assert op_origins.origin(["nn.Module: Qwen2MLP_21"]) == "nn.Module: Qwen2MLP"  # one row for all layers
    assert "in 0 rows" in op_origins.format_rows(mm, steps=1)


def test_op_origins_profiler_records_python_frames_on_the_cpu():
    """The profiler as started puts Python frames on the op events (torch >= 2.11 needs the
    verbose experimental config for that; without it every row read "(no Python frame)")."""
    import torch

    from bench import op_origins

    prof = op_origins.start()
    torch.ones(8).add_(1)
    prof.__exit__(None, None, None)
    adds = [ev for ev in prof.events() if ev.name == "aten::add_"]
    assert adds and any("test_harness.py" in fr for fr in adds[0].stack)


def test_op_origins_profiler_runs_on_the_cpu():
    """start/stop on the CPU: the profiler runs, and ops with no GPU time give no row."""
    import torch

    from bench import op_origins

    prof = op_origins.start()
    torch.ones(8).add_(1)  # a CPU op: no GPU time, no row
    assert op_origins.stop(prof, steps=1) == []


def test_op_origins_and_profile_are_refused_together(tmp_path, capsys):
    from bench import run_one

    with pytest.raises(SystemExit) as exc:
        run_one.main(["--variant", "solution", "--model", "m", "--data", "d", "--workdir", str(tmp_path),
                      "--profile", "--op-origins", str(tmp_path / "o.md")])
    assert exc.value.code == 2 and "separate passes" in capsys.readouterr().err


def test_kernel_rates_divide_the_modelled_bytes_by_the_profiled_time(tmp_path, capsys):
    """bench/kernel_rates.py: GPU ms a step from the profile (steps 3-N), bytes from the workload's
    model at the layers' mean token count (bucketed when graphs ran), GB/s and % of the copy."""
    from bench import kernel_rates

    steps = 6  # 4 timed steps
    logs = [{"num_tokens": 1000.0 * (i + 1)} for i in range(steps)]  # 1000 real tokens a step
    result = {"step_times_s": [0.1] * steps, "trainer_logs": logs,
              "profile": {"kernel_times_s": {"_swiglu_fwd_kernel": 4 * 0.5e-3, "unmodelled_kernel": 1.0}}}
    t, r, rl = kernel_rates.token_counts(result)
    assert (t, r) == (1000.0, 1000.0) and abs(rl - 640.0) < 1e-9
    (row,) = kernel_rates.rows(result, copy_gbs=4000.0)
    assert row["kernel"] == "_swiglu_fwd_kernel" and abs(row["gpu_ms_per_step"] - 0.5) < 1e-12
    nbytes = 28 * 6 * 1000 * 8960
    assert abs(row["gb_s"] - nbytes / 0.5e-3 / 1e9) < 1e-6 and abs(row["pct_of_copy"] - 100 * row["gb_s"] / 4000) < 1e-9
    result["cuda_graphs"] = {"captures": [{"tokens": 1280}, {"tokens": 1024}]}  # graphs on: the run's buckets
    assert kernel_rates.token_counts(result)[0] == 1024.0  # the smallest captured bucket above 1000
    path = tmp_path / "result.json"
    path.write_text(json.dumps(result))
    assert kernel_rates.main([str(path)]) == 0
    assert "| `_swiglu_fwd_kernel` | 0.500 |" in capsys.readouterr().out
    import torch

    if not torch.cuda.is_available():  # the T4 script's --measure-copy: refused with one line without a GPU
        assert kernel_rates.main([str(path), "--measure-copy"]) == 2
        assert "no CUDA GPU" in capsys.readouterr().err


def test_step_walks_bench_runs_and_agrees(capsys):
    """bench/step_walks.py (the host time of the graphs' per-step walk, CPU): on a 2-layer model it
    runs, prints its table and finds the same hooks, dropouts and parameters both ways (exit 0)."""
    from bench import step_walks

    assert step_walks.main(["--layers", "2", "--reps", "3"]) == 0
    out = capsys.readouterr().out
    assert "same answers: yes" in out and "`_scan`, one walk (now)" in out
    assert "same norm: yes" in out  # the Trainer's clip, stock against patches/trainer_clip.py


@pytest.mark.parametrize("module", ["compare", "rules", "report", "rebuild_report", "summary_merge", "variants",
                                    "run_one", "kernel_rates", "step_walks"])
def test_help_names_the_command_the_user_types(module, capsys):
    """--help and usage errors show ``python -m bench.X``, the command the README gives, not the file name."""
    import importlib

    main = importlib.import_module(f"bench.{module}").main
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m bench.{module} ")
