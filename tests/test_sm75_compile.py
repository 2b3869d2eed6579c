"""Every launch configuration of every kernel compiles for the T4 (sm_75) with fp16 only and
shared memory within 64 KB. Runs on any machine: Triton compiles for a named target without
that GPU (ptxas ships with Triton)."""
import os
import subprocess
import sys


def test_every_kernel_compiles_for_sm75():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "solution.sm75_check"], env=env,
                          capture_output=True, text=True, timeout=900,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 0, proc.stdout + proc.stderr
