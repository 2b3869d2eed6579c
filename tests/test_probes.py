"""The diagnosis probes of bench/ (gemm_probe, gc_probe) on the CPU: they count what they say."""
from __future__ import annotations

import json
import subprocess
import sys

import torch
import torch.nn.functional as F

from bench import gemm_probe

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def test_gemm_probe_splits_new_and_seen_shapes():
    stats, restore = gemm_probe.install()
    try:
        w = torch.randn(5, 8)
        for m in (3, 4, 3, 3):
            F.linear(torch.randn(m, 8), w)
        torch.randn(4, 8).mm(torch.randn(8, 2))
        torch.randn(4, 8).mm(torch.randn(8, 2).t().contiguous().t())  # other strides: a new shape
    finally:
        restore()
    assert F.linear is not None and "timed" not in getattr(F.linear, "__name__", "")
    lin, mm = stats["F.linear"], stats["Tensor.mm"]
    assert (lin["shapes"], lin["new_calls"], lin["seen_calls"]) == (2, 2, 2)
    assert (mm["shapes"], mm["new_calls"], mm["seen_calls"]) == (2, 2, 0)


def test_gc_probe_runs_a_module_and_reports(tmp_path):
    out = tmp_path / "gc.json"
    r = subprocess.run([sys.executable, "-m", "bench.gc_probe", "--out", str(out), "--gen0", "900", "-m", "json.tool"],
                       input="{}", capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())
    assert got["module"] == "json.tool" and got["thresholds"][0] == 900
    assert set(got["by_generation"]) == {"0", "1", "2"}
