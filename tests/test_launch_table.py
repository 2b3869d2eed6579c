"""bench/launch_table.py: the occupancy / waves arithmetic on made-up numbers, and the table itself
for every launch configuration (compiled for sm_75 in a child process without TRITON_INTERPRET,
as tests/test_sm75_compile.py runs solution.sm75_check)."""
import os
import re
import subprocess
import sys

import pytest

from bench.launch_table import H200, T4, blocks_per_sm, verdict, waves

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_occupancy_and_waves_arithmetic():
    # 8 warps, no shared memory: the warp limit decides (T4 32 // 8 = 4, H200 64 // 8 = 8)
    assert blocks_per_sm(T4, 8, 0) == 4 and blocks_per_sm(H200, 8, 0) == 8
    assert T4.sms * blocks_per_sm(T4, 8, 0) == 160
    assert waves(851, T4, 4) == pytest.approx(5.32, abs=0.01)
    assert waves(851, H200, 8) == pytest.approx(851 / 1056)
    # 1 warp: the block limit (16 / 32) decides
    assert blocks_per_sm(T4, 1, 0) == 16 and blocks_per_sm(H200, 1, 0) == 32
    # shared memory: 20 KB a block -> 3 on the T4 (64 KB), 11 on the H200 (228 KB)
    assert blocks_per_sm(T4, 4, 20 * 1024) == 3 and blocks_per_sm(H200, 4, 20 * 1024) == 11
    # more than an SM holds: nothing resident
    assert blocks_per_sm(T4, 4, 70_000) == 0 and blocks_per_sm(H200, 4, 70_000) == 3
    # registers, when known: 128 a thread x 256 threads = 32768 -> 2 blocks of 8 warps
    assert blocks_per_sm(T4, 8, 0, regs_per_thread=128) == 2


def test_verdict_words():
    assert verdict(8, 0, {"T4": 4, "H200": 8}, {"T4": 5.3, "H200": 1.2}) == "fills both"
    assert verdict(8, 0, {"T4": 4, "H200": 8}, {"T4": 5.3, "H200": 0.81}).startswith("under-fills H200")
    assert "does not fit T4" in verdict(4, 70_000, {"T4": 0, "H200": 4}, {"T4": 1.0, "H200": 1.0})
    assert "shared-memory bound on T4" in verdict(4, 20 * 1024, {"T4": 3, "H200": 11}, None)


def _specs():
    from solution.sm75_check import _kernel_modules

    return [(m, s["name"]) for m, mod in _kernel_modules() for s in mod.sm75_specs()]


def test_table_lists_every_spec_within_t4_shared_memory():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "bench.launch_table"], env=env,
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    m = re.search(r"^(\d+) of (\d+) launch configurations compiled for sm_75$", proc.stdout, re.M)
    if m and m.group(1) == "0":  # this Triton cannot compile for sm_75 here (no ptxas, ...)
        pytest.skip("triton cannot compile for sm_75 on this machine")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split(" | ") for line in proc.stdout.splitlines()
            if line.startswith("| ") and not line.startswith(("| module", "| ---"))]
    listed = {(r[0][2:], r[1]) for r in rows}
    specs = _specs()
    assert len(rows) == len(specs), proc.stdout + proc.stderr
    assert set(specs) <= listed, set(specs) - listed
    for r in rows:
        assert 0 <= int(r[3]) <= 65536, r  # shared bytes within the T4's 64 KB
        assert int(r[4]) >= 1 and int(r[5]) >= 1, r  # at least one block resident on each
    assert "registers" in proc.stdout and "CUDA C Programming Guide" in proc.stdout
