"""notebooks/kaggle_t4.ipynb, the one-cell T4 run on Kaggle (CPU, fast).

Static: a valid notebook; markdown cells in Russian; every command a code cell runs goes through
its `sh` helper and is one of the project's scripts (scripts/*.sh, python -m bench./solution.) or
the two system tools the notebook needs (nvidia-smi, git clone); no inline package installs.
Run: the whole comparison takes minutes even on the tiny CPU stand-in (over 12 min on a 2-core
machine), so the run cell is executed with REPORT_DIR set (show an existing report, run nothing)
against a synthetic report directory, then the zip cell; IPython.display is stubbed. And without a
GPU (a fake nvidia-smi that fails) the run cell stops with its Russian message before running anything.
"""
from __future__ import annotations

import ast
import json
import os
import re
import struct
import subprocess
import sys
import textwrap
import zipfile
import zlib
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "kaggle_t4.ipynb"
CYRILLIC = re.compile(r"[А-Яа-яЁё]")


def _nb():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    return nb


def _code(nb):
    return [c.source for c in nb.cells if c.cell_type == "code"]


def _sh_calls(src: str) -> list[list]:
    """The argument lists of every sh([...]) call (a Name for sys.executable, str constants)."""
    out = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "sh":
            assert node.args and isinstance(node.args[0], ast.List), ast.unparse(node)
            out.append([e.value if isinstance(e, ast.Constant) else ast.unparse(e) for e in node.args[0].elts])
    return out


def test_valid_and_russian():
    nb = _nb()
    md = [c.source for c in nb.cells if c.cell_type == "markdown"]
    assert len(md) >= 3 and all(CYRILLIC.search(s) for s in md)
    assert len(_code(nb)) == 2  # the run-everything cell and the zip cell
    text = "\n".join(md)
    for needle in ("5 %", "3–64", "peak GPU memory reserved", "decoder CUDA graphs", "precompil",
                   "loss curve within tolerance", "измерьте на своём прогоне", "Accelerator", "Internet"):
        assert needle in text, needle


def test_code_cells_call_only_project_scripts():
    run_cell, zip_cell = _code(_nb())
    for src in (run_cell, zip_cell):
        assert not re.search(r"\b(pip3?|apt|apt-get|conda|mamba|easy_install|uv)\b", src), "inline install"
        assert not any(l.lstrip().startswith(("!", "%")) for l in src.splitlines()), "shell escape / magic"
        assert "os.system" not in src and "os.popen" not in src
        tree = ast.parse(src)
        # subprocess only inside the sh helper
        helpers = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "sh"]
        inside = {id(x) for h in helpers for x in ast.walk(h)}
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "subprocess":
                assert id(n) in inside, f"subprocess used outside sh(): {ast.unparse(n)}"
    calls = _sh_calls(run_cell)
    assert _sh_calls(zip_cell) == []  # the zip cell runs no command (Python's zipfile)
    for cmd in calls:
        if cmd[0] == "bash":
            assert re.fullmatch(r"scripts/[\w.-]+\.sh", cmd[1]) and (ROOT / cmd[1]).is_file(), cmd
        elif cmd[0] == "sys.executable":
            assert cmd[1] == "-m" and cmd[2].split(".")[0] in ("bench", "solution"), cmd
            assert (ROOT / (cmd[2].replace(".", "/") + ".py")).is_file(), cmd
        else:
            assert cmd[:2] in (["nvidia-smi"], ["git", "clone"]), cmd
    assert ["bash", "scripts/t4_run.sh", "--out", "RUN_DIR"] in calls
    assert ["sys.executable", "-m", "bench.rules", "--report", "report_json"] in calls
    assert ["nvidia-smi"] in calls
    for needle in ("Markdown(", "Image(", "report.md", "report.png", 'REPO_URL = ""', "CUDA_VISIBLE_DEVICES"):
        assert needle in run_cell, needle
    assert "/kaggle/working" in run_cell and "zipfile" in zip_cell


# --- executing the cells -------------------------------------------------------------------------

STUB = '''
class _Shown:
    def __init__(self, data=None, filename=None, **kw):
        self.data, self.filename = data, filename
class Markdown(_Shown):
    pass
class Image(_Shown):
    def __init__(self, data=None, filename=None, **kw):
        assert open(filename, "rb").read(8) == b"\\x89PNG\\r\\n\\x1a\\n", filename
        super().__init__(data, filename)
class FileLink:
    def __init__(self, path, **kw):
        self.filename = path
def display(*objs):
    for o in objs:
        print("DISPLAY", type(o).__name__, repr(getattr(o, "data", None) or o.filename)[:300])
'''

RUNNER = '''
import json, sys
cells, params = json.load(open(sys.argv[1], encoding="utf-8")), json.load(open(sys.argv[2], encoding="utf-8"))
ns = {"__name__": "__main__"}
for i, src in enumerate(cells):
    for name, value in params.items():
        src = src.replace(f'{name} = ""', f"{name} = {value!r}", 1)
    try:
        exec(compile(src, f"cell{i + 1}", "exec"), ns)
    except Exception as exc:
        print(f"CELL {i + 1} RAISED {type(exc).__name__}: {exc}")
        sys.exit(3)
'''


def _png() -> bytes:
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00")) + chunk(b"IEND", b""))


