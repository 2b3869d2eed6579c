"""Apply the patches in a Soup process that someone else starts (docs/PORTING.md, b2):

    python -m solution.autoapply install [--site DIR]   # once: writes the hook into site-packages
    SOLUTION_AUTO_APPLY=1 soup train --config ... --yes # any process started this way applies
    python -m solution.autoapply status                 # where the hook is, what it loads
    python -m solution.autoapply uninstall [--site DIR] # removes it

The ``.pth`` file's line runs at every Python start-up and does nothing unless $SOLUTION_AUTO_APPLY is set;
then ``boot()`` adds an import hook that calls ``solution.apply()`` once, right after ``soup_cli`` is loaded
and before its CLI runs, and at exit one line counts our kernels' launches. ``solution`` is loaded from ROOT
without touching ``sys.path``. A bad setting: one ``error:`` line, exit status 2, before Soup runs; any other
failure of apply(): one ``[solution]`` line, and Soup runs the stock path.
"""
from __future__ import annotations

import atexit
import importlib.util
import os
import sys
import sysconfig
from pathlib import Path

ENV = "SOLUTION_AUTO_APPLY"  # the variable: solution.settings reads it (auto_apply_enabled, auto_apply_startup_test)
TRIGGER = "soup_cli"  # the package whose import applies the patches
PTH_NAME = "solution-autoapply.pth"
ROOT = Path(__file__).resolve().parent.parent  # the folder holding solution/
SELF_NAME = "_solution_autoapply"  # this file's module name when the .pth line loads it


def pth_text(root: Path = ROOT) -> str:
    """The .pth file's text: a comment, then the one ``import`` line Python runs at start-up."""
    from solution.settings import auto_apply_startup_test

    path = str(root / "solution" / "autoapply.py")
    load = (f"import importlib.util as u; s = u.spec_from_file_location({SELF_NAME!r}, {path!r}); "
            "m = u.module_from_spec(s); sys.modules[s.name] = m; s.loader.exec_module(m); m.boot()")
    return (f"# soup-qlora-kernels: with ${ENV} set, a process that imports {TRIGGER} calls solution.apply() "
            f"(solution/autoapply.py). Remove with: python -m solution.autoapply uninstall\n"
            f"import os, sys; {auto_apply_startup_test()} and {SELF_NAME!r} not in sys.modules "
            f"and exec({load!r})\n")


class _SoupHook:
    """A sys.meta_path finder: TRIGGER is found and loaded by the usual finders, then ``apply_here`` runs once."""

    def __init__(self) -> None:
        self.fired = False

    def find_spec(self, name, path=None, target=None):
        if name != TRIGGER or self.fired:
            return None
        self.fired = True
        spec = None
        for finder in sys.meta_path:
            if _is_hook(finder) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            apply_here(f"import of {TRIGGER}", check_env=True)  # nothing to wrap: apply now
            return spec
        spec.loader = _ThenApply(spec.loader)
        return spec


