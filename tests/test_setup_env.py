"""scripts/setup_env.sh installs on every Python the README names: the editable install runs with
--no-build-isolation, which uses the venv's own setuptools and does not enforce pyproject's build
requirements, so the script brings them first (a fresh Python 3.11 venv has setuptools 65.5 and
no wheel; torch brings setuptools only on 3.12+). This test makes such a fresh venv, runs the
script's build-prerequisite step, then the same editable install without dependencies."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "setup_env.sh"


def test_build_prerequisites_come_before_the_editable_install():
    text = SCRIPT.read_text(encoding="utf-8")
    body = re.search(r"build_prerequisites\(\) \{\n(.*?)\n\}", text, re.S).group(1)
    assert "setuptools>=68" in body and "wheel" in body
    requires = re.search(r'requires = \["setuptools>=(\d+)"\]', (ROOT / "pyproject.toml").read_text()).group(1)
    assert f"setuptools>={requires}" in body  # the floor pyproject names
    assert text.index("  build_prerequisites\n") < text.index("--no-build-isolation -e")


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_editable_install_in_a_fresh_venv(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    text = SCRIPT.read_text(encoding="utf-8")
    body = re.search(r"build_prerequisites\(\) \{\n(.*?)\n\}", text, re.S).group(1)
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ.get('PATH', '')}", "VIRTUAL_ENV": str(venv)}
    env.pop("PYTHONPATH", None)
    try:
        subprocess.run(["bash", "-c", body], check=True, env=env, timeout=600, capture_output=True, text=True)
    except subprocess.CalledProcessError as exc:  # no package index reachable: nothing to test here
        pytest.skip(f"pip could not install the build prerequisites: {exc.stderr.strip()[-200:]}")
    copy = tmp_path / "src"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", ".venv", ".whl", "runs", ".cache", "*.egg-info",
                                                               "__pycache__", "docs", "notebooks"))
    done = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "-e", "."],
                          cwd=copy, env=env, timeout=600, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