def _run_result(variant: str) -> dict:
    steps = (1, 2, 3)
    return {"variant": variant, "rc": 0, "steps": 3, "soup_complete_panel": True, "prohibited_modules_loaded": [],
            "trainer_logs": [{"step": s, "loss": 2.0 - 0.01 * s, "entropy": 1.0, "mean_token_accuracy": 0.5,
                              "grad_norm": 1.0, "num_tokens": 100.0 * s} for s in steps],
            "tracker": {"runs": [{"status": "completed", "total_steps": 3, "initial_loss": 1.99, "final_loss": 1.97,
                                  "duration_secs": 1.0}],
                        "metrics": [{"step": s, "loss": 2.0 - 0.01 * s} for s in steps]},
            "outputs": {"present": {"adapter": True}, "adapter_keys": ["lora_A"], "rewind_rows": 4},
            "precompile": {"started": True, "entries": 40, "done": 40, "failed": 0, "seconds": 5.0,
                           "finished_before_training": True}}


def _report_dir(tmp: Path) -> Path:
    d = tmp / "runs" / "kaggle-20260101-000000"
    (d / "solution" / "output").mkdir(parents=True)
    rep = {"workload": {"steps": 3}, "baseline": _run_result("baseline"), "solution": _run_result("solution"),
           "own_kernels_ran": ["swiglu_fwd"], "own_kernel_share": 0.123}
    (d / "report.json").write_text(json.dumps(rep), encoding="utf-8")
    (d / "report.md").write_text(textwrap.dedent("""\
        # Baseline vs solution: synthetic
        | metric | baseline | solution | gain (baseline/solution) |
        | --- | ---: | ---: | ---: |
        | training time excl. first 2 steps (s) | 30.0 | 10.0 | 3.00x |
        | peak GPU memory reserved (GiB) | 8.0 | 4.0 | 2.00x |
        Own-kernel share of training time excluding the first two steps: **12.3%**
        Measured decision ($SOLUTION_CUDA_GRAPHS=auto): decoder CUDA graphs off: the GPU was the bottleneck.
        - **PASS** loss curve within tolerance (max rel <= 0.01, mean rel <= 0.002): 3 steps
        """), encoding="utf-8")
    (d / "report.png").write_bytes(_png())
    (d / "solution" / "log.txt").write_text("precompiling 40 kernel specializations in the background for sm_75\n",
                                            encoding="utf-8")
    (d / "solution" / "output" / "adapter_model.safetensors").write_bytes(b"x" * 100)
    (d / "t4_run.log").write_text("12 passed, 3 skipped in 9.1s\n", encoding="utf-8")
    return d


def _execute(tmp: Path, params: dict, path_prefix: str | None = None):
    stub = tmp / "stub" / "IPython"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("", encoding="utf-8")
    (stub / "display.py").write_text(STUB, encoding="utf-8")
    (tmp / "cells.json").write_text(json.dumps(_code(_nb())), encoding="utf-8")
    (tmp / "params.json").write_text(json.dumps(params), encoding="utf-8")
    (tmp / "runner.py").write_text(RUNNER, encoding="utf-8")
    work = tmp / "work"  # the notebook's cwd (its WORK without /kaggle/working): zips land here
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(tmp / "stub")}
    if path_prefix:
        env["PATH"] = path_prefix + os.pathsep + env.get("PATH", "")
    proc = subprocess.run([sys.executable, str(tmp / "runner.py"), str(tmp / "cells.json"), str(tmp / "params.json")],
                          cwd=work, env=env, capture_output=True, text=True, timeout=120)
    return proc, work


def test_cells_show_a_report_and_zip_it(tmp_path):
    if Path("/kaggle/working").exists():
        pytest.skip("on Kaggle the zip cell writes to /kaggle/working")
    d = _report_dir(tmp_path)
    proc, work = _execute(tmp_path, {"REPO_DIR": str(ROOT), "REPORT_DIR": str(d)})
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "nvidia-smi" not in out and "t4_run.sh" not in out  # REPORT_DIR: nothing is run again
    assert "DISPLAY Markdown '# Baseline vs solution: synthetic" in out
    assert f"DISPLAY Image {str(d / 'report.png')!r}" in out
    # the rule check: bench.rules on the synthetic report.json
    assert "-m bench.rules --report" in out and "Rule check:" in out
    assert "[PASS] own-kernel share of training time (excl. first 2 steps) >= 5%: 12.3%" in out
    assert re.search(r"\[PASS\] loss curve within tolerance .*: 3 steps", out)
    assert "Правила:" in out and (d / "rules.txt").read_text(encoding="utf-8").count("Rule check:") == 1
    # the first-look summary
    first = out[out.index("Сначала посмотрите сюда"):]
    for needle in ("12 passed", "Own-kernel share of training time excluding the first two steps: **12.3%**",
                   "| training time excl. first 2 steps (s) | 30.0 | 10.0 | 3.00x |", "peak GPU memory reserved",
                   "decoder CUDA graphs off: the GPU was the bottleneck.", "precompiling 40 kernel specializations",
                   "finished_before_training=True"):
        assert needle in first, needle
    # the zip cell
    zips = list(work.glob("t4-report-*.zip"))
    assert [z.name for z in zips] == [f"t4-report-{d.name}.zip"], out
    names = zipfile.ZipFile(zips[0]).namelist()
    for name in ("report.md", "report.json", "report.png", "solution/log.txt", "t4_run.log", "rules.txt"):
        assert f"{d.name}/{name}" in names, name
    assert "compile_manifest.json" in names
    assert not any("/output/" in n for n in names), names
    assert "DISPLAY FileLink" in out and "Готово:" in out


def test_run_cell_stops_in_russian_without_a_gpu(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n", encoding="utf-8")
    fake.chmod(0o755)
    proc, work = _execute(tmp_path, {"REPO_DIR": str(ROOT)}, path_prefix=str(bin_dir))
    out = proc.stdout
    assert proc.returncode == 3, out + proc.stderr
    assert "CELL 1 RAISED RuntimeError: Видеокарта не видна" in out and "Accelerator" in out
    assert "t4_run.sh" not in out and not list(work.iterdir())
