"""The end of a test run says why tests were skipped (tests/conftest.py: pytest_terminal_summary).

A child pytest runs a few made-up tests with this project's conftest as a plugin: a test marked
gpu, tests that skip themselves for CUDA in other words, one whose module is not installed, one
with another reason, one that passes. Its terminal summary has one line per reason, most first,
with the count: every CUDA reason under the one GPU line, the missing module named as such.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from tests.conftest import GPU_REASON, HAS_CUDA, pythonpath_without_repo, skip_reason

ROOT = Path(__file__).resolve().parent.parent

MADE_UP = '''
import pytest

@pytest.mark.gpu
def test_marked_gpu():
    pass

def test_needs_cuda():
    pytest.skip("needs CUDA")

def test_bnb_needs_cuda():
    pytest.skip("bitsandbytes 4-bit needs CUDA")

def test_two_gpus():
    pytest.skip("needs two CUDA GPUs")

def test_missing_module():
    pytest.importorskip("no_such_module_for_the_summary")

def test_other_reason():
    pytest.skip("on Kaggle the cells write to /kaggle/working")

def test_passes():
    pass
'''


def test_the_summary_groups_the_skips_by_reason(tmp_path):
    (tmp_path / "test_made_up.py").write_text(MADE_UP, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": pythonpath_without_repo(str(ROOT))}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                           "-W", "ignore::pytest.PytestUnknownMarkWarning", "test_made_up.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout.splitlines()
    gpu = 2 if HAS_CUDA else 3  # the gpu-marked test runs on a GPU machine
    head = next(i for i, line in enumerate(out) if f"{gpu + 3} tests skipped (not failures), by reason" in line)
    assert out[head + 1:head + 5] == [f"{gpu:5d}  {GPU_REASON}",
                                      "    1  needs no_such_module_for_the_summary, not installed here",
                                      "    1  needs two CUDA GPUs",
                                      "    1  on Kaggle the cells write to /kaggle/working"]


def test_skip_reason_takes_pytests_text():
    def report(text):
        return SimpleNamespace(longrepr=("x.py", 3, f"Skipped: {text}"))

    assert skip_reason(report("native_dropout is the CUDA path")) == GPU_REASON
    assert skip_reason(report("fp16 mixed precision needs CUDA")) == GPU_REASON
    assert skip_reason(report("needs a CUDA GPU")) == GPU_REASON
    assert skip_reason(report("covered by the GPU test")) == "covered by the GPU test"
    assert skip_reason(report("could not import 'nbformat': No module named 'nbformat'")) == (
        "needs nbformat, not installed here")
