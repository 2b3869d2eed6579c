"""Porting to a harness that starts Soup in a process of its own (docs/PORTING.md, form b).

(a) ``python -m solution.run COMMAND``: a child process applies the patches, then runs a Python
    file / Soup's ``soup`` console script in the same process, with its own argv and exit status,
    and reports our kernels' launches at exit; a bad command is one ``error:`` line, exit 2,
    nothing applied.
(b) ``python -m solution.autoapply install``: the .pth hook in a fresh interpreter's site-packages
    (a throwaway venv). A child started with SOLUTION_AUTO_APPLY=1 gets the patches when it imports
    ``soup_cli`` (a stand-in package here), loaded from this repository without it on sys.path; no
    variable, "0", or a process that never imports Soup: nothing; a bad value: exit 2 before Soup
    runs. ``uninstall`` removes the file; ``status`` says where it is.
(c) The docs: both languages name the commands, and the adapter of form (c) compiles and calls
    only solution.apply / solution.revert.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from solution import autoapply, run
from tests.conftest import pythonpath_without_repo

ROOT = Path(__file__).resolve().parent.parent
APPLIED = re.compile(r"^\[solution\] applied in process \d+ \((.*); solution from (.*)\): (\d+) installed", re.M)


def _child(args, tmp_path, env=None, python=sys.executable, pythonpath=None, timeout=300):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SOLUTION_")}
    environ.update({"TRITON_INTERPRET": "1", "PYTHONPATH": pythonpath_without_repo(str(ROOT)) if pythonpath is None
                    else pythonpath, **(env or {})})
    return subprocess.run([python, *args], cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=timeout)


# --- (a) python -m solution.run ----------------------------------------------------------------------
def test_run_applies_then_runs_a_file_in_the_same_process(tmp_path):
    script = tmp_path / "train.py"
    (tmp_path / "helper_next_to_it.py").write_text("VALUE = 'found'\n", encoding="utf-8")
    script.write_text(textwrap.dedent("""\
        import sys, torch, solution
        from helper_next_to_it import VALUE  # its own folder is sys.path[0], as with python train.py
        from solution.kernels.rmsnorm import _launch_forward
        print("argv", sys.argv[1:], "installed", len(solution.installed()), VALUE)
        _launch_forward(torch.randn(3, 8), torch.ones(8), 1e-6)
        sys.exit(7)
        """), encoding="utf-8")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    proc = _child(["-m", "solution.run", "--", str(script), "a", "--b"], elsewhere)
    out = proc.stdout
    assert proc.returncode == 7, out + proc.stderr  # the command's exit status
    m = APPLIED.search(out)
    assert m and m.group(1).startswith("python -m solution.run") and int(m.group(3)) >= 7, out
    assert Path(m.group(2)) == ROOT / "solution"
    assert out.index("[solution] applied") < out.index("argv ['a', '--b'] installed")
    assert re.search(r"installed \d+ found", out)  # the import next to the file worked
    assert out.rstrip().splitlines()[-1] == ("[solution] our kernels in this process: 1 launches of 1 kernels "
                                             "(most: _rmsnorm_fwd_kernel 1)")


def test_run_takes_soups_console_script(tmp_path):
    pytest.importorskip("soup_cli")
    proc = _child(["-m", "solution.run", "soup", "--version"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert APPLIED.search(proc.stdout) and "soup v" in proc.stdout


@pytest.mark.parametrize("argv,message", [([], "no command given"), (["-m"], "-m needs a module name"),
                                          (["-m", "no_such_module_x"], "no module named 'no_such_module_x'"),
                                          (["missing.py"], "no such file: missing.py"),
                                          (["no-such-command-x"], "is not a console script")])
def test_run_refuses_a_bad_command_before_applying(argv, message, capsys, monkeypatch, tmp_path):
    import solution

    monkeypatch.chdir(tmp_path)
    assert run.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: ") and message in err and len(err.splitlines()) == 1
    assert solution.installed() == {}


# --- (b) the .pth hook ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A fresh interpreter (venv of this Python, no pip) with the hook installed by its own Python,
    a stand-in ``soup_cli`` package and the path to this process's libraries (not the repository)."""
    tmp = tmp_path_factory.mktemp("hook")
    made = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp / "venv")], capture_output=True,
                          text=True, timeout=120)
    if made.returncode != 0:
        pytest.skip(f"this Python cannot make a venv: {made.stderr.strip()[-200:]}")
    python = tmp / "venv" / "bin" / "python"
    proc = _child(["-m", "solution.autoapply", "install"], tmp, python=python,
                  pythonpath=pythonpath_without_repo(str(ROOT)))
    assert proc.returncode == 0 and proc.stdout.startswith("hook installed: "), proc.stdout + proc.stderr
    site = Path(proc.stdout.split("hook installed: ")[1].split(";")[0]).parent
    (tmp / "fake" / "soup_cli").mkdir(parents=True)
    (tmp / "fake" / "soup_cli" / "__init__.py").write_text('print("soup_cli imported")\n', encoding="utf-8")
    libs = [p for p in sys.path if p and Path(p).is_dir() and Path(p).resolve() != ROOT]
    return {"tmp": tmp, "python": python, "site": site,
            "pythonpath": os.pathsep.join([str(tmp / "fake"), *libs])}


