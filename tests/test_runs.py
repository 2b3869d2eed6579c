"""bench/runs.py and bench.compare --runs: the named runs, their plan, the children they start,
the report and summary that keep every run under its name with the call it came from, and
bench.rebuild_report assembling the runs of several calls (CPU only: fake children)."""
import json
from types import SimpleNamespace

import pytest
import yaml

from bench import compare, rebuild_report, report, runs
from workload.config import load_workload

ISSUE_RUNS = ("shipped", "shipped-graphs-off", "gpu-bound-sm16", "ckpt", "long", "short", "shipped-cold",
              "shipped-same-allocator", "outliers")


def test_the_registry_has_every_run_the_issues_ask_for():
    assert set(ISSUE_RUNS) <= set(runs.RUNS)
    r = runs.RUNS
    assert r["shipped-graphs-off"].variant_env("solution") == {"SOLUTION_CUDA_GRAPHS": "0"}
    assert r["shipped-graphs-off"].variant_env("baseline") == {}
    assert r["gpu-bound-sm16"].sms == 16 and r["gpu-bound-sm16"].env == {}  # the solution at its defaults
    assert r["ckpt"].workload == {"training.gradient_checkpointing": True}
    assert r["shipped-same-allocator"].variant_env("baseline") == {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert r["shipped-same-allocator"].variant_env("solution") == {}  # the solution as shipped
    assert r["outliers"].standin_profile == "outliers"
    assert r["shipped-cold"].cold and (r["long"].shape, r["short"].shape) == ("long", "short")
    for spec in r.values():  # every run says what it is, in English and Russian
        assert spec.about and spec.about_ru and runs.RunSpec.from_dict(spec.to_dict()) == spec


def test_shapes_and_cold_map_onto_runs_of_the_same_names():
    assert runs.from_shapes(["shipped", "long"], cold=True) == ["shipped", "long", "shipped-cold"]
    assert runs.from_shapes(["short"], cold=False) == ["short"]
    assert compare.plan_runs(["shipped"], cuda=True, cold=True) == runs.plan(
        [runs.RUNS["shipped"], runs.RUNS["shipped-cold"]], cuda=True)


def test_plan_gives_each_run_its_own_passes():
    specs = [runs.RUNS[n] for n in ISSUE_RUNS]
    plan = runs.plan(specs, cuda=True)
    modes = {n: sorted({m for k, _, m in plan if k == n}) for n in ISSUE_RUNS}
    assert modes["shipped"] == ["hostsplit", "profiled", "profiled-eager", "timed"]
    assert modes["gpu-bound-sm16"] == ["profiled", "timed"]
    for n in ("shipped-graphs-off", "ckpt", "shipped-cold", "shipped-same-allocator", "outliers"):
        assert modes[n] == ["timed"], n
    assert {m for _, _, m in runs.plan(specs, cuda=False)} == {"timed"}  # a CPU has no profiler passes
    assert [k for k, _, _ in plan][:2] == ["shipped", "shipped"]  # in the order given
    # the eager profile is the T4's path: graphs off and, as on a GPU-bound machine, no eager token bucket
    assert runs.MODE_ENV[runs.EAGER_PROFILED] == {"SOLUTION_CUDA_GRAPHS": "0"}


def test_sms_renames_a_run_and_refuses_another_partition():
    spec = runs.with_sms(runs.RUNS["shipped"], 8)
    assert (spec.name, spec.sms) == ("shipped-sm8", 8) and "8-SM partition" in runs.describe(spec)
    assert runs.with_sms(runs.RUNS["gpu-bound-sm16"], 16) is runs.RUNS["gpu-bound-sm16"]
    assert runs.with_sms(runs.RUNS["shipped"], None) is runs.RUNS["shipped"]
    with pytest.raises(runs.RunsError, match="own partition of 16 SMs"):
        runs.with_sms(runs.RUNS["gpu-bound-sm16"], 8)


def test_describe_names_every_condition():
    text = runs.describe(runs.RUNS["shipped-same-allocator"])
    assert text == "data shipped; baseline: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    assert runs.describe(runs.RUNS["ckpt"]) == "data shipped; training.gradient_checkpointing: true"
    assert "16-SM partition" in runs.describe(runs.RUNS["gpu-bound-sm16"])


# --- bad requests: one line, nothing run ----------------------------------------------------------

def _refused(monkeypatch, capsys, tmp_path, argv, *needles):
    def no_run(*a, **kw):
        raise AssertionError("nothing may run")

    monkeypatch.setattr(compare, "run_variant", no_run)
    monkeypatch.setattr(compare, "resolve_inputs", no_run)
    rc = compare.main(argv + ["--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert all(n in err for n in needles), err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, needles", [
    (["--runs", "shipped,huge"], ("unknown run 'huge'", "shipped-graphs-off")),
    (["--runs", "shipped", "--shapes", "long"], ("without --shapes / --cold",)),
    (["--runs", "shipped", "--cold"], ("without --shapes / --cold",)),
    (["--runs", "shipped", "--profile-shapes", "long"], ("--profile-shapes", "unknown run of this comparison 'long'")),
    (["--runs", "gpu-bound-sm16", "--sms", "8"], ("own partition of 16 SMs",)),
])
def test_bad_runs_are_refused_before_any_run(tmp_path, capsys, monkeypatch, argv, needles):
    _refused(monkeypatch, capsys, tmp_path, argv, *needles)


def test_a_partition_without_a_gpu_is_one_error_line(tmp_path, capsys, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the CPU's answer")
    _refused(monkeypatch, capsys, tmp_path, ["--runs", "gpu-bound-sm16"], "run 'gpu-bound-sm16' (16-SM partition)",
             "needs a CUDA GPU")
    _refused(monkeypatch, capsys, tmp_path, ["--sms", "16", "--runs", "shipped"], "--sms 16", "needs a CUDA GPU")


def test_a_stand_in_profile_is_refused_with_a_user_model(tmp_path):
    args = SimpleNamespace(runs="outliers", shapes=None, cold=None, sms=None, model="/some/model")
    with pytest.raises(compare.InputError, match="stand-in's 'outliers' weights: give it without --model"):
        compare.select_runs(args, cuda=False)


def test_workload_overrides_pass_the_workload_checks(tmp_path):
    from workload.config import WORKLOAD_FILE

    texts = compare.run_workloads([runs.RUNS["ckpt"], runs.RUNS["shipped"]], WORKLOAD_FILE)
    assert list(texts) == ["ckpt"]
    raw = yaml.safe_load(texts["ckpt"])
    assert raw["training"]["gradient_checkpointing"] is True
    base = yaml.safe_load(WORKLOAD_FILE.read_text(encoding="utf-8"))
    raw["training"].pop("gradient_checkpointing")
    assert raw == base  # nothing else changed
    path = tmp_path / "w.yaml"
    path.write_text(texts["ckpt"], encoding="utf-8")
    assert load_workload(path).soup_dict("m", "d", "o")["training"]["gradient_checkpointing"] is True
    bad = runs.RunSpec("bad", "x", "x", workload={"training.steps": 3})
    with pytest.raises(compare.InputError, match="run 'bad': its workload override .* refused"):
        compare.run_workloads([bad], WORKLOAD_FILE)


def test_a_missing_stand_in_profile_is_one_clear_error(monkeypatch):
    import workload.model_standin as ms

    def old_write_standin(out, size="full", seed=1234, tokenizer_source=None):
        raise AssertionError("not called")

    monkeypatch.setattr(ms, "write_standin", old_write_standin)
    args = SimpleNamespace(size="tiny", tokenizer=None)
    with pytest.raises(compare.InputError, match="needs workload/model_standin.py's write_standin"):
        compare.standin_model(args, load_workload(), "outliers")


def test_the_profile_is_passed_through_to_the_stand_in(monkeypatch):
    import workload.model_standin as ms

    seen = {}

    def write_standin(out, size="full", seed=1234, tokenizer_source=None, profile=None):
        seen.update(out=str(out), profile=profile, size=size)
        return out

    monkeypatch.setattr(ms, "write_standin", write_standin)
    path = compare.standin_model(SimpleNamespace(size="tiny", tokenizer=None), load_workload(), "outliers")
    assert seen == {"out": path, "profile": "outliers", "size": "tiny"} and path.endswith("-tiny-outliers")
    compare.standin_model(SimpleNamespace(size="tiny", tokenizer=None), load_workload())
    assert seen["profile"] is None and seen["out"].endswith("standin-tiny")


# --- a whole comparison of named runs, with fake children -----------------------------------------

def _result(variant, losses=(2.0, 1.9, 1.8, 1.7), step=1.0, gib=2.0):
    logs = [{"step": i + 1, "loss": loss, "num_tokens": 100 * (i + 1)} for i, loss in enumerate(losses)]
    steps = [3 * step, 2 * step] + [step] * (len(losses) - 2)
    return {"variant": variant, "steps": len(losses), "trainer_logs": logs, "step_times_s": steps,
            "train_excl_first2_s": sum(steps[2:]), "peak_mem_reserved_bytes": int(gib * 2**30),
            "peak_mem_allocated_bytes": int(gib * 2**29), "tracker": {"runs": [{"duration_secs": sum(steps) + 1}]},
            "rc": 0}


def test_named_runs_start_their_children_as_specified(tmp_path, monkeypatch):
    calls = []

    def fake_run(variant, model, data, out, mode, workload, label=None, cold=False, env=None, sms=None, **kw):
        calls.append(dict(variant=variant, model=model, out=out, mode=mode, workload=workload, label=label,
                          cold=cold, env=env, sms=sms, **kw))
        return _result(variant, step=0.5 if variant == "solution" else 1.0)

    monkeypatch.setattr(compare, "run_variant", fake_run)
    monkeypatch.setattr(compare, "resolve_inputs", lambda args, workload=None: ("model", "d.jsonl", "stand-in (test)"))
    monkeypatch.setattr(compare, "standin_model", lambda args, workload, profile=None: f"model-{profile}")
    out = tmp_path / "out"
    names = "shipped,ckpt,shipped-same-allocator,shipped-graphs-off,outliers"
    # timed passes only (a CPU's default; a GPU's adds profiled and host-split passes)
    compare.main(["--runs", names, "--out", str(out), "--no-profile", "--no-host-split"])
    by = {(c["out"].name if c["out"] != out else "shipped", c["variant"]): c for c in calls}
    assert len(calls) == 10 and {c["mode"] for c in calls} == {"timed"}
    assert by["shipped", "solution"]["label"] is None and by["ckpt", "baseline"]["label"] == "ckpt"
    assert by["shipped-graphs-off", "solution"]["env"] == {"SOLUTION_CUDA_GRAPHS": "0"}
    assert by["shipped-graphs-off", "baseline"]["env"] == {}
    assert by["shipped-same-allocator", "baseline"]["env"] == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert by["shipped-same-allocator", "solution"]["env"] == {}
    ckpt = by["ckpt", "solution"]["workload"]
    assert ckpt == str(out / "ckpt" / "workload.yaml") and by["ckpt", "baseline"]["workload"] == ckpt
    assert load_workload(ckpt).raw["training"]["gradient_checkpointing"] is True
    assert by["shipped", "baseline"]["workload"] is None  # the default workload
    assert by["outliers", "baseline"]["model"] == by["outliers", "solution"]["model"] == "model-outliers"
    assert by["shipped", "baseline"]["model"] == "model"
    assert all(c["sms"] is None and not c["cold"] for c in calls)
    assert by["ckpt", "baseline"]["run"] == "ckpt" and by["shipped", "solution"]["run"] == "shipped"
    assert {c["timeout_s"] for c in calls} == {compare.CHILD_TIMEOUT_S}  # no --child-timeout: the default
    machine = json.loads((out / "machine.json").read_text(encoding="utf-8"))
    assert list(machine["runs"]) == names.split(",") and machine["runs"]["ckpt"]["workload"] == {
        "training.gradient_checkpointing": True}
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    assert list(summary["runs"]) == names.split(",")
    for name, run in summary["runs"].items():
        assert run["call"]["command"] == f"python -m bench.compare --runs {names} --out {out} --no-profile --no-host-split"
        assert run["run"]["about"] == runs.RUNS[name].about
    assert summary["runs"]["ckpt"]["solution"]["train_excl_first2_s"] == 1.0
    md = (out / "report.md").read_text(encoding="utf-8")
    assert "## Runs and the calls they came from" in md and "| shipped-same-allocator | baseline |" in md


# --- bench.rebuild_report: the runs of several calls in one report --------------------------------

def _put(folder, rel, result):
    (folder / rel).mkdir(parents=True)
    (folder / rel / "result.json").write_text(json.dumps(result), encoding="utf-8")
    (folder / rel / "log.txt").write_text("Training Complete!", encoding="utf-8")


def _machine(folder, names, commit="abc1234", date="2026-12-02T10:00:00+00:00", argv=None):
    m = {"gpu": {"name": "NVIDIA H200", "capability": "9.0"}, "versions": {"torch": "x"}, "commit": commit,
         "date": date, "argv": argv or ["--runs", ",".join(names)], "data": "d.jsonl",
         "runs": {n: runs.RUNS[n].to_dict() for n in names}}
    (folder / "machine.json").write_text(json.dumps(m), encoding="utf-8")
    return m


def test_rebuild_assembles_several_calls_and_says_which_run_came_from_which(tmp_path, capsys):
    a, b, into = tmp_path / "a", tmp_path / "b", tmp_path / "all"
    _put(a, "baseline", _result("baseline"))
    _put(a, "solution", _result("solution", step=0.5))
    _put(a, "shipped-graphs-off/baseline", _result("baseline"))
    _put(a, "shipped-graphs-off/solution", _result("solution", step=0.9))
    _put(b, "ckpt/baseline", _result("baseline", step=2.0))
    _put(b, "ckpt/solution", _result("solution", step=1.0))
    _put(b, "shipped-same-allocator/baseline", _result("baseline", gib=1.5))  # its solution never finished
    _put(b, "shipped-graphs-off/baseline", _result("baseline", step=5.0))  # a second copy: the first one stays
    _put(b, "shipped-graphs-off/solution", _result("solution", step=5.0))
    _machine(a, ["shipped", "shipped-graphs-off"], date="2026-12-02T10:00:00+00:00")
    _machine(b, ["ckpt", "shipped-same-allocator", "shipped-graphs-off"], date="2026-12-02T11:00:00+00:00")
    assert rebuild_report.main([str(a), str(b), "--into", str(into)]) in (0, 1)
    err = capsys.readouterr().err
    assert "shipped-graphs-off: kept from" in err
    summary = json.loads((into / "summary.json").read_text(encoding="utf-8"))
    assert list(summary["runs"]) == ["shipped", "shipped-graphs-off", "ckpt"]
    assert summary["runs"]["shipped"]["call"]["date"] == "2026-12-02T10:00:00+00:00"
    assert summary["runs"]["ckpt"]["call"]["date"] == "2026-12-02T11:00:00+00:00"
    assert summary["runs"]["ckpt"]["call"]["command"] == (
        "python -m bench.compare --runs ckpt,shipped-same-allocator,shipped-graphs-off")
    assert summary["runs"]["shipped-graphs-off"]["solution"]["train_excl_first2_s"] == pytest.approx(1.8)
    rep = json.loads((into / "report.json").read_text(encoding="utf-8"))
    assert rep["rebuilt"]["folders"] == [str(a), str(b)]
    assert any("shipped-same-allocator/baseline (finished, left out" in m for m in rep["rebuilt"]["missing_runs"])
    md = (into / "report.md").read_text(encoding="utf-8")
    assert md.startswith("> **Rebuilt** by `bench.rebuild_report` from the run folders of 2 comparisons")
    assert not (a / "report.json").exists() and not (b / "report.json").exists()  # the folders are left alone


def test_rebuild_refuses_calls_of_different_commits(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    _put(a, "baseline", _result("baseline"))
    _put(a, "solution", _result("solution"))
    _put(b, "ckpt/baseline", _result("baseline"))
    _put(b, "ckpt/solution", _result("solution"))
    _machine(a, ["shipped"])
    _machine(b, ["ckpt"], commit="def5678")
    assert rebuild_report.main([str(a), str(b), "--into", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "different commits" in err and "def5678" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()
    assert rebuild_report.main([str(a), str(b)]) == 2 and "--into" in capsys.readouterr().err


# --- memory on equal terms; Soup's duration beside steps 3-N; a CPU's first line -----------------

def _report(monkeypatch, gpu="NVIDIA H200", same_allocator=True):
    monkeypatch.setattr(compare, "_gpu", lambda: {"name": gpu, "capability": "9.0" if gpu != "cpu" else None})
    base, sol = _result("baseline", gib=15.0), {**_result("solution", step=0.5, gib=6.0),
                                                "installed": {"cuda_allocator": "expandable segments"}}
    base["peak_mem_allocated_bytes"] = int(13.0 * 2**30)
    sol["peak_mem_allocated_bytes"] = int(5.5 * 2**30)
    others = {}
    if same_allocator:
        b2 = {**_result("baseline", gib=13.5), "peak_mem_allocated_bytes": int(13.0 * 2**30)}
        s2 = {**_result("solution", step=0.5, gib=6.0), "peak_mem_allocated_bytes": int(5.5 * 2**30)}
        others["shipped-same-allocator"] = {"data": "d.jsonl", "baseline": b2, "solution": s2}
    return compare.build_report(SimpleNamespace(argv=[]), "stand-in (full)", base, sol, None, None, load_workload(),
                                shape="shipped", data="d.jsonl", others=others)


def test_memory_leads_with_allocated_and_shows_the_same_allocator_baseline(monkeypatch):
    rep = _report(monkeypatch)
    rows = report.memory_rows(rep)
    assert [(r[0], r[1]) for r in rows] == [("shipped", "baseline"), ("shipped", "solution"),
                                            ("shipped-same-allocator", "baseline"),
                                            ("shipped-same-allocator", "solution")]
    assert rows[0][2] == "PyTorch's default" and "PYTORCH_CUDA_ALLOC_CONF" in rows[2][2]
    assert rows[1][2] == "expandable segments (apply())"
    md = report.markdown(rep)
    sec = md.split("## Memory on equal terms")[1].split("\n## ")[0]
    assert "| peak allocated (GiB) | peak reserved (GiB) | reserved / allocated |" in sec
    assert "| shipped | baseline | PyTorch's default | 13.00 | 15.00 | 1.15 |" in sec
    assert "| shipped-same-allocator | baseline | expandable segments (PYTORCH_CUDA_ALLOC_CONF) | 13.00 | 13.50 | 1.04 |" in sec
    assert "- shipped: solution / baseline, peak allocated 0.423, peak reserved 0.400" in sec
    assert "- shipped-same-allocator: solution / baseline, peak allocated 0.423, peak reserved 0.444" in sec
    # every run's table and ratios: allocated before reserved
    cols = [t for _, t in report.FIGURES]
    assert cols.index("peak allocated (GiB)") < cols.index("peak reserved (GiB)")
    assert report.RATIO_FIGURES.index("peak_allocated_gib") < report.RATIO_FIGURES.index("peak_reserved_gib")
    no_run = report.markdown(_report(monkeypatch, same_allocator=False))
    assert "run shipped-same-allocator is not in this report" in no_run


def test_soups_duration_stands_beside_steps_3_n(monkeypatch):
    rep = _report(monkeypatch)
    md = report.markdown(rep)
    targets = md.split("## Against the project's targets")[1].split("\n## ")[0]
    lines = targets.splitlines()
    i = next(n for n, ln in enumerate(lines) if ln.startswith("| training time excl. first 2 steps"))
    assert lines[i + 1].startswith("| training time, Soup's duration (s) |") and "shown beside steps 3-4" in lines[i + 1]
    table = report.summary_table(rep)
    assert "solution / baseline by run (Soup's duration, steps 3-4, first step" in table
    assert table.index("training time, Soup's duration") < table.index("training time excl. first 2 steps")


def test_a_cpu_comparison_says_first_that_its_times_are_no_gpu_times_and_training_is_fp32(monkeypatch):
    first, second = report.summary_table(_report(monkeypatch, gpu="cpu")).splitlines()[:2]
    assert first == report.CPU_FIRST_LINE
    assert second == report.CPU_FP32_LINE and "fp32" in second and "no GradScaler" in second
    assert "say nothing about the GPU" in first and "NF4" in first and "off" in first
    assert report.summary_table(_report(monkeypatch)).splitlines()[0] != report.CPU_FIRST_LINE


# --- scripts/gpu_run.sh runs ------------------------------------------------------------------------

def test_gpu_run_runs_step_calls_compare_with_the_named_runs(tmp_path):
    """The step's command line and what it brings back, with python3 and nvidia-smi stubbed (the
    stub bench.compare writes a summary and a report where it was told)."""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(
        "#!/bin/sh\n"
        f"echo \"$@\" >> {log}\n"
        "if [ \"$1 $2\" = \"-m bench.compare\" ]; then\n"
        "  while [ $# -gt 0 ]; do [ \"$1\" = --out ] && out=$2; shift; done\n"
        "  mkdir -p \"$out\" && echo '{}' > \"$out/summary.json\" && echo report > \"$out/report.md\"\n"
        "fi\nexit 0\n", encoding="utf-8")
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n", encoding="utf-8")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    final, work = tmp_path / "final", tmp_path / "work"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OUT": str(final), "WORK": str(work),
           "RUNS": "shipped,ckpt", "COMPARE_ARGS": "--no-host-split"}
    proc = subprocess.run(["bash", str(root / "scripts" / "gpu_run.sh"), "runs"], env=env, capture_output=True,
                          text=True, timeout=120, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = log.read_text(encoding="utf-8").splitlines()
    assert f"-m bench.compare --runs shipped,ckpt --out {work}/runs-shipped+ckpt --no-host-split" in calls
    # the copies beside results.tgz: '+' becomes '-' (the device tool brings back no name with '+')
    assert (final / "runs-shipped-ckpt-summary.json").is_file() and (final / "runs-shipped-ckpt-report.md").is_file()
    assert (final / "results.tgz").is_file()
    env.pop("RUNS")
    proc = subprocess.run(["bash", str(root / "scripts" / "gpu_run.sh"), "runs"], env=env, capture_output=True,
                          text=True, timeout=120, cwd=str(tmp_path))
    assert proc.returncode == 2 and "error: set RUNS=" in proc.stdout


def test_the_readme_lists_every_named_run():
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    missing = [name for name in runs.RUNS if f"`{name}`" not in readme]
    assert not missing, f"README.md's run list lacks {missing}"


# --- bench.compare --repeat: interleaved pairs, the median pair stands for the run -----------------

def test_repeats_choose_the_median_pair():
    from bench import repeats

    def pair(b, s):
        return _result("baseline", step=b), _result("solution", step=s)

    c = repeats.choose([pair(1.0, 0.5), pair(1.0, 0.9), pair(1.0, 0.6)])
    assert c["chosen"] == 3 and c["steps_ratio_median"] == pytest.approx(0.6)
    assert (c["steps_ratio_min"], c["steps_ratio_max"]) == (pytest.approx(0.5), pytest.approx(0.9))
    assert [r["pair"] for r in c["pairs"]] == [1, 2, 3]
    assert repeats.choose([pair(1.0, 0.8), pair(2.0, 1.0)])["chosen"] == 2  # even count: the lower middle
    no_time = _result("solution")
    no_time["train_excl_first2_s"] = None
    c = repeats.choose([(_result("baseline"), no_time), pair(1.0, 0.7)])
    assert c["chosen"] == 2 and c["pairs"][0]["steps_ratio"] is None
    assert [repeats.timed_mode(i) for i in (1, 2)] == ["timed", "timed-2"]
    assert repeats.folder("solution", 1) == "solution" and repeats.folder("solution", 3) == "solution-timed-3"


def test_compare_repeat_interleaves_the_pairs_and_reports_each(tmp_path, monkeypatch, capsys):
    calls = []
    sol_step = {"timed": 0.5, "timed-2": 0.9, "timed-3": 0.6}

    def fake_run(variant, model, data, out, mode, workload, label=None, cold=False, env=None, sms=None, **kw):
        calls.append((out.name if out.name != "out" else "shipped", variant, mode))
        return _result(variant, step=sol_step[mode] if variant == "solution" else 1.0)

    monkeypatch.setattr(compare, "run_variant", fake_run)
    monkeypatch.setattr(compare, "resolve_inputs", lambda args, workload=None: ("model", "d.jsonl", "stand-in (test)"))
    out = tmp_path / "out"
    compare.main(["--runs", "shipped,ckpt", "--out", str(out), "--no-profile", "--no-host-split", "--repeat", "3"])
    assert calls[:6] == [("shipped", v, m) for m in ("timed", "timed-2", "timed-3") for v in ("baseline", "solution")]
    assert len(calls) == 12
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    for name in ("shipped", "ckpt"):
        run = summary["runs"][name]
        assert run["repeats"]["chosen"] == 3 and len(run["repeats"]["pairs"]) == 3
        assert run["solution"]["train_excl_first2_s"] == pytest.approx(2 * 0.6)  # the median pair's (steps 3-4)
    md = (out / "report.md").read_text(encoding="utf-8")
    assert "## Repeated pairs (--repeat)" in md and "| shipped | 3 |" in md and "0.500-0.900" in md


@pytest.mark.parametrize("n", ["0", "6"])
def test_compare_refuses_a_repeat_out_of_range(tmp_path, capsys, n):
    assert compare.main(["--runs", "shipped", "--out", str(tmp_path / "o"), "--repeat", n]) == 2
    assert "--repeat" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_rebuild_takes_the_same_pair_from_the_repeated_folders(tmp_path):
    a, into = tmp_path / "a", tmp_path / "all"
    for i, s in ((1, 0.5), (2, 0.9), (3, 0.6)):
        suffix = "" if i == 1 else f"-timed-{i}"
        _put(a, f"baseline{suffix}", _result("baseline"))
        _put(a, f"solution{suffix}", _result("solution", step=s))
    _machine(a, ["shipped"], argv=["--runs", "shipped", "--repeat", "3"])
    assert rebuild_report.main([str(a), "--into", str(into)]) in (0, 1)
    run = json.loads((into / "summary.json").read_text(encoding="utf-8"))["runs"]["shipped"]
    assert run["repeats"]["chosen"] == 3
    assert run["solution"]["train_excl_first2_s"] == pytest.approx(2 * 0.6)


# --- scripts/gpu_pipeline.sh and scripts/named_set.plan ----------------------------------------------

def test_gpu_pipeline_runs_the_stages_in_turn_and_brings_each_back_once(tmp_path):
    """Two stages through a stub gpu_run.sh (it records its environment and steps): both run in turn
    in the pipeline's copy of the tree, each comes back as one tar, a later poll brings nothing twice,
    and a second start on the same machine is refused."""
    import os
    import shutil
    import subprocess
    import tarfile
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    shutil.copy(root / "scripts" / "gpu_pipeline.sh", tree / "scripts")
    (tree / "scripts" / "gpu_run.sh").write_text(
        '#!/usr/bin/env bash\nmkdir -p "$OUT"\n'
        'echo "pwd=$PWD args=$* RUNS=${RUNS:-} ARGS=${COMPARE_ARGS:-}" > "$OUT/seen.txt"\n', encoding="utf-8")
    (tree / "plan").write_text('# a comment\n'
                               'one|RUNS=shipped COMPARE_ARGS="--repeat 3 --no-profile"|runs\n'
                               '\n'
                               'two||tests bench\n', encoding="utf-8")
    pipe, out = tmp_path / "pipe", tmp_path / "out"
    env = {**os.environ, "PIPE": str(pipe), "OUT": str(out)}
    script = str(tree / "scripts" / "gpu_pipeline.sh")
    proc = subprocess.run(["bash", script, "start", "plan", "60"], env=env, capture_output=True, text=True,
                          timeout=120, cwd=str(tree))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all stages ended" in proc.stdout
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()[1:] if line.strip()}
    assert rows["one"][0] == "ended" and rows["one"][2] == "0" and rows["two"][0] == "ended"
    with tarfile.open(out / "stage-one.tar") as tar:
        seen = tar.extractfile("out-one/seen.txt").read().decode()
        assert "one.log" in tar.getnames()
    assert f"pwd={pipe / 'tree'} args=runs RUNS=shipped ARGS=--repeat 3 --no-profile" in seen
    with tarfile.open(out / "stage-two.tar") as tar:
        assert "args=tests bench RUNS= ARGS=" in tar.extractfile("out-two/seen.txt").read().decode()
    for f in out.iterdir():
        f.unlink()
    proc = subprocess.run(["bash", script, "poll", "5"], env=env, capture_output=True, text=True, timeout=60,
                          cwd=str(tree))
    assert proc.returncode == 0 and "all stages ended" in proc.stdout and not list(out.iterdir())
    proc = subprocess.run(["bash", script, "start", "plan"], env=env, capture_output=True, text=True, timeout=60,
                          cwd=str(tree))
    assert proc.returncode == 2 and "already started" in proc.stdout


def test_the_named_set_plan_runs_every_named_run_once():
    from pathlib import Path

    plan = (Path(__file__).resolve().parent.parent / "scripts" / "named_set.plan").read_text(encoding="utf-8")
    named = []
    for line in plan.splitlines():
        if line.strip() and not line.startswith("#"):
            assign = line.split("|")[1]
            if "RUNS=" in assign:
                named += assign.split("RUNS=")[1].split()[0].split(",")
    assert sorted(named) == sorted(runs.RUNS)
