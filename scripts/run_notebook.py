"""Execute a notebook's code cells headless, end to end, and keep what they printed.

    python scripts/run_notebook.py NOTEBOOK OUT_DIR [--set NAME=VALUE ...] [--engine auto|jupyter|plain] [--dry-run]

Two engines:
- ``jupyter`` (nbclient + ipykernel, what `jupyter nbconvert --execute` uses): the notebook runs in a
  real kernel; OUT_DIR/<name>.ipynb is the executed notebook.
- ``plain`` (nothing but this Python): the code cells run in order, with exec, in one namespace, in
  this process; IPython.display is replaced by a stub that prints what would be shown (Markdown text,
  an image's file name, a link's path). Each cell's output is printed as it comes, also written to
  OUT_DIR/<name>.log, and kept as that cell's stream output in OUT_DIR/<name>.ipynb.
``auto`` (the default) takes jupyter where nbclient and ipykernel import, plain otherwise.

As in "Run all" of a notebook whose cells say "run the next one even if this one failed", a cell
that raises does not stop the later ones; the exit status is then 1 (0: every cell ran).
The working directory is the caller's (the notebook finds the project from it).

--set NAME=VALUE replaces the value of the first ``NAME = ...`` line of the first code cell (its
parameters): VALUE is taken as a Python literal where it parses as one (True, 3, "x"), else as a
string. --dry-run splits the notebook, applies --set, compiles each code cell and prints a line
per cell; nothing is executed and nothing written.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import importlib.util
import io
import json
import re
import sys
import traceback
import types
from pathlib import Path


def code_cells(nb: dict) -> list[tuple[int, str]]:
    """(index in nb["cells"], source) of every code cell, in order."""
    out = []
    for i, cell in enumerate(nb["cells"]):
        if cell.get("cell_type") == "code":
            src = cell.get("source", "")
            out.append((i, src if isinstance(src, str) else "".join(src)))
    return out


def literal(value: str):
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return value


def set_params(nb: dict, assignments: list[str]) -> dict:
    """A copy of nb whose first code cell has each NAME=VALUE of ``assignments`` in place of its
    ``NAME = ...`` line's value (a trailing comment kept). An unknown NAME is an error."""
    nb = copy.deepcopy(nb)
    cells = code_cells(nb)
    if not cells:
        raise ValueError("the notebook has no code cell")
    index, src = cells[0]
    for item in assignments:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name.isidentifier():
            raise ValueError(f"--set {item!r}: give NAME=VALUE")
        pattern = re.compile(rf"^({re.escape(name)}\s*=\s*)(.*?)(\s*#.*)?$", re.M)
        match = pattern.search(src)
        if not match:
            raise ValueError(f"--set {name}: no line `{name} = ...` in the first code cell")
        src = src[:match.start(2)] + repr(literal(value)) + src[match.end(2):]
    nb["cells"][index]["source"] = src.splitlines(keepends=True)
    return nb


DISPLAY_STUB = '''
class _Shown:
    def __init__(self, data=None, url=None, filename=None, **kw):
        self.data, self.filename = data, filename or url
class Markdown(_Shown):
    pass
class Image(_Shown):
    pass
class FileLink:
    def __init__(self, path, **kw):
        self.path = path
def display(*objs, **kw):
    for o in objs:
        if isinstance(o, Markdown):
            print(o.data)
        elif isinstance(o, Image):
            print(f"[image: {o.filename}]")
        elif isinstance(o, FileLink):
            print(f"[file: {o.path}]")
        else:
            print(o)
'''


def install_display_stub() -> None:
    """IPython.display as a module that prints (whether or not IPython is installed)."""
    display = types.ModuleType("IPython.display")
    exec(DISPLAY_STUB, display.__dict__)
    ipython = sys.modules.get("IPython") or types.ModuleType("IPython")
    ipython.display = display
    sys.modules["IPython"], sys.modules["IPython.display"] = ipython, display


