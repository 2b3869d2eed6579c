"""Timed runs of this tree beside an older commit's on one machine: scripts/commit_pairs.sh writes the older
tree; gpu_run.sh's timed step runs its "old*" labels from it (TIMED_OLD_TREE), from that tree's directory with
that tree's packages first; scripts/commit_pairs.plan runs each arm once a round, in rotated orders. Bad input
gets one ``error:`` line (exit 2 for the script) before anything runs."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "commit_pairs.sh"

needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
needs_git = pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                               reason="needs git and this repository's .git")


def _run(tmp_path, *args):
    env = {**os.environ, "OLD_DIR": str(tmp_path / "old")}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=120)


@needs_bash
@needs_git
def test_it_writes_the_commit_tree(tmp_path):
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    r = _run(tmp_path, "HEAD")
    assert r.returncode == 0, r.stdout + r.stderr
    old = tmp_path / "old"
    assert (old / "COMMIT").read_text().strip() == head
    for rel in ("solution/__init__.py", "bench/run_one.py", "workload/data/kazakh_instructions.jsonl"):
        assert (old / rel).is_file(), rel


@needs_bash
@needs_git
@pytest.mark.parametrize("args", [("not-a-commit",), ()])
def test_a_bad_commit_is_one_line_and_exit_2(tmp_path, args):
    r = _run(tmp_path, *args)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: give a commit"), r
    assert not (tmp_path / "old").exists()


def test_the_plan_runs_every_arm_once_a_round_in_rotated_orders():
    rounds = []
    for line in (ROOT / "scripts" / "commit_pairs.plan").read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            name, assign, steps = line.split("|")
            assert steps == "timed" and "TIMED_OLD_TREE=.cache/old" in assign, line
            variants = assign.split('TIMED_VARIANTS="')[1].split('"')[0].split()
            rounds.append([v.split("=")[0] for v in variants])
    assert len(rounds) == 3 and all(sorted(r) == ["baseline", "new", "old", "oldoff"] for r in rounds)
    for before, after in zip(rounds, rounds[1:]):
        assert after == before[1:] + before[:1]


@needs_bash
def test_gpu_run_timed_runs_old_labels_from_the_old_tree(tmp_path):
    """gpu_run.sh's timed step with a stub python3 that records its directory, PYTHONPATH and arguments: a
    "new" label runs from this tree, an "old" one from TIMED_OLD_TREE with that tree on PYTHONPATH instead, the
    model and data paths absolute; an "old" label without TIMED_OLD_TREE is refused with one error line."""
    tree, old, work, bin_ = tmp_path / "tree", tmp_path / "old", tmp_path / "work", tmp_path / "bin"
    (tree / "scripts").mkdir(parents=True)
    old.mkdir()
    bin_.mkdir()
    shutil.copy(ROOT / "scripts" / "gpu_run.sh", tree / "scripts")
    log = tmp_path / "calls.txt"
    (bin_ / "python3").write_text(f'#!/usr/bin/env bash\necho "pwd=$PWD pp=$PYTHONPATH args=$*" >> {log}\n')
    (bin_ / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "OUT": str(tmp_path / "final"),
           "WORK": str(work), "TIMED_OLD_TREE": str(old), "TIMED_VARIANTS": "new=A=1 old=A=1"}
    r = subprocess.run(["bash", str(tree / "scripts" / "gpu_run.sh"), "timed"], env=env, capture_output=True,
                       text=True, timeout=120)
    runs = [c for c in log.read_text().splitlines() if "bench.run_one" in c]
    assert len(runs) == 2, (runs, r.stdout, r.stderr)
    data = f"--data {tree}/workload/data/kazakh_instructions.jsonl"
    model = f"--model {tree}/.cache/models/"
    assert runs[0].startswith(f"pwd={tree} pp={tree} ") and data in runs[0] and model in runs[0], runs[0]
    assert runs[1].startswith(f"pwd={old} pp={old} ") and data in runs[1] and model in runs[1], runs[1]
    assert f"--workdir {work}/timed-old" in runs[1]
    env.pop("TIMED_OLD_TREE")
    log.unlink()
    r = subprocess.run(["bash", str(tree / "scripts" / "gpu_run.sh"), "timed"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert [c for c in log.read_text().splitlines() if "bench.run_one" in c and "pwd=" + str(old) in c] == []
    assert "error: label old needs TIMED_OLD_TREE" in r.stdout
