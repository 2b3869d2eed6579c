"""notebooks/kaggle_t4.ipynb, the one-cell T4 run on Kaggle, and the install part of scripts/t4_run.sh
(CPU, fast).

Static: a valid notebook; markdown cells in Russian; every command a code cell runs goes through
its `sh` helper and is one of the project's scripts (scripts/*.sh, python -m bench./solution.) or
the two system tools the notebook needs (nvidia-smi, git clone); no inline package installs.
Run: the whole comparison takes minutes even on the tiny CPU stand-in (over 12 min on a 2-core
machine), so the run cell is executed with REPORT_DIR set (show an existing report, run nothing)
against a synthetic report directory, then the zip cell; IPython.display is stubbed. Without a GPU
(a fake nvidia-smi that fails) the run cell stops with its Russian message before running anything.
With a fake nvidia-smi that works and a fake project whose scripts/t4_run.sh records what it gets,
the run branch is executed too: the model found in a fake Kaggle input tree, the dataset path, the
constraints file of the notebook's torch / Triton, the GPU pinning, the figures beside the official
baseline. The notebook's own functions are also called directly on fake input trees (model
discovery, constraints file). scripts/t4_run.sh's install runs with a fake python3: the constraints
file reaches pip, and a changed torch stops it with an ``error:`` line.
The quick default: FULL = False in the first code cell reaches scripts/t4_run.sh as T4_FULL=0 (no GPU
tests, `bench.compare --runs shipped --no-host-split`), FULL = True as T4_FULL=1 (the tests and
bench.compare's own default); SOLUTION_WHEELS=DIR makes the install offline (--no-index
--find-links DIR, only what is missing). The headless runner (scripts/run_notebook.py /
run_notebook.sh): its cell splitting and --set on the real notebook (dry run), a plain run of the
report-only branch end to end, and a failing cell that does not stop the next one.
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
                   "loss curve within tolerance", "измерьте на своём прогоне", "Accelerator", "Internet",
                   "Add Input", "1.5b-instruct", "MODEL_DIR", "DATA_PATH", "constraints.txt", "PIP_CONSTRAINT",
                   "torch.cuda.is_available()", "1–1,5 часа", "80 с, 14 ГБ, 900 токенов/с", "заглушк",
                   "kept after the install", "FULL = False", "FULL = True", "около 15–20 минут",
                   "Это модель, а не замер", "bench/t4_projection.py", "SOLUTION_WHEELS", "--runs shipped --no-host-split"):
        assert needle in text, needle
    assert "наше внимание на Triton" not in text  # removed from the code and from t4_run.sh's variants


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
    assert ["bash", "scripts/t4_run.sh", "--out", "RUN_DIR", "*MODEL_ARGS"] in calls
    assert ["sys.executable", "-m", "bench.rules", "--report", "report_json"] in calls
    assert ["nvidia-smi"] in calls
    assert run_cell.startswith("# ===== Параметры") and "\nFULL = False " in run_cell  # the switch, default quick
    for needle in ("Markdown(", "Image(", "report.md", "report.png", 'REPO_URL = ""', "CUDA_VISIBLE_DEVICES",
                   'MODEL_DIR = ""', 'DATA_PATH = ""', "PIP_CONSTRAINT", 'KAGGLE_INPUT = Path("/kaggle/input")'):
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
replace = params.pop("__replace__", {})
ns = {"__name__": "__main__"}
for i, src in enumerate(cells):
    for name, value in params.items():
        src = src.replace(f'{name} = ""', f"{name} = {value!r}", 1)
    for old, new in replace.items():
        src = src.replace(old, new)
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


FIGURES = {"baseline": {"duration_secs": 90.0, "train_excl_first2_s": 84.5, "tokens_per_s_excl_first2": 880.0,
                        "peak_mem_reserved_bytes": 13.2e9, "peak_mem_allocated_bytes": 11.4e9},
           "solution": {"duration_secs": 45.0, "train_excl_first2_s": 40.25, "tokens_per_s_excl_first2": 1850.0,
                        "peak_mem_reserved_bytes": 5.5e9, "peak_mem_allocated_bytes": 4.75e9}}


def _run_result(variant: str) -> dict:
    steps = (1, 2, 3)
    f = FIGURES[variant]
    return {"variant": variant, "rc": 0, "steps": 3, "soup_complete_panel": True, "prohibited_modules_loaded": [],
            **{k: v for k, v in f.items() if k != "duration_secs"},
            "trainer_logs": [{"step": s, "loss": 2.0 - 0.01 * s, "entropy": 1.0, "mean_token_accuracy": 0.5,
                              "grad_norm": 1.0, "num_tokens": 100.0 * s} for s in steps],
            "tracker": {"runs": [{"status": "completed", "total_steps": 3, "initial_loss": 1.99, "final_loss": 1.97,
                                  "duration_secs": f["duration_secs"]}],
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


def _execute(tmp: Path, params: dict, path_prefix: str | None = None, env_extra: dict | None = None,
             env_drop: tuple = ()):
    stub = tmp / "stub" / "IPython"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("", encoding="utf-8")
    (stub / "display.py").write_text(STUB, encoding="utf-8")
    (tmp / "cells.json").write_text(json.dumps(_code(_nb())), encoding="utf-8")
    (tmp / "params.json").write_text(json.dumps(params), encoding="utf-8")
    (tmp / "runner.py").write_text(RUNNER, encoding="utf-8")
    work = tmp / "work"  # the notebook's cwd (its WORK without /kaggle/working): zips land here
    work.mkdir()
    env = {**{k: v for k, v in os.environ.items() if k not in env_drop}, "PYTHONPATH": str(tmp / "stub"),
           **(env_extra or {})}
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
    _assert_beside_official(first)
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


def _assert_beside_official(first: str):
    """The synthetic report's figures beside the official baseline (80 s, 14 GB, 900 tokens/s)."""
    table = first[first.index("Рядом с официальным baseline задания"):]
    for name, official, base, sol in (("время обучения (Soup), с", "80.0", "90.0", "45.0"),
                                      ("  то же без шагов 1–2, с", "—", "84.5", "40.2"),
                                      ("пик памяти GPU reserved, ГБ", "14.0", "13.2", "5.5"),
                                      ("пик памяти GPU allocated, ГБ", "—", "11.4", "4.8"),
                                      ("токенов/с (без паддинга, шаги 3–64)", "900.0", "880.0", "1850.0")):
        assert re.search(rf"{re.escape(name)}\s+{re.escape(official)}\s+{re.escape(base)}\s+{re.escape(sol)}\n", table), name


