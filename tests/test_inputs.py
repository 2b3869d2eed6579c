"""Every bad input refused before a run starts (issue 16): one line `error: ...`, exit status 2,
nothing run and nothing already written lost; and the comparison's exit statuses on rule failures,
signals and a child run past its wall-clock limit (--child-timeout). CPU only; no training runs (the runs are replaced where a test gets that far)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from bench import compare, report, rules
from workload import model_standin
from tests.conftest import pythonpath_without_repo
from workload.config import WORKLOAD_FILE, WorkloadConfigError, load_workload

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "workload" / "data" / "kazakh_instructions.jsonl"
QWEN_CONFIG = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}


@pytest.fixture
def no_runs(monkeypatch):
    """No child run and no stand-in written: any attempt fails the test."""
    def refuse(*a, **kw):
        raise AssertionError("nothing may run before every input is checked")

    monkeypatch.setattr(compare, "run_variant", refuse)
    monkeypatch.setattr(model_standin, "write_standin", refuse)
    for name in ("SOLUTION_MEMORY_POLICY", "SOLUTION_CUDA_GRAPHS", "SOLUTION_GRAPH_BUCKET", "SOLUTION_PRECOMPILE",
                 "SOLUTION_SKIP_PATCHES", "BENCH_CALLER_CWD"):
        monkeypatch.delenv(name, raising=False)


def refused(capsys, argv, *needles) -> str:
    """Run bench.compare with ``argv``; assert exit 2 and one stderr line holding every needle."""
    rc = compare.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert str(needle) in lines[0], (needle, err)
    return lines[0]


def rows_file(path: Path, n: int) -> Path:
    rows = DATA.read_text(encoding="utf-8").splitlines()
    path.write_text("\n".join((rows * 2)[:n]) + "\n", encoding="utf-8")
    return path


def model_dir(path: Path, config: dict) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


# --- 1. relative paths are the caller's ----------------------------------------------------------

def test_relative_paths_are_taken_from_the_callers_directory(tmp_path, monkeypatch, capsys, no_runs):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    rows_file(elsewhere / "ten.jsonl", 10)
    monkeypatch.setenv("BENCH_CALLER_CWD", str(elsewhere))  # what scripts/compare.sh sets
    monkeypatch.chdir(ROOT)  # as scripts/compare.sh runs it: from the repo
    refused(capsys, ["--data", "ten.jsonl", "--out", "out_ten"], f"dataset {elsewhere / 'ten.jsonl'} has 10 rows")
    model_dir(elsewhere / "llama", {"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    refused(capsys, ["--model", "llama", "--out", "out_ten"], f"model {elsewhere / 'llama'} is model_type 'llama'")
    (elsewhere / "out_ten").write_text("mine")
    refused(capsys, ["--out", "out_ten"], f"--out {elsewhere / 'out_ten'} is a file")
    assert not (ROOT / "out_ten").exists() and (elsewhere / "out_ten").read_text() == "mine"
    assert compare.caller_path("a/../b.jsonl") == elsewhere / "b.jsonl"
    assert compare.caller_path(ROOT / "x") == ROOT / "x"


def test_compare_sh_tells_bench_compare_the_callers_directory(tmp_path):
    """scripts/compare.sh changes into the repo; it passes the directory it was started from on
    (a copy of the script in a stand-in repo whose bench.compare prints what it got)."""
    repo, elsewhere = tmp_path / "repo", tmp_path / "elsewhere"
    (repo / "scripts").mkdir(parents=True)
    (repo / "bench").mkdir()
    (repo / ".venv" / "bin").mkdir(parents=True)
    elsewhere.mkdir()
    shutil.copy(ROOT / "scripts" / "compare.sh", repo / "scripts" / "compare.sh")
    (repo / "scripts" / "setup_env.sh").write_text("true\n")
    (repo / ".venv" / "bin" / "activate").write_text(f'PATH="{Path(sys.executable).parent}:$PATH"\n')
    (repo / "bench" / "__init__.py").write_text("")
    (repo / "bench" / "compare.py").write_text(
        "import json, os, sys\n"
        "print(json.dumps({'caller': os.environ.get('BENCH_CALLER_CWD'), 'cwd': os.getcwd(), 'argv': sys.argv[1:]}))\n")
    proc = subprocess.run(["bash", str(repo / "scripts" / "compare.sh"), "--data", "ten.jsonl", "--out", "out_ten"],
                          cwd=str(elsewhere), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(got["caller"]).resolve() == elsewhere.resolve() and Path(got["cwd"]).resolve() == repo.resolve()
    assert got["argv"] == ["--data", "ten.jsonl", "--out", "out_ten"]


# --- 2. the solution's settings, before the first run --------------------------------------------

@pytest.mark.parametrize("name, value", [("SOLUTION_MEMORY_POLICY", "fast"), ("SOLUTION_CUDA_GRAPHS", "maybe"),
                                         ("SOLUTION_GRAPH_BUCKET", "0"), ("SOLUTION_PRECOMPILE", "sometimes"),
                                         ("SOLUTION_SKIP_PATCHES", "qwen2_mlp,qwen2_mpl")])
def test_bad_solution_settings_are_refused_before_the_first_run(tmp_path, monkeypatch, capsys, no_runs, name, value):
    monkeypatch.setenv(name, value)
    refused(capsys, ["--out", tmp_path / "out"], f"${name}", repr(value))
    assert not (tmp_path / "out").exists()


def test_apply_refuses_unknown_patch_names_before_installing_anything(monkeypatch):
    import solution
    from solution import _apply

    solution.revert()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SOLUTION_SKIP_PATCHES", "qwen2_unpad, rmsnorm")
    with pytest.raises(ValueError, match=r"names no patch: rmsnorm \(known: qwen2_layer_node, .*cuda_allocator\)"):
        solution.apply(verbose=False)
    assert solution.installed() == {}
    monkeypatch.setenv("SOLUTION_SKIP_PATCHES", " qwen2_unpad, cuda_allocator,peft_model_walks ")
    assert _apply.check_settings().skip_patches == {"qwen2_unpad", "cuda_allocator", "peft_model_walks"}
    assert _apply.patch_names()[-1] == "cuda_allocator" and len(_apply.patch_names()) == len(_apply.PATCHES) + 1


# --- 3. the dataset's rows against the workload --------------------------------------------------

@pytest.mark.parametrize("rows, steps", [(10, 3), (300, 75)])
def test_dataset_rows_must_be_the_workloads_examples(tmp_path, capsys, no_runs, rows, steps):
    data = rows_file(tmp_path / "d.jsonl", rows)
    before = data.read_bytes()
    refused(capsys, ["--data", data, "--out", tmp_path / "out"], f"has {rows} rows",
            "trains on 256 examples (64 steps of batch 4)", f"would train {steps} steps")
    assert data.read_bytes() == before and not (tmp_path / "out").exists()


# --- 4. the workload file's types and values -----------------------------------------------------

def _workload(tmp_path, mutate, name="w.yaml") -> Path:
    w = yaml.safe_load(WORKLOAD_FILE.read_text(encoding="utf-8"))
    mutate(w)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(w), encoding="utf-8")
    return path


@pytest.mark.parametrize("section, key, value, message", [
    ("lora", "target_modules", "q_proj", "lora.target_modules must be a list of module names"),
    ("training", "batch_size", "four", "training.batch_size must be an integer, got 'four'"),
    ("training", "lr", "fast", "training.lr must be a positive number, got 'fast'"),
    ("lora", "r", "sixteen", "lora.r must be an integer, got 'sixteen'"),
    ("quantization", "mode", "3bit", "Soup's config schema refuses quantization.mode '3bit': Input should be '4bit'"),
    ("training", "steps", "64", "training.steps must be an integer, got '64' (a str)"),
    ("training", "batch_size", 0, "training.batch_size must be at least 1"),
    ("training", "examples", True, "training.examples must be an integer"),
    ("training", "precision", "bf16", "training.precision must be 'fp16'"),
    ("data", "format", "sharegpt", "data.format must be 'alpaca'"),
    ("training", "gradient_checkpointing", "yes", "training.gradient_checkpointing must be true or false"),
])
def test_workload_values_are_checked(tmp_path, section, key, value, message):
    path = _workload(tmp_path, lambda w: w[section].__setitem__(key, value))
    with pytest.raises(WorkloadConfigError) as info:
        load_workload(path)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_workload_steps_message_names_both_counts(tmp_path):
    path = _workload(tmp_path, lambda w: w["training"].__setitem__("steps", 65))
    with pytest.raises(WorkloadConfigError, match=r"give 64 steps, but the workload says steps: 65"):
        load_workload(path)


def test_gradient_checkpointing_reaches_soup_only_when_set(tmp_path):
    off = load_workload(_workload(tmp_path, lambda w: None)).soup_dict("/m", "/d.jsonl", "/o")
    assert "gradient_checkpointing" not in off["training"]  # Soup's own default stays Soup's
    on = _workload(tmp_path, lambda w: w["training"].__setitem__("gradient_checkpointing", True), "gc.yaml")
    assert "gradient_checkpointing: true" in load_workload(on).soup_yaml("/m", "/d.jsonl", "/o")


def test_descriptive_workload_keys_are_optional_and_the_used_ones_used(tmp_path, monkeypatch, capsys):
    def strip(w):
        w["model"].pop("name"), w["quantization"].pop("compute_dtype"), w["training"].pop("precision")
        w["model"]["standin_seed"] = 7
        w["training"]["lr"] = "2e-4"  # YAML reads 2e-4 (no dot) as a string; Soup takes it as a number
    path = _workload(tmp_path, strip)
    assert load_workload(path).standin_seed == 7
    old = _workload(tmp_path, lambda w: w.__setitem__("soup_version", "0.1.0"), "old.yaml")
    with pytest.raises(WorkloadConfigError, match="soup_version '0.1.0' is not the installed soup-cli"):
        load_workload(old)
    seen = {}

    def fake_standin(out, size, seed, tokenizer_source, profile="default", outlier_scale=1.0):
        seen["seed"] = seed
        raise RuntimeError("stop here")

    monkeypatch.setattr(model_standin, "write_standin", fake_standin)
    monkeypatch.setattr(compare, "run_variant", lambda *a, **kw: pytest.fail("no run"))
    refused(capsys, ["--workload", path, "--out", tmp_path / "out"], "stop here")
    assert seen == {"seed": 7}  # model.standin_seed seeds the stand-in


# --- 5. a model that is not Qwen2 -----------------------------------------------------------------

@pytest.mark.parametrize("config, weights, message", [
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, False, "model_type 'llama'"),
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, True, "model_type 'llama'"),
    ({"model_type": "qwen2"}, False, "architectures None"),
    ({"model_type": "qwen2", "architectures": ["Qwen2ForSequenceClassification"]}, False, "are for Qwen2"),
])
def test_a_model_that_is_not_qwen2_is_refused(tmp_path, capsys, no_runs, config, weights, message):
    model = model_dir(tmp_path / "m", config)
    if weights:  # a complete model dir: still refused by its config
        (model / "model.safetensors").write_bytes(b"\0" * 16)
        (model / "tokenizer_config.json").write_text("{}")
    refused(capsys, ["--model", model, "--out", tmp_path / "out"], message)
    assert not (tmp_path / "out").exists()


def test_a_model_config_that_is_not_json_is_one_line(tmp_path, capsys, no_runs):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2",\n')
    refused(capsys, ["--model", model], "config.json is not readable JSON")


def test_a_qwen2_model_passes_the_model_check(tmp_path):
    compare.check_model(model_dir(tmp_path / "m", QWEN_CONFIG))  # no InputError


# --- 6. bench.rules --report exit statuses -------------------------------------------------------

def _rules_main(capsys, path):
    rc = rules.main(["--report", str(path)])
    return rc, capsys.readouterr()


@pytest.mark.parametrize("text, message", [
    ('{"baseline": {"steps": ', "is not valid JSON (line 1"),
    ("[1, 2]", "not a report.json of bench.compare (a JSON list)"),
    ('{"baseline": {}, "solution": {}}', "incomplete: no 'workload'"),
    ('{"baseline": {}, "solution": {}, "workload": {"steps": 64}}', "its baseline run has no 'steps'"),
    ('{"baseline": {"steps": 1, "trainer_logs": []}, "solution": {"steps": 1, "trainer_logs": []}, '
     '"workload": {"steps": "64"}}', "workload.steps is '64'"),
    ('{"gpu": "cpu", "date": "d", "commit": "c", "runs": {}}', "is a summary.json"),
])
def test_rules_refuse_a_bad_report_with_exit_2(tmp_path, capsys, text, message):
    path = tmp_path / "report.json"
    path.write_text(text, encoding="utf-8")
    rc, cap = _rules_main(capsys, path)
    assert rc == 2 and cap.err.startswith("error: ") and message in cap.err and len(cap.err.splitlines()) == 1, cap.err
    assert path.read_text(encoding="utf-8") == text


def test_rules_exit_statuses_of_the_process(tmp_path):
    """0 pass, 1 a rule failed, 2 bad input: the process's own exit status."""
    bad = tmp_path / "cut.json"
    bad.write_text('{"baseline": {', encoding="utf-8")
    base = {"variant": "baseline", "steps": 2, "trainer_logs": [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.9}]}
    failing = tmp_path / "failing.json"
    failing.write_text(json.dumps({"workload": {"steps": 2}, "baseline": base,
                                   "solution": {**base, "variant": "solution"}}), encoding="utf-8")

    def run(*args):
        return subprocess.run([sys.executable, "-m", "bench.rules", *args], cwd=str(ROOT), capture_output=True,
                              text=True, timeout=60)

    assert [run(*a).returncode for a in ([], ["--report", str(failing)], ["--report", str(bad)],
                                         ["--report", str(tmp_path / "none.json")])] == [0, 1, 2, 2]


