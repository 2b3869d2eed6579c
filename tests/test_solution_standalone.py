"""solution/ stands on its own: what the challenge's repository gets is the folder, nothing else.

(a) No file under solution/ imports anything from this project's ``bench``, ``workload`` or
    ``tests`` (every Import / ImportFrom node, function-local ones included, read with ``ast``).
(b) The folder copied alone into a temporary directory imports and installs there: a child
    process with that directory as its working directory and only path of its own (no
    PYTHONPATH to the repository; the editable install's finder and the repository root taken off
    ``sys.path`` / ``sys.meta_path``) runs ``import solution; solution.apply()`` with
    TRITON_INTERPRET=1 (so that it installs on a CPU), prints what was installed, then
    ``solution.revert()``.
"""
from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import pythonpath_without_repo

ROOT = Path(__file__).resolve().parent.parent
SOLUTION = ROOT / "solution"
PROJECT_ONLY = ("bench", "workload", "tests")  # this repository's other top-level packages


def _imported_modules(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``tree`` (relative imports resolved
    against ``package``, the dotted package of the file)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # from . import x / from ..y import z: inside the package by construction
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append((node.lineno, name))
    return out


def test_solution_imports_nothing_from_the_rest_of_the_project():
    files = sorted(SOLUTION.rglob("*.py"))
    assert files, "no Python files under solution/"
    bad, seen_local = [], 0
    for path in files:
        rel = path.relative_to(ROOT)
        package = ".".join(rel.with_suffix("").parts[:-1])
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for func in ast.walk(tree):
            if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                seen_local += any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(func))
        for line, name in _imported_modules(tree, package):
            if name.split(".")[0] in PROJECT_ONLY:
                bad.append(f"{rel}:{line}: imports {name}")
    assert seen_local > 0, "expected function-local imports in solution/ (the walk must see them)"
    assert not bad, "solution/ must not depend on the rest of this repository:\n" + "\n".join(bad)


def test_the_static_check_sees_function_local_imports():
    """The check above walks into function bodies and resolves relative imports."""
    tree = ast.parse("def f():\n    import bench.rules\n    from workload import config\n"
                     "from . import env\nfrom ..tests import x\n")
    names = [name for _, name in _imported_modules(tree, "solution.kernels")]
    # "from . import env" names its package; "from ..tests" stays inside solution/ (not ./tests)
    assert sorted(names) == ["bench.rules", "solution.kernels", "solution.tests", "workload"]
    bad = [name for name in names if name.split(".")[0] in PROJECT_ONLY]
    assert sorted(bad) == ["bench.rules", "workload"]


# The child: strip every way back to the repository, check that it is gone, then apply / revert.
_CHILD = r"""
import importlib.util, json, os, sys
repo, here = sys.argv[1], os.getcwd()
norm = lambda p: os.path.normcase(os.path.realpath(p or "."))
# the editable install of this project (setuptools' __editable__ finder and its path hook)
editable = lambda obj: str(getattr(obj, "__module__", "") or "").startswith("__editable__") or \
    str(getattr(type(obj), "__module__", "")).startswith("__editable__") or \
    "__editable__" in getattr(getattr(obj, "__self__", None), "__module__", "")
sys.meta_path[:] = [f for f in sys.meta_path if not editable(f)]
sys.path_hooks[:] = [h for h in sys.path_hooks if not editable(h)]
sys.path[:] = [p for p in sys.path if "__editable__" not in p and norm(p) != norm(repo)]
sys.path_importer_cache.clear()
for name in ("bench", "workload", "tests"):
    spec = importlib.util.find_spec(name)
    if spec is not None and norm(spec.origin or "").startswith(norm(repo)):
        raise SystemExit(f"isolation failed: {name} importable from {spec.origin}")
import solution
print("SOLUTION_FILE", solution.__file__, flush=True)
installed = solution.apply()
print("INSTALLED", json.dumps(sorted(installed)), flush=True)
leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("bench", "workload", "tests"))
print("PROJECT_MODULES", json.dumps(leaked), flush=True)
outside = sorted({m for m, mod in list(sys.modules.items()) if m.split(".")[0] == "solution"
                  and getattr(mod, "__file__", None) and not norm(mod.__file__).startswith(norm(here))})
print("SOLUTION_OUTSIDE", json.dumps(outside), flush=True)
solution.revert()
print("REVERTED", json.dumps(sorted(solution.installed())), flush=True)
"""


def _lines(out: str, key: str) -> list[str]:
    return [line[len(key) + 1:] for line in out.splitlines() if line.startswith(key + " ")]


def test_solution_folder_alone_installs_and_reverts(tmp_path):
    shutil.copytree(SOLUTION, tmp_path / "solution",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONSAFEPATH")}
    # the copy first; the caller's other site folders (not the repository) stay reachable
    env.update(TRITON_INTERPRET="1", PYTHONPATH=pythonpath_without_repo(str(tmp_path)), PYTHONDONTWRITEBYTECODE="1",
               SOLUTION_PRECOMPILE="0", TOKENIZERS_PARALLELISM="false")
    for k in [k for k in env if k.startswith("SOLUTION_")]:
        if k != "SOLUTION_PRECOMPILE":
            del env[k]  # the defaults, whatever the calling shell set
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(ROOT)], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"child failed (exit {proc.returncode}):\n{out[-4000:]}"

    (file_line,) = _lines(out, "SOLUTION_FILE")
    child_file = Path(file_line).resolve()
    assert child_file.is_relative_to(tmp_path.resolve()), f"solution imported from {child_file}, not the copy"

    installed = json.loads(_lines(out, "INSTALLED")[0])
    print("installed by apply() in the copied folder:", ", ".join(installed))
    for name in ("qwen2_unpad", "qwen2_layer_node", "qwen2_lm_head_loss", "trainer_lengths", "trainer_flops"):
        assert name in installed, f"{name} not installed from the copied folder:\n{out[-4000:]}"
    assert json.loads(_lines(out, "PROJECT_MODULES")[0]) == [], "solution pulled in bench / workload / tests"
    assert json.loads(_lines(out, "SOLUTION_OUTSIDE")[0]) == [], "a solution module came from outside the copy"
    assert json.loads(_lines(out, "REVERTED")[0]) == []


def test_the_isolation_would_catch_an_import_of_the_project(tmp_path):
    """Control for the test above: a copy whose __init__ imports ``workload`` must fail to import
    in the same child (so a pass above is not the editable install finding the repository)."""
    shutil.copytree(SOLUTION, tmp_path / "solution", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    init = tmp_path / "solution" / "__init__.py"
    init.write_text("import workload.config  # planted\n" + init.read_text(encoding="utf-8"), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env.update(TRITON_INTERPRET="1", PYTHONPATH=pythonpath_without_repo(str(tmp_path)), PYTHONDONTWRITEBYTECODE="1",
               SOLUTION_PRECOMPILE="0")
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(ROOT)], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "No module named 'workload'" in proc.stderr, proc.stdout + proc.stderr