# --- the run branch, model discovery and the constraints file --------------------------------------------
NAMES = {"FULL", "REPO_URL", "REPO_DIR", "MODEL_DIR", "DATA_PATH", "T4_VARIANTS", "REPORT_DIR", "WORK", "KAGGLE_INPUT",
         "OFFICIAL", "QWEN25_15B", "KEEP"}


def _cell_namespace(**overrides) -> dict:
    """The run cell's imports, constants and functions (nothing it runs), executed here; ``overrides``
    replace its globals (parameters, KAGGLE_INPUT)."""
    tree = ast.parse(_code(_nb())[0])
    keep = [n for n in tree.body
            if isinstance(n, (ast.Import, ast.FunctionDef))
            or (isinstance(n, ast.ImportFrom) and n.module != "IPython.display")
            or (isinstance(n, ast.Assign) and all(isinstance(t, ast.Name) and t.id in NAMES for t in n.targets))]
    ns: dict = {}
    exec(compile(ast.Module(body=keep, type_ignores=[]), "cell1", "exec"), ns)
    ns.update(overrides)
    return ns


QWEN25_CONFIG = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 1536,
                 "num_hidden_layers": 28, "intermediate_size": 8960, "num_attention_heads": 12,
                 "num_key_value_heads": 2, "vocab_size": 151936}