PROBE = textwrap.dedent("""\
    import sys
    {imports}
    s = sys.modules.get("solution")
    print("installed:", len(s.installed()) if s else "no solution module")
    """)


def _probe(venv, value, imports="import soup_cli"):
    script = venv["tmp"] / "probe.py"
    script.write_text(PROBE.format(imports=imports), encoding="utf-8")
    env = {} if value is None else {"SOLUTION_AUTO_APPLY": value}
    return _child([str(script)], venv["tmp"], env=env, python=venv["python"], pythonpath=venv["pythonpath"])


def test_hook_file_is_in_the_fresh_interpreters_site_packages(venv):
    pth = venv["site"] / autoapply.PTH_NAME
    assert pth.is_file() and pth.read_text(encoding="utf-8") == autoapply.pth_text()
    assert str(ROOT / "solution" / "autoapply.py") in pth.read_text(encoding="utf-8")


def test_hook_applies_in_the_process_that_imports_soup(venv):
    proc = _probe(venv, "1")
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    m = APPLIED.search(out)
    assert m and m.group(1) == "import of soup_cli" and Path(m.group(2)) == ROOT / "solution", out
    assert out.index("soup_cli imported") < out.index("[solution] applied") < out.index("installed: ")
    assert f"installed: {m.group(3)}" in out and len(APPLIED.findall(out)) == 1  # once, though site runs .pth twice
    assert out.rstrip().splitlines()[-1].startswith("[solution] no kernel of ours launched in this process")


@pytest.mark.parametrize("value", [None, "0", "off"])
def test_hook_off(venv, value):
    proc = _probe(venv, value)
    assert proc.returncode == 0 and "[solution]" not in proc.stdout, proc.stdout + proc.stderr
    assert "soup_cli imported" in proc.stdout


def test_hook_leaves_processes_that_never_import_soup(venv):
    proc = _probe(venv, "1", imports="import json")
    assert proc.returncode == 0 and proc.stdout == "installed: no solution module\n", proc.stdout + proc.stderr


def test_hook_refuses_a_bad_value_before_soup_runs(venv):
    proc = _probe(venv, "maybe", imports="import soup_cli\nprint('soup ran')")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == ("error: $SOLUTION_AUTO_APPLY='maybe' is not an on/off value: expected one of "
                                   "1/true/on/yes or 0/false/off/no")
    assert "soup ran" not in proc.stdout


def test_installer_commands(tmp_path, capsys):
    assert autoapply.main(["status", "--site", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("hook not installed in ")
    for _ in range(2):  # idempotent
        assert autoapply.main(["install", "--site", str(tmp_path)]) == 0
    assert [p.name for p in tmp_path.iterdir()] == [autoapply.PTH_NAME]
    assert autoapply.main(["status", "--site", str(tmp_path)]) == 0
    assert "hook installed: " in capsys.readouterr().out
    assert autoapply.main(["uninstall", "--site", str(tmp_path)]) == 0
    assert list(tmp_path.iterdir()) == []
    assert autoapply.main(["uninstall", "--site", str(tmp_path)]) == 0
    assert "was not installed" in capsys.readouterr().out
    for bad in (["install", "--site", str(tmp_path / "nope")], ["remove"], [], ["install", "--site"]):
        assert autoapply.main(bad) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.startswith("error: ") and len(err.splitlines()) == 1, bad


# --- (c) the docs ---------------------------------------------------------------------------------------
DOCS = [ROOT / "docs" / "PORTING.md", ROOT / "docs" / "ru" / "PORTING.md"]


@pytest.mark.parametrize("doc", DOCS, ids=["en", "ru"])
def test_porting_docs_name_every_form_and_command(doc):
    text = doc.read_text(encoding="utf-8")
    for needle in ("solution.apply()", "python -m solution.run", "python -m solution.autoapply install",
                   "SOLUTION_AUTO_APPLY=1", "python -m solution.selfcheck", "[solution] applied in process",
                   "our kernels in this process", "python -m solution.autoapply uninstall"):
        assert needle in text, needle
    if "/ru/" in str(doc):
        assert re.search(r"[А-Яа-яЁё]", text)


def test_the_adapter_in_the_docs_calls_only_apply_and_revert():
    for doc in DOCS:
        blocks = re.findall(r"```python\n(.*?)```", doc.read_text(encoding="utf-8"), re.S)
        adapters = [b for b in blocks if "def " in b]
        assert adapters, doc
        for block in adapters:
            calls = {ast.unparse(n.func) for n in ast.walk(ast.parse(block)) if isinstance(n, ast.Call)}
            assert calls and calls <= {"solution.apply", "solution.revert"}, calls
