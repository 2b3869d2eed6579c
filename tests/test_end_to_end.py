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


@pytest.mark.slow
def test_compare_runs_soup_twice_and_all_rules_pass(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the GPU machine runs the full-size comparison instead")
    from bench.compare import main

    rows = DATA.read_text(encoding="utf-8").splitlines()[:8]
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(rows) + "\n", encoding="utf-8")
    w = yaml.safe_load(WORKLOAD_FILE.read_text(encoding="utf-8"))
    w["training"].update(examples=8, steps=2)
    workload = tmp_path / "workload.yaml"
    workload.write_text(yaml.safe_dump(w), encoding="utf-8")
    out = tmp_path / "out"

    rc = main(["--data", str(data), "--workload", str(workload), "--out", str(out), "--size", "tiny"])

    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    failed = [r for r in report["rules"] if r["ok"] is False]
    assert rc == 0 and not failed, failed
    assert (out / "report.md").is_file() and (out / "report.png").is_file()
    assert report["baseline"]["steps"] == report["solution"]["steps"] == 2
    assert report["baseline"]["soup_complete_panel"] and report["solution"]["soup_complete_panel"]
    installed = set(report["solution"]["installed"])
    assert {"qwen2_rmsnorm", "qwen2_rope", "qwen2_mlp", "qwen2_lm_head_loss"} <= installed
    assert report["own_kernels_ran"], "our kernels must run in the solution pass"