def _model_dir(root: Path, rel: str, weights=True, tokenizer=True, **config) -> Path:
    d = root / rel
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({**QWEN25_CONFIG, **config}), encoding="utf-8")
    if weights:
        (d / "model.safetensors").write_bytes(b"")
    if tokenizer:
        (d / "tokenizer.json").write_text("{}", encoding="utf-8")
    return d


def _fake_input(tmp: Path, with_model: bool = True) -> tuple[Path, Path | None]:
    """A fake /kaggle/input: a Qwen2.5-0.5B, a 1.5B config without weights, a Llama, our project as
    a dataset, and (``with_model``) the real-looking Qwen2.5-1.5B-Instruct as Kaggle mounts a model."""
    root = tmp / "input"
    _model_dir(root, "qwen2.5-small/transformers/0.5b-instruct/1", hidden_size=896, intermediate_size=4864)
    _model_dir(root, "broken-upload/qwen", weights=False)
    _model_dir(root, "llama/transformers/1b/1", model_type="llama", architectures=["LlamaForCausalLM"])
    (root / "soup-kernels" / "scripts").mkdir(parents=True)
    (root / "soup-kernels" / "config.json").write_text("not json", encoding="utf-8")
    good = _model_dir(root, "qwen2.5/transformers/1.5b-instruct/1") if with_model else None
    return root, good


def test_model_discovery_in_a_fake_kaggle_input(tmp_path):
    root, good = _fake_input(tmp_path)
    ns = _cell_namespace(KAGGLE_INPUT=root)
    found, rejected = ns["find_model"]()
    assert found == good
    reasons = {str(p.relative_to(root)): why for p, why in rejected}
    assert set(reasons) <= {"qwen2.5-small/transformers/0.5b-instruct/1", "broken-upload/qwen"}

    root2, _ = _fake_input(tmp_path / "no-model", with_model=False)
    found, rejected = _cell_namespace(KAGGLE_INPUT=root2)["find_model"]()
    reasons = {str(p.relative_to(root2)): why for p, why in rejected}
    assert found is None and set(reasons) == {"qwen2.5-small/transformers/0.5b-instruct/1", "broken-upload/qwen"}
    assert reasons["qwen2.5-small/transformers/0.5b-instruct/1"].startswith("не Qwen2.5-1.5B-Instruct: hidden_size=896")
    assert reasons["broken-upload/qwen"] == "нет файлов весов (*.safetensors)"
    assert _cell_namespace(KAGGLE_INPUT=tmp_path / "absent")["find_model"]() == (None, [])

    # MODEL_DIR: taken as given when it is the model, refused in Russian when it is not
    assert _cell_namespace(MODEL_DIR=str(good))["find_model"]() == (good, [])
    for bad in (root / "broken-upload" / "qwen", tmp_path / "nowhere"):
        with pytest.raises(RuntimeError, match=r"^MODEL_DIR = .*: (нет файлов весов|нет читаемого config.json)"):
            _cell_namespace(MODEL_DIR=str(bad))["find_model"]()


def test_dataset_path(tmp_path):
    assert _cell_namespace()["data_args"]() == []
    data = tmp_path / "train.jsonl"
    data.write_text("{}\n", encoding="utf-8")
    assert _cell_namespace(DATA_PATH=str(data))["data_args"]() == ["--data", data]
    with pytest.raises(RuntimeError, match=r"^DATA_PATH = .*: такого файла нет"):
        _cell_namespace(DATA_PATH=str(tmp_path / "missing.jsonl"))["data_args"]()


def test_constraints_file_keeps_the_installed_torch_and_triton(tmp_path):
    import importlib.metadata as md

    kept = _cell_namespace()["write_constraints"](tmp_path / "constraints.txt")
    lines = (tmp_path / "constraints.txt").read_text(encoding="utf-8").splitlines()
    assert lines == [f"{d}=={v}" for d, v in kept.items()]
    assert kept["torch"] == md.version("torch") and kept["triton"] == md.version("triton")
    assert set(kept) <= {"torch", "triton", "torchvision", "torchaudio"}


