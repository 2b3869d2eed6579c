"""Every launch configuration of every kernel compiles for the T4 (sm_75) with fp16 only and
shared memory within 64 KB. Runs on any machine: Triton compiles for a named target without
that GPU (ptxas ships with Triton)."""
import os
import re
import subprocess
import sys


def test_every_kernel_compiles_for_sm75():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "solution.sm75_check"], env=env,
                          capture_output=True, text=True, timeout=900,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stdout + proc.stderr  # exit 1 on any failure (sm75_check)
    m = re.search(r"^(\d+) of (\d+) launch configurations compile for sm_75 within limits$", proc.stdout, re.M)
    assert m and int(m.group(2)) > 0 and m.group(1) == m.group(2), proc.stdout