class _ThenApply:
    """A loader that runs the real loader, then apply()."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        apply_here(f"import of {TRIGGER}", check_env=True)

    def __getattr__(self, name):  # get_resource_reader, is_package, ...: the real loader's
        return getattr(self.loader, name)


def _is_hook(finder) -> bool:
    """A _SoupHook, of this copy of the module or of another (by the class's name)."""
    return type(finder).__name__ == _SoupHook.__name__


def boot() -> None:
    """Called by the .pth line when $SOLUTION_AUTO_APPLY is set: add the import hook (once)."""
    if not any(_is_hook(f) for f in sys.meta_path):
        sys.meta_path.insert(0, _SoupHook())


def _load_solution():
    """The ``solution`` already imported, else ROOT/solution loaded under that name (sys.path untouched)."""
    if "solution" in sys.modules:
        return sys.modules["solution"]
    init = ROOT / "solution" / "__init__.py"
    spec = importlib.util.spec_from_file_location("solution", init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["solution"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["solution"]
        raise
    return module


_APPLIED: list[str] = []


def apply_here(how: str, check_env: bool = False) -> dict[str, str]:
    """solution.apply() here, once (``how``: the trigger, for the line), and a launch count at exit.
    ``check_env``: nothing when $SOLUTION_AUTO_APPLY is off. A bad setting: ``error:``, exit status 2."""
    if _APPLIED:
        return {}
    solution = _load_solution()
    if solution.installed():  # applied already (by the harness itself, or the other way in)
        return {}
    from solution.say import say
    from solution.settings import auto_apply_enabled

    try:
        if check_env and not auto_apply_enabled():
            return {}
        installed = solution.apply()
    except ValueError as exc:  # a bad setting: the user's to fix, before Soup runs
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except Exception as exc:  # noqa: BLE001 - anything else: Soup runs the stock path, and says so
        say(f"apply() failed in process {os.getpid()} ({how}): {type(exc).__name__}: {exc}; stock path kept")
        return {}
    _APPLIED.append(how)
    where = Path(solution.__file__).resolve().parent
    say(f"applied in process {os.getpid()} ({how}; solution from {where}): "
        f"{len(installed)} installed{': ' + ', '.join(installed) if installed else ''}")
    atexit.register(report_launches)
    return installed


def launch_summary() -> str:
    """One line: how many times our kernels launched in this process, and the most launched."""
    from solution.kernels import _launches

    ours = {k: n for k, n in _launches.LAUNCHES.items() if k not in _launches.NOT_OURS and n}
    if not ours:
        return "no kernel of ours launched in this process (training took the stock path, or did not run)"
    top = ", ".join(f"{k} {n}" for k, n in sorted(ours.items(), key=lambda kv: -kv[1])[:4])
    return f"our kernels in this process: {sum(ours.values())} launches of {len(ours)} kernels (most: {top})"


def report_launches() -> None:
    from solution.say import say

    say(launch_summary())


# -- the installer ----------------------------------------------------------------------------------
def default_site() -> Path:
    """This interpreter's site-packages (where pip installs pure-Python packages)."""
    return Path(sysconfig.get_paths()["purelib"])


def install(site: Path) -> Path:
    """Write the .pth into ``site`` (a folder Python scans at start-up); returns its path."""
    path = site / PTH_NAME
    path.write_text(pth_text(), encoding="utf-8")
    return path


def uninstall(site: Path) -> bool:
    """Remove the .pth from ``site``; False when it was not there."""
    path = site / PTH_NAME
    if not path.exists():
        return False
    path.unlink()
    return True


USAGE = "usage: python -m solution.autoapply install|uninstall|status [--site DIR]"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    site = None
    if len(argv) == 3 and argv[1] == "--site":
        site = Path(argv[2]).expanduser().resolve()
        argv = argv[:1]
    if len(argv) != 1 or argv[0] not in ("install", "uninstall", "status"):
        print(f"error: {USAGE}", file=sys.stderr)
        return 2
    site = site or default_site()
    if not site.is_dir():
        print(f"error: --site {site} is not a directory", file=sys.stderr)
        return 2
    command, path = argv[0], site / PTH_NAME
    if command == "status":
        if path.is_file():
            print(f"hook installed: {path} (loads {ROOT / 'solution'}); active in processes started with {ENV}=1")
        else:
            print(f"hook not installed in {site}")
        return 0
    try:
        if command == "install":
            print(f"hook installed: {install(site)}; start Soup with {ENV}=1 to apply the patches in its process")
        else:
            print(f"hook removed: {path}" if uninstall(site) else f"hook was not installed in {site}")
    except OSError as exc:
        print(f"error: cannot write in {site} ({exc.strerror or exc}): run with permission there, or give "
              f"--site DIR, a site-packages folder of the Python that runs Soup", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