FAKE_T4_RUN = """#!/usr/bin/env bash
set -e
printf '%s\\n' "$@" > "$FAKE_LOG/args"
env > "$FAKE_LOG/env"
cp "$PIP_CONSTRAINT" "$FAKE_LOG/constraints"
cp -r "$FAKE_REPORT"/. "$2"/
echo "kept after the install: torch==0 triton==0; CUDA available"
"""


def _fake_project(tmp: Path) -> Path:
    """A writable project whose scripts/t4_run.sh records its arguments and environment and
    copies a synthetic report into --out; bench/, solution/, workload/ are this repository's."""
    repo = tmp / "project"
    (repo / "scripts").mkdir(parents=True)
    for name in ("bench", "solution", "workload"):
        (repo / name).symlink_to(ROOT / name)
    (repo / "scripts" / "t4_run.sh").write_text(FAKE_T4_RUN, encoding="utf-8")
    return repo


def _working_gpu(tmp: Path) -> str:
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: Tesla T4'\n", encoding="utf-8")
    (bin_dir / "nvidia-smi").chmod(0o755)
    return str(bin_dir)


@pytest.mark.parametrize("with_model", [True, False], ids=["real-model", "stand-in"])
def test_run_cell_passes_model_data_and_constraints(tmp_path, with_model):
    if Path("/kaggle/working").exists():
        pytest.skip("on Kaggle the cells write to /kaggle/working")
    root, good = _fake_input(tmp_path, with_model)
    report = _report_dir(tmp_path)
    repo, logs = _fake_project(tmp_path), tmp_path / "logs"
    logs.mkdir()
    data = tmp_path / "train.jsonl"
    data.write_text("{}\n", encoding="utf-8")
    replace = {'KAGGLE_INPUT = Path("/kaggle/input")': f"KAGGLE_INPUT = Path({str(root)!r})"}
    if with_model:  # and the full set
        replace["FULL = False "] = "FULL = True "
    params = {"REPO_DIR": str(repo), "DATA_PATH": str(data), "__replace__": replace}
    pinned = {} if with_model else {"CUDA_VISIBLE_DEVICES": "1,0"}
    proc, work = _execute(tmp_path, params, path_prefix=_working_gpu(tmp_path), env_drop=("CUDA_VISIBLE_DEVICES",),
                          env_extra={"FAKE_LOG": str(logs), "FAKE_REPORT": str(report), **pinned})
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    run_dir = Path((logs / "args").read_text(encoding="utf-8").splitlines()[1])
    expected = ["--out", str(run_dir), *(["--model", str(good)] if with_model else []), "--data", str(data)]
    assert (logs / "args").read_text(encoding="utf-8").splitlines() == expected
    assert run_dir.parent == repo / "runs" and run_dir.name.startswith("kaggle-")
    env = dict(l.split("=", 1) for l in (logs / "env").read_text(encoding="utf-8").splitlines() if "=" in l)
    assert env["PIP_CONSTRAINT"] == str(run_dir / "constraints.txt")
    assert env["PATH"].startswith(str(Path(sys.executable).parent) + os.pathsep)
    assert env.get("CUDA_VISIBLE_DEVICES") == (None if with_model else "1")
    assert env["T4_FULL"] == ("1" if with_model else "0")
    constraints = (logs / "constraints").read_text(encoding="utf-8")
    assert constraints.startswith("torch==") and "\ntriton==" in constraints
    if with_model:
        assert f"Модель: настоящая Qwen2.5-1.5B-Instruct из {good}" in out
    else:
        assert "Модель: ЗАГЛУШКА" in out and "Add Input → Models → Qwen2.5" in out
    if not with_model:  # with it, the search may stop at the model before it meets the others
        assert "Не подошла как модель: " in out and "hidden_size=896" in out
    assert ("Оценка времени всей ячейки на T4 (модель, не замер): "
            + ("около 1–1,5 часа (FULL = True)." if with_model else "около 15–20 минут")) in out
    first = out[out.index("Сначала посмотрите сюда"):]
    assert "kept after the install: torch==0 triton==0; CUDA available" in first
    _assert_beside_official(first)
    assert (run_dir / "constraints.txt").is_file()
    names = zipfile.ZipFile(next(work.glob("t4-report-*.zip"))).namelist()
    assert f"{run_dir.name}/constraints.txt" in names


