"""Run a command in this Python process with the patches applied first (docs/PORTING.md, b1):

    python -m solution.run soup train --config soup.yaml --yes   # a console script (Soup's "soup")
    python -m solution.run -m soup_cli train --config ...        # a module, as python -m runs it
    python -m solution.run train_script.py --arg ...             # a Python file

A bad command: one ``error:`` line, exit status 2, nothing run. Then ``solution.apply()`` runs here, the
command runs with the ``sys.argv`` and ``sys.path[0]`` it would have had on its own, its exit status becomes
this one's, and at exit one line counts our kernels' launches. Arguments pass through untouched.
"""
from __future__ import annotations

import runpy
import shutil
import sys
from importlib import metadata
from pathlib import Path

USAGE = "usage: python -m solution.run [--] COMMAND [ARGS...]   (COMMAND: a console script, -m MODULE, or FILE.py)"


def resolve(argv: list[str]):
    """(kind, target, argv for the command) for ``argv`` (the words after ``solution.run``), kind
    "script" (a console-script entry point), "module" or "file". ValueError: why not runnable."""
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise ValueError("no command given")
    if argv[0] == "-m":
        if len(argv) < 2:
            raise ValueError("-m needs a module name")
        import importlib.util

        if importlib.util.find_spec(argv[1]) is None:
            raise ValueError(f"no module named {argv[1]!r}")
        return "module", argv[1], [argv[1], *argv[2:]]
    if argv[0].endswith(".py"):
        if not Path(argv[0]).is_file():
            raise ValueError(f"no such file: {argv[0]}")
        return "file", argv[0], list(argv)
    found = [ep for ep in metadata.entry_points(group="console_scripts") if ep.name == argv[0]]
    if not found:
        raise ValueError(f"{argv[0]!r} is not a console script of this Python (nor -m MODULE, nor FILE.py)")
    return "script", found[0], list(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        kind, target, command_argv = resolve(argv)
    except ValueError as exc:
        print(f"error: {exc}; {USAGE}", file=sys.stderr)
        return 2
    from solution.autoapply import apply_here

    apply_here(f"python -m solution.run {' '.join(command_argv)[:80]}")
    sys.argv = command_argv
    if kind == "module":  # sys.path[0] stays the working directory, as with python -m
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return 0
    if kind == "file":  # sys.path[0]: the file's folder, as with python FILE.py
        sys.path[0] = str(Path(target).resolve().parent)
        runpy.run_path(target, run_name="__main__")
        return 0
    script = shutil.which(command_argv[0])  # sys.path[0]: the console script's folder, as when it runs itself
    sys.path[0] = str(Path(script).resolve().parent) if script else str(Path(sys.executable).parent)
    result = target.load()()
    return result if isinstance(result, int) else (0 if result is None else 1)


if __name__ == "__main__":
    sys.exit(main())
