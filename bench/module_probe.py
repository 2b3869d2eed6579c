"""What the whole-run probes (bench/gc_probe.py, bench/gemm_probe.py) share: their command line
(leading ``--NAME VALUE`` options in a fixed order, then ``-m MODULE ARGS...``), running that
module in this process as ``python -m`` would, and writing their report at exit."""
from __future__ import annotations

import atexit
import runpy
import sys


def parse(argv: list[str], prog: str, options: tuple[str, ...]) -> tuple[dict[str, str], str, list[str]]:
    """({option: value} for the options given, in ``options``' order, each at most once; the module;
    its arguments). SystemExit with the usage line when no ``-m MODULE`` follows."""
    found = {}
    for name in options:
        if argv[:1] == [name]:
            found[name], argv = argv[1], argv[2:]
    if argv[:1] != ["-m"] or len(argv) < 2:
        shown = " ".join(f"[{name} {name.lstrip('-').upper()}]" for name in options)
        raise SystemExit(f"usage: python -m {prog} {shown} -m MODULE ARGS...")
    return found, argv[1], argv[2:]


def run(module: str, rest: list[str], report) -> None:
    """``report()`` registered for the process's exit, then ``module`` run as ``__main__`` with ``rest``."""
    atexit.register(report)
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def write(out: str | None, text: str) -> None:
    """The report's JSON text into ``out`` (nothing when None)."""
    if out:
        with open(out, "w") as f:
            f.write(text)