# --- scripts/t4_run.sh's install, with a fake python3 --------------------------------------------------
FAKE_PYTHON = """#!/usr/bin/env bash
# python3 for scripts/t4_run.sh: pip records its constraints file (and with FAKE_CHANGE "replaces"
# torch), the version listing reads the fake installed versions, the missing-requirements script
# (read from stdin) prints $FAKE_MISSING, pytest and bench.compare record their arguments,
# everything else succeeds.
case "$*" in
  *"-m pip install"*) echo "$PIP_CONSTRAINT" > "$FAKE_LOG/pip"; cat "$PIP_CONSTRAINT" >> "$FAKE_LOG/pip"
                      echo "$*" >> "$FAKE_LOG/pip-args"
                      [ -n "${FAKE_CHANGE:-}" ] && touch "$FAKE_LOG/changed"; exit 0 ;;
  *importlib.metadata*) if [ -e "$FAKE_LOG/changed" ]; then echo "torch==2.99.0+cu132"; else echo "torch==2.10.0+cu128"; fi
                        echo "triton==3.6.0"; exit 0 ;;
  *"-m bench.compare"*) echo "$*" > "$FAKE_LOG/compare"; exit 0 ;;
  *"-m pytest"*) echo "$*" >> "$FAKE_LOG/pytest"; exit 0 ;;
  *get_device_name*) echo "Tesla T4"; exit 0 ;;
  -) if grep -q "missing requirements"; then printf '%s' "${FAKE_MISSING:-}"; fi; exit 0 ;;
  *) exit 0 ;;
esac
"""


def _t4_run(tmp: Path, env_extra: dict):
    bin_dir, logs = tmp / "bin", tmp / "logs"
    bin_dir.mkdir(parents=True)
    logs.mkdir()
    for name, text in (("python3", FAKE_PYTHON), ("nvidia-smi", "#!/bin/sh\necho 'GPU 0: Tesla T4'\n")):
        (bin_dir / name).write_text(text, encoding="utf-8")
        (bin_dir / name).chmod(0o755)
    env = {**{k: v for k, v in os.environ.items()
              if k not in ("PIP_CONSTRAINT", "T4_VARIANTS", "T4_FULL", "SOLUTION_WHEELS")},
           "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_LOG": str(logs), **env_extra}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "t4_run.sh"), "--out", str(tmp / "out")], env=env,
                          capture_output=True, text=True, timeout=60)
    return proc, logs


def test_t4_run_keeps_torch_and_triton(tmp_path):
    proc, logs = _t4_run(tmp_path, {})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pip = (logs / "pip").read_text(encoding="utf-8").splitlines()
    assert pip[1:] == ["torch==2.10.0+cu128", "triton==3.6.0"]  # written by the script: none was given
    assert "kept after the install: torch==2.10.0+cu128 triton==3.6.0; CUDA available" in proc.stdout
    assert (logs / "compare").read_text(encoding="utf-8").split()[-2:] == ["--out", str(tmp_path / "out")]