def test_report_main_refuses_a_bad_report_and_writes_nothing(tmp_path, capsys):
    path = tmp_path / "report.json"
    path.write_text('{"baseline": ', encoding="utf-8")
    assert report.main([str(path)]) == 2
    assert capsys.readouterr().err.startswith("error: report ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


# --- 7. SIGTERM / SIGINT stop the running child ---------------------------------------------------

DRIVER = """
import os, subprocess, sys, types
from bench import compare
pidfile, out, stubborn = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
child = ("import os, signal, sys, time\\n"
         + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n" if stubborn else "")
         + "open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid())); os.rename(sys.argv[1] + '.tmp', sys.argv[1])\\n"
         + "time.sleep(120)\\n")
# compare's Popen starts a "training" child; only compare's: its own copy of the subprocess module,
# since other Popen calls in this process must stay real (torch 2.15's import runs ldconfig -p
# through ctypes.util.find_library, which the stand-in child used to answer, hanging the import)
real = subprocess.Popen
compare.subprocess = types.SimpleNamespace(**vars(subprocess))
# a "training" child in place of bench.run_one (any other command compare starts runs as it is)
compare.subprocess.Popen = lambda cmd, **kw: (real([sys.executable, "-c", child, pidfile], **kw)
                                              if "bench.run_one" in cmd else real(cmd, **kw))
compare.resolve_inputs = lambda args, workload=None: ("model", "data.jsonl", "stand-in (test)")
compare.GRACE_S = 1.0
sys.exit(compare.main(["--out", out, "--shapes", "shipped"]))  # on a GPU the default shapes need a tokenizer
"""


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("sig, code, stubborn", [(signal.SIGTERM, 143, False), (signal.SIGINT, 130, False),
                                                  (signal.SIGTERM, 143, True)])
def test_a_signal_stops_the_running_child_and_keeps_what_was_written(tmp_path, sig, code, stubborn):
    pidfile, out = tmp_path / "child.pid", tmp_path / "out"
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SOLUTION_")}
    env["PYTHONPATH"] = pythonpath_without_repo(str(ROOT))
    proc = subprocess.Popen([sys.executable, str(driver), str(pidfile), str(out), "1" if stubborn else "0"],
                            cwd=str(ROOT), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child = None
    try:
        deadline = time.time() + 30
        while not pidfile.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert pidfile.exists(), proc.communicate(timeout=10)
        child = int(pidfile.read_text())
        time.sleep(0.3)  # the comparison waits on its child
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=30)
        assert proc.returncode == code, (proc.returncode, stderr)
        assert stderr.strip().splitlines()[-1].startswith(f"error: interrupted by {sig.name}"), stderr
        assert _gone(child), "the child must be stopped"
        assert (out / "baseline" / "log.txt").is_file() and not (out / "report.json").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        if child is not None and not _gone(child):
            os.kill(child, signal.SIGKILL)


# --- 7b. every child run has a wall-clock limit -----------------------------------------------------

SLEEPER = ("import os, signal, sys, time\n"
           "if sys.argv[2] == '1': signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
           "open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid())); os.rename(sys.argv[1] + '.tmp', sys.argv[1])\n"
           "time.sleep(60)\n")


@pytest.mark.parametrize("stubborn", [False, True])
def test_a_child_past_its_limit_is_stopped_and_the_comparison_fails(tmp_path, monkeypatch, capsys, stubborn):
    """--child-timeout 0.5: the "training" child (a sleep; stubborn: it ignores SIGTERM, so SIGKILL
    ends it) is stopped, one line names the run, the variant and the limit, exit 1, what was
    written is kept."""
    pidfile, out = tmp_path / "child.pid", tmp_path / "out"
    real = subprocess.Popen
    fake = SimpleNamespace(**vars(subprocess))  # only compare's Popen is replaced (see DRIVER)
    fake.Popen = lambda cmd, **kw: (real([sys.executable, "-c", SLEEPER, str(pidfile), "1" if stubborn else "0"], **kw)
                                    if "bench.run_one" in cmd else real(cmd, **kw))
    monkeypatch.setattr(compare, "subprocess", fake)
    monkeypatch.setattr(compare, "resolve_inputs",
                        lambda args, workload=None: ("model", "data.jsonl", "stand-in (test)"))
    monkeypatch.setattr(compare, "GRACE_S", 0.3)
    for name in ("SOLUTION_MEMORY_POLICY", "SOLUTION_CUDA_GRAPHS", "SOLUTION_GRAPH_BUCKET", "SOLUTION_PRECOMPILE",
                 "SOLUTION_SKIP_PATCHES"):
        monkeypatch.delenv(name, raising=False)
    t0 = time.time()
    rc = compare.main(["--out", str(out), "--shapes", "shipped", "--child-timeout", "0.5"])
    elapsed = time.time() - t0
    cap = capsys.readouterr()
    child = int(pidfile.read_text())
    try:
        assert rc == 1, cap.err
        assert _gone(child), "the child must be stopped and reaped"
        last = cap.err.strip().splitlines()[-1]
        assert last.startswith("error: run 'shipped', variant baseline, timed pass: still running after its 0.5 s "
                               "limit (--child-timeout), stopped; log "), last
        assert str(out / "baseline" / "log.txt") in last
        assert "TIMED OUT" in cap.out
        assert (out / "baseline" / "log.txt").is_file() and (out / compare.MACHINE_FILE).is_file()
        assert not (out / "report.json").exists() and not (out / "solution").exists()  # no further run
        assert elapsed < 30
    finally:
        if not _gone(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize("value", ["0", "-5", "abc", "nan", "inf", ""])
def test_a_bad_child_timeout_is_refused(tmp_path, capsys, no_runs, value):
    refused(capsys, [f"--child-timeout={value}", "--out", tmp_path / "out"],
            f"--child-timeout {value!r}: give a positive number of seconds")
    assert not (tmp_path / "out").exists()


def test_child_timeout_values():
    assert compare.parse_child_timeout(None) == compare.CHILD_TIMEOUT_S == 3600
    assert compare.parse_child_timeout("90") == 90 and compare.parse_child_timeout("0.5") == 0.5


def test_the_wait_after_sigkill_is_bounded(monkeypatch, capsys):
    """A child that never reaps (its wait always times out): stop_child sends SIGTERM, then SIGKILL,
    waits KILL_WAIT_S at most, says so and returns."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    waits, sent = [], []

    def never(timeout=None):
        waits.append(timeout)
        raise subprocess.TimeoutExpired(proc.args, timeout)

    try:
        monkeypatch.setattr(proc, "wait", never)
        monkeypatch.setattr(proc, "terminate", lambda: sent.append("SIGTERM"))  # the child is killed below
        monkeypatch.setattr(proc, "kill", lambda: sent.append("SIGKILL"))
        monkeypatch.setattr(compare, "KILL_WAIT_S", 0.2)
        t0 = time.time()
        assert compare.stop_child(proc, grace_s=0.1) is False
        assert time.time() - t0 < 5
        assert sent == ["SIGTERM", "SIGKILL"] and waits == [0.1, 0.2], "both waits have a timeout"
        err = capsys.readouterr().err
        assert f"child pid {proc.pid} was sent SIGKILL" in err and "could not be reaped, going on" in err, err
    finally:
        monkeypatch.undo()
        proc.kill()
        proc.wait(timeout=10)


# --- 8. --tokenizer ------------------------------------------------------------------------------

def test_tokenizer_with_a_model_is_refused(tmp_path, capsys, no_runs):
    model = model_dir(tmp_path / "m", QWEN_CONFIG)
    refused(capsys, ["--model", model, "--tokenizer", tmp_path, "--out", tmp_path / "out"],
            "--tokenizer is for the stand-in model only")


def test_a_missing_tokenizer_dir_is_refused(tmp_path, capsys, no_runs):
    refused(capsys, ["--tokenizer", tmp_path / "no-tok", "--out", tmp_path / "out"],
            f"--tokenizer: tokenizer source {tmp_path / 'no-tok'} does not exist")


def test_a_cached_standin_takes_the_tokenizer_asked_for(tmp_path, monkeypatch):
    weights = []

    def fake_weights(out, size, seed, *profile):  # the weights are not what this test is about
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps({"seed": seed}))
        weights.append(seed)

    monkeypatch.setattr(model_standin, "_write_weights", fake_weights)
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text('{"mine": true}')
    (tok / "tokenizer.json").write_text('{"model": "mine"}')
    (tok / "added_tokens.json").write_text("{}")
    out = tmp_path / "standin"
    model_standin.write_standin(out, size="tiny")
    built = (out / "tokenizer.json").read_bytes()
    model_standin.write_standin(out, size="tiny", tokenizer_source=str(tok))
    assert (out / "tokenizer.json").read_text() == '{"model": "mine"}' and (out / "added_tokens.json").exists()
    model_standin.write_standin(out, size="tiny", tokenizer_source=str(tok))  # the same: reused as it is
    (tok / "tokenizer.json").write_text('{"model": "mine, changed"}')
    model_standin.write_standin(out, size="tiny", tokenizer_source=str(tok))  # its source changed: copied again
    assert (out / "tokenizer.json").read_text() == '{"model": "mine, changed"}'
    model_standin.write_standin(out, size="tiny")  # back to the built-in one, without the copied extras
    assert (out / "tokenizer.json").read_bytes() == built and not (out / "added_tokens.json").exists()
    assert weights == [1234], "the weights are written once; only the tokenizer follows the asked one"


# --- 9. the smaller ones ------------------------------------------------------------------------

def test_out_naming_an_existing_file_is_refused(tmp_path, capsys, no_runs):
    out = tmp_path / "out"
    out.write_text("keep me")
    refused(capsys, ["--out", out], "is a file, not a directory")
    assert out.read_text() == "keep me"


def test_a_missing_model_dir_is_said_to_be_missing(tmp_path, capsys, no_runs):
    refused(capsys, ["--model", tmp_path / "nope"], f"model directory not found: {tmp_path / 'nope'}")


def test_a_non_utf8_dataset_names_the_line(tmp_path, capsys, no_runs):
    lines = DATA.read_bytes().splitlines(keepends=True)
    data = tmp_path / "latin.jsonl"
    data.write_bytes(b"".join(lines[:2]) + b'{"instruction": "caf\xe9", "output": "x"}\n' + b"".join(lines[3:]))
    refused(capsys, ["--data", data, "--out", tmp_path / "out"], "line 3: not UTF-8 text (byte 0xe9")


def _run(variant, steps, linear4bit=None):
    times = [2.0] * steps
    return {"variant": variant, "steps": steps, "step_times_s": times, "train_excl_first2_s": sum(times[2:]),
            "trainer_logs": [{"step": i + 1, "loss": 2.0, "num_tokens": 100 * (i + 1)} for i in range(steps)],
            "linear4bit_layers": linear4bit}


def _report(steps, linear4bit, gpu="NVIDIA H200"):
    rep = compare.build_report(SimpleNamespace(argv=[]), "stand-in (tiny)", _run("baseline", steps, linear4bit),
                               _run("solution", steps, linear4bit), None, None, load_workload())
    rep["gpu"] = {"name": gpu, "capability": None}
    return rep


def test_report_labels_are_the_runs_steps():
    md = report.markdown(_report(3, 84))
    assert "steps 3-64" not in md and "| GPU kernel time, steps 3-3 (s) |" in md and "steps 3-3 (s)" in md
    assert "| GPU kernel time, steps 3-64 (s) |" in report.markdown(_report(64, 84))


def test_report_header_says_when_the_runs_had_no_4bit():
    head = report.markdown(_report(3, 0, gpu="cpu")).split("| metric |")[0]
    assert "**no 4-bit quantization: these runs trained without NF4**" in head and "on a CPU" in head
    assert "no 4-bit" not in report.markdown(_report(3, 84))
    old = _report(3, None, gpu="cpu")  # a report from before the count: a CPU run never has NF4
    assert "no 4-bit quantization" in report.markdown(old).split("| metric |")[0]


def test_run_one_counts_the_nf4_layers():
    import torch

    from bench.run_one import count_linear4bit

    nf4 = type("Linear4bit", (torch.nn.Linear,), {"__module__": "bitsandbytes.nn.modules"})
    lora = type("Linear4bit", (torch.nn.Module,), {"__module__": "peft.tuners.lora.bnb"})  # a wrapper, not NF4
    model = torch.nn.Sequential(nf4(2, 2), torch.nn.Linear(2, 2), lora(), nf4(2, 2))
    assert count_linear4bit(model) == 2
    assert count_linear4bit(torch.nn.Sequential(torch.nn.Linear(2, 2))) == 0 and count_linear4bit(None) is None
