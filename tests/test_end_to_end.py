"""The whole chain on the CPU: the real `soup train` (tiny stand-in, 8 examples, 2 steps),
baseline then solution (our kernels in Triton's interpreter), report and rule check.

Slower than the unit tests (about a minute): it is the one test that runs Soup itself."""
import json
from pathlib import Path

import pytest
import yaml

from workload.config import WORKLOAD_FILE

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "workload" / "data" / "kazakh_instructions.jsonl"


def _small_workload(tmp_path, examples: int, steps: int):
    """(data file, workload YAML): the first ``examples`` rows of the embedded dataset and the
    default workload cut to ``steps`` steps."""
    rows = DATA.read_text(encoding="utf-8").splitlines()[:examples]
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(rows) + "\n", encoding="utf-8")
    w = yaml.safe_load(WORKLOAD_FILE.read_text(encoding="utf-8"))
    w["training"].update(examples=examples, steps=steps)
    workload = tmp_path / "workload.yaml"
    workload.write_text(yaml.safe_dump(w), encoding="utf-8")
    return data, workload


@pytest.mark.slow
def test_compare_runs_soup_twice_and_all_rules_pass(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the GPU machine runs the full-size comparison instead")
    from bench.compare import main

    data, workload = _small_workload(tmp_path, examples=8, steps=2)
    out = tmp_path / "out"

    rc = main(["--data", str(data), "--workload", str(workload), "--out", str(out), "--size", "tiny"])

    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    failed = [r for r in report["rules"] if r["ok"] is False]
    assert rc == 0 and not failed, failed
    assert (out / "report.md").is_file() and (out / "report.png").is_file()
    md = (out / "report.md").read_text(encoding="utf-8")
    assert "## Against the project's targets (solution at most 1/3 of the baseline's time, 1/2 of its memory)" in md
    from bench import report as report_mod

    printed = capsys.readouterr().out.splitlines()
    first = printed.index(report_mod.CPU_FIRST_LINE)  # the summary opens with the CPU's caveats
    assert printed[first + 1] == report_mod.CPU_FP32_LINE
    assert ("T4 projection (a model, not a measurement): not made, because these runs were measured on the CPU, "
            "and the model turns H200 or H100 (SXM) measurements into T4 estimates (a run on a real T4 needs no projection).") in printed
    assert "| GPU kernel time, steps 3-2 (s) | n/a | <= 1/3 | not measured |" in md  # no GPU profiler here
    assert "steps 3-64" not in md  # the labels are the run's steps (2), not the default workload's
    assert "**no 4-bit quantization" in md.split("| metric |")[0]  # said in the header: Soup's CPU has no NF4
    assert report["baseline"]["linear4bit_layers"] == report["solution"]["linear4bit_layers"] == 0
    assert report["baseline"]["steps"] == report["solution"]["steps"] == 2
    assert report["baseline"]["soup_complete_panel"] and report["solution"]["soup_complete_panel"]
    installed = set(report["solution"]["installed"])
    assert {"qwen2_layer_node", "qwen2_unpad", "qwen2_lm_head_loss"} <= installed
    assert report["own_kernels_ran"], "our kernels must run in the solution pass"


@pytest.mark.slow
def test_host_split_pass_times_the_trainer_phases(tmp_path):
    """bench.run_one --host-split --compile-log: a stock run (tiny stand-in, 4 steps) writes a table
    whose phases cover the timed steps and whose wrapped phases were really called, and a compile
    log."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("CPU check of the instrument; the GPU machine runs it at full size")
    import subprocess
    import sys

    from workload.model_standin import write_standin

    data, workload = _small_workload(tmp_path, examples=16, steps=4)
    model = ROOT / ".cache" / "models" / "qwen2.5-1.5b-instruct-standin-tiny"
    write_standin(model, size="tiny")
    split = tmp_path / "split.md"

    # a child process, as bench.compare runs it: Soup's training leaves global state behind
    proc = subprocess.run([sys.executable, "-m", "bench.run_one", "--variant", "baseline", "--model", str(model),
                           "--data", str(data), "--workload", str(workload), "--workdir", str(tmp_path / "run"),
                           "--host-split", str(split), "--compile-log", str(tmp_path / "compiles.md")],
                          cwd=str(ROOT), capture_output=True, text=True)

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # a stock run on the CPU compiles no Triton kernel; the log says so rather than being absent
    assert (tmp_path / "compiles.md").read_text(encoding="utf-8").startswith("Triton JIT compiles during the run: 0")
    text = split.read_text(encoding="utf-8")
    assert "2 steps" in text, text
    rows = {line.split("|")[1].strip(): line.split("|")[2:] for line in text.splitlines() if line.startswith("| ")}
    for phase in ("forward", "decoder (inside forward)", "backward", "optimizer", "zero_grad"):
        assert float(rows[phase][0]) > 0.0, (phase, text)
        assert rows[phase][2].strip() == "1", (phase, text)