def test_t4_run_takes_the_notebooks_constraints(tmp_path):
    given = tmp_path / "constraints.txt"
    given.write_text("torch==2.10.0+cu128\ntriton==3.6.0\n", encoding="utf-8")
    proc, logs = _t4_run(tmp_path, {"PIP_CONSTRAINT": str(given)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (logs / "pip").read_text(encoding="utf-8").splitlines()[0] == str(given)


def test_t4_run_stops_when_the_install_replaced_torch(tmp_path):
    proc, logs = _t4_run(tmp_path, {"FAKE_CHANGE": "1"})
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: the install changed this machine's torch / Triton: torch==2.10.0+cu128 "
                                   "triton==3.6.0 -> torch==2.99.0+cu132 triton==3.6.0")
    assert not (logs / "compare").exists()  # nothing measured


def test_t4_run_quick_and_full(tmp_path):
    """T4_FULL=0 (the notebook's default): no GPU tests, the shipped run timed and profiled, no host
    split; T4_FULL=1 (and unset: the script's own default): the tests, then bench.compare's default."""
    for full in ("0", "1", None):
        tmp = tmp_path / str(full)
        proc, logs = _t4_run(tmp, {} if full is None else {"T4_FULL": full})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        compare = (logs / "compare").read_text(encoding="utf-8").split()
        assert compare[-2:] == ["--out", str(tmp / "out")]
        if full == "0":
            assert compare[:5] == ["-m", "bench.compare", "--runs", "shipped", "--no-host-split"], compare
            assert not (logs / "pytest").exists() and "quick comparison (T4_FULL=0)" in proc.stdout
        else:
            assert compare == ["-m", "bench.compare", "--out", str(tmp / "out")], compare
            assert "-m pytest -q -m gpu" in (logs / "pytest").read_text(encoding="utf-8")


def test_t4_run_installs_offline_from_solution_wheels(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    # everything installed already: pip is not called
    proc, logs = _t4_run(tmp_path / "all", {"SOLUTION_WHEELS": str(wheels), "T4_FULL": "0"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "every requirement is installed already; nothing to install" in proc.stdout
    assert not (logs / "pip").exists() and (logs / "compare").exists()
    # two missing: each from the wheels, no index
    proc, logs = _t4_run(tmp_path / "two", {"SOLUTION_WHEELS": str(wheels), "FAKE_MISSING": "nbformat\nmatplotlib\n"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = (logs / "pip-args").read_text(encoding="utf-8").splitlines()
    assert calls == [f"-m pip install -q --no-index --find-links {wheels} {d}" for d in ("nbformat", "matplotlib")]
    assert "kept after the install" in proc.stdout


def test_missing_requirements_script_runs_here():
    """The missing-requirements part of t4_run.sh, run by this Python on pyproject.toml: distribution
    names of the project's requirements, none of them installed here."""
    import importlib.metadata as md
    import tomllib

    text = (ROOT / "scripts" / "t4_run.sh").read_text(encoding="utf-8")
    script = text[text.index("# missing requirements"):text.index("\nPY\n)")]
    proc = subprocess.run([sys.executable, "-"], input=script, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    reqs = meta["dependencies"] + meta["optional-dependencies"]["workload"] + meta["optional-dependencies"]["test"]
    names = {re.match(r"[A-Za-z0-9_.-]+", r).group(0) for r in reqs}
    for name in proc.stdout.split():
        assert name in names
        with pytest.raises(md.PackageNotFoundError):
            md.version(name)
    assert "torch" not in proc.stdout.split()


# --- the headless runner: scripts/run_notebook.py / run_notebook.sh ---------------------------------------
RUN_NOTEBOOK = ROOT / "scripts" / "run_notebook.py"


def _runner():
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_notebook", RUN_NOTEBOOK)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_runner_splits_the_notebook_and_sets_parameters():
    rn = _runner()
    nb = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
    cells = rn.code_cells(nb)
    assert [src for _, src in cells] == _code(_nb())
    assert [nb["cells"][i]["cell_type"] for i, _ in cells] == ["code", "code"]
    full = rn.code_cells(rn.set_params(nb, ["FULL=True", "MODEL_DIR=/models/qwen", "T4_VARIANTS=1"]))[0][1]
    assert "\nFULL = True         # False — быстрое сравнение" in "\n" + full
    assert "\nMODEL_DIR = '/models/qwen'       # папка" in full and "\nT4_VARIANTS = 1  # True" in full
    assert rn.code_cells(nb)[0][1] == cells[0][1]  # the notebook given is not changed
    with pytest.raises(ValueError, match="no line `NOPE = ...`"):
        rn.set_params(nb, ["NOPE=1"])
    # the dry run: every code cell compiles, nothing runs
    proc = subprocess.run([sys.executable, str(RUN_NOTEBOOK), str(NOTEBOOK), "--dry-run", "--set", "FULL=True"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("cell 1/2: ") and "first statement: FULL = True" in lines[0]
    assert lines[1].startswith("cell 2/2: ") and "import zipfile" in lines[1]


def test_runner_keeps_going_after_a_failing_cell(tmp_path):
    nb = {"cells": [{"cell_type": "markdown", "source": ["# x"]},
                    {"cell_type": "code", "source": ["X = 1\n", "print('one', X)"]},
                    {"cell_type": "code", "source": "raise RuntimeError('broken')"},
                    {"cell_type": "code", "source": "from IPython.display import Markdown, display\n"
                                                    "display(Markdown('**md** ' + str(X + 1)))"}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path = tmp_path / "t.ipynb"
    path.write_text(json.dumps(nb), encoding="utf-8")
    proc = subprocess.run([sys.executable, str(RUN_NOTEBOOK), str(path), str(tmp_path / "out"), "--engine", "plain"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "one 1" in proc.stdout and "RuntimeError: broken" in proc.stdout and "**md** 2" in proc.stdout
    done = json.loads((tmp_path / "out" / "t.ipynb").read_text(encoding="utf-8"))
    outs = [c.get("outputs") for c in done["cells"] if c["cell_type"] == "code"]
    assert outs[0][0]["text"] == ["===== cell 1/3 =====\n", "one 1\n"]
    assert outs[1][-1]["output_type"] == "error" and outs[1][-1]["evalue"] == "broken"
    assert "**md** 2" in "".join(outs[2][0]["text"])
    assert "one 1" in (tmp_path / "out" / "t.log").read_text(encoding="utf-8")


def test_run_notebook_sh_runs_the_report_branch_end_to_end(tmp_path):
    """bash scripts/run_notebook.sh OUT with REPORT_DIR (show a report, run no training): the plain
    runner in this checkout, no clone; the executed notebook, its log and the zip land in OUT."""
    if Path("/kaggle/working").exists():
        pytest.skip("on Kaggle the zip cell writes to /kaggle/working")
    d = _report_dir(tmp_path)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "run_notebook.sh"), str(out), "--engine", "plain",
                           "--set", f"REPORT_DIR={d}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    text = proc.stdout
    assert proc.returncode == 0, text + proc.stderr
    assert f"Проект: {ROOT}" in text and "git clone" not in text and "nvidia-smi" not in text
    assert "# Baseline vs solution: synthetic" in text and f"[image: {d / 'report.png'}]" in text
    assert "Rule check:" in text and "Правила: " in text and "Сначала посмотрите сюда" in text
    assert sorted(p.name for p in out.iterdir()) == ["kaggle_t4.ipynb", "kaggle_t4.log", f"t4-report-{d.name}.zip"]
    assert not list(ROOT.glob("t4-report-*.zip"))
    done = nbformat.read(out / "kaggle_t4.ipynb", as_version=4)
    nbformat.validate(done)
    outputs = [c.outputs for c in done.cells if c.cell_type == "code"]
    assert all(o and o[0].output_type == "stream" for o in outputs)
    assert "Готово:" in outputs[1][0].text


def test_the_reports_first_line_says_when_the_model_is_the_stand_in():
    from types import SimpleNamespace

    from bench import compare, report
    from workload.config import load_workload

    def first_line(label):
        run = {"steps": 3, "step_times_s": [1.0] * 3, "train_excl_first2_s": 1.0,
               "trainer_logs": [{"step": i + 1, "loss": 2.0, "num_tokens": 100 * (i + 1)} for i in range(3)]}
        rep = compare.build_report(SimpleNamespace(argv=[]), label, {**run, "variant": "baseline"},
                                   {**run, "variant": "solution"}, None, None, load_workload())
        return report.markdown(rep).splitlines()[0]

    assert first_line("stand-in (full)") == ("# Baseline vs solution: stand-in (full): seeded random weights, NOT the "
                                             "real Qwen2.5-1.5B-Instruct")
    assert first_line("user model") == "# Baseline vs solution: user model"
