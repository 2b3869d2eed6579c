"""scripts/commit_pairs.sh (timed runs of this tree and an older commit's on one machine): the steps that
run here. ``prepare`` writes the commit's solution/, bench/ and workload/ with its id; bad input gets one
``error:`` line and exit 2 before anything runs (the GPU side, ``body``, runs only on the device)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "commit_pairs.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("git") is None
                                or not (ROOT / ".git").exists(), reason="needs bash, git and this repository's .git")


def _run(tmp_path, *args):
    env = {**os.environ, "OLD_DIR": str(tmp_path / "old"), "PAIRS_DIR": str(tmp_path / "pairs")}
    env.pop("OUT", None)
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=120)


def test_prepare_writes_the_commit_tree(tmp_path):
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    r = _run(tmp_path, "prepare", "HEAD")
    assert r.returncode == 0, r.stdout + r.stderr
    old = tmp_path / "old"
    assert (old / "COMMIT").read_text().strip() == head
    for rel in ("solution/__init__.py", "bench/run_one.py", "workload/data/kazakh_instructions.jsonl"):
        assert (old / rel).is_file(), rel


@pytest.mark.parametrize("args, needle", [
    (("prepare", "not-a-commit"), "prepare needs a commit"), (("prepare",), "prepare needs a commit"),
    (("start",), "run 'prepare SHA' here"), (("poll", "1"), "no run on this machine"),
    (("stop",), "usage:")])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, needle):
    r = _run(tmp_path, *args)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], (r.returncode, r.stdout, r.stderr)
    assert not (tmp_path / "pairs").exists()