class Tee(io.TextIOBase):
    """Writes to several text streams (this process's stdout, the log, the cell's buffer)."""

    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for s in self.streams:
            s.write(text)
        return len(text)

    def flush(self):
        for s in self.streams:
            s.flush()


def run_plain(nb: dict, name: str, out: Path) -> int:
    install_display_stub()
    ns = {"__name__": "__main__"}
    failed = 0
    cells = code_cells(nb)
    real_out = sys.stdout
    with open(out / f"{name}.log", "w", encoding="utf-8") as log:
        for n, (index, src) in enumerate(cells, 1):
            buf = io.StringIO()
            tee = Tee(real_out, log, buf)
            tee.write(f"===== cell {n}/{len(cells)} =====\n")
            cell = nb["cells"][index]
            cell["outputs"], cell["execution_count"] = [], n
            try:
                with contextlib.redirect_stdout(tee), contextlib.redirect_stderr(tee):
                    exec(compile(src, f"<cell {n}>", "exec"), ns)
            except BaseException as exc:  # noqa: BLE001 - a cell's SystemExit / KeyboardInterrupt too
                if isinstance(exc, KeyboardInterrupt):
                    raise
                failed += 1
                tb = traceback.format_exc()
                tee.write(tb)
                cell["outputs"].append({"output_type": "error", "ename": type(exc).__name__, "evalue": str(exc),
                                        "traceback": tb.splitlines()})
            finally:
                tee.flush()
            text = buf.getvalue()
            if text:
                cell["outputs"].insert(0, {"output_type": "stream", "name": "stdout",
                                           "text": text.splitlines(keepends=True)})
    (out / f"{name}.ipynb").write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"[run_notebook] {len(cells) - failed}/{len(cells)} code cells ran without an error; "
          f"{out / (name + '.ipynb')}, {out / (name + '.log')}", flush=True)
    return 1 if failed else 0


def run_jupyter(nb: dict, name: str, out: Path) -> int:
    import nbformat
    from nbclient import NotebookClient

    node = nbformat.from_dict(nb)
    client = NotebookClient(node, timeout=None, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(Path.cwd())}})
    try:
        client.execute()
    finally:
        nbformat.write(node, out / f"{name}.ipynb")
    errors = [o for c in node.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    for e in errors:
        print(f"[run_notebook] a cell raised {e.get('ename')}: {e.get('evalue')}", flush=True)
    print(f"[run_notebook] executed: {out / (name + '.ipynb')}", flush=True)
    return 1 if errors else 0


def jupyter_available() -> bool:
    return all(importlib.util.find_spec(m) for m in ("nbformat", "nbclient", "ipykernel"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebook")
    ap.add_argument("out", nargs="?", help="output folder (not needed with --dry-run)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a parameter of the first code cell (repeatable)")
    ap.add_argument("--engine", choices=("auto", "jupyter", "plain"), default="auto")
    ap.add_argument("--dry-run", action="store_true", help="split, apply --set, compile; run nothing")
    args = ap.parse_args(argv)
    path = Path(args.notebook)
    try:
        nb = set_params(json.loads(path.read_text(encoding="utf-8")), args.set)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cells = code_cells(nb)
    if args.dry_run:
        for n, (_, src) in enumerate(cells, 1):
            compile(src, f"<cell {n}>", "exec")
            first = next((l for l in src.splitlines() if l.strip() and not l.startswith("#")), "")
            print(f"cell {n}/{len(cells)}: {len(src.splitlines())} lines, compiles; first statement: {first[:80]}")
        return 0
    if not args.out:
        ap.error("OUT_DIR is needed (or --dry-run)")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    engine = args.engine if args.engine != "auto" else ("jupyter" if jupyter_available() else "plain")
    print(f"[run_notebook] {path} ({len(cells)} code cells), engine {engine}, output {out}", flush=True)
    return (run_jupyter if engine == "jupyter" else run_plain)(nb, path.stem, out)


if __name__ == "__main__":
    sys.exit(main())
