"""Self-check: does this environment accept our kernels, do they run here and compute the right numbers, and
do the patches install and come out again? Run ``python -m solution.selfcheck`` where the training will run.

One line per check (OK, FAIL or SKIP; Russian and English), then a summary, failed checks first. Exit status:
0 no FAIL, 1 a check failed, 2 a bad command line. Without a CUDA GPU the kernels run in Triton's CPU
interpreter and the skipped GPU checks are named. The checks, in order: 1. versions: Python, torch, Triton,
and each library through the ``check()`` of every patch that depends on it ("accepted": the patch installs);
2. the device (env.check_support); 3. every kernel module at small odd shapes: it must launch, and forward and
backward must match a float64 reference (solution/_references.py) within its limit on ||ours - ref|| / ||ref||
(selfcheck_kernels.KERNELS), exact operations bit for bit; 4. ``solution.apply()`` installs every patch and
``solution.revert()`` puts every replaced object back. Nothing trains, writes files or outlives the process.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.metadata as md
import io
import sys
from collections.abc import Callable

from solution.selfcheck_kernels import KERNELS

PYTHON_RANGE = ((3, 11), (3, 14))  # Soup 0.77.0 needs < 3.14; the CPU suite passed on 3.11 and 3.13
OLDEST_TORCH = (2, 6)  # the torch that brings Triton 3.2 (solution/env.py's OLDEST_TRITON)


# (distribution, module that gives __version__, patch modules whose check() decides); every patch is listed
LIBRARIES = (
    ("transformers", "transformers", ("qwen2_layer_node", "qwen2_unpad", "trainer_lengths", "trainer_flops",
                                      "trainer_clip")),
    ("peft", "peft", ("qwen2_layer_node", "peft_model_walks")),
    ("bitsandbytes", "bitsandbytes", ("qwen2_layer_node",)),
    ("trl", "trl", ("qwen2_lm_head_loss",)),
)


@dataclasses.dataclass
class Line:
    status: str  # "OK", "FAIL" or "SKIP"
    subject: str
    ru: str
    en: str
    figures: str = ""  # measured values, language-neutral, after both texts
    detail: str = ""  # what the check printed, shown under a failed line

    def text(self) -> str:
        return f"{self.status:<4} {self.subject}: {self.ru} / {self.en}" + (f": {self.figures}" if self.figures else "")


def _version(dist: str, module: str | None = None) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        pass
    try:
        return getattr(importlib.import_module(module or dist), "__version__", None)
    except Exception:  # noqa: BLE001 - not installed or broken: the caller says so
        return None


def _numbers(version: str) -> tuple[int, ...]:
    out = []
    for part in version.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


# -- 1. versions -----------------------------------------------------------------------------------
def _accepted(subject: str, limit: str, reason: str | None) -> Line:
    """OK when ``reason`` is None, else FAIL saying what is needed and why."""
    if reason is None:
        return Line("OK", subject, "принят", f"accepted ({limit})")
    return Line("FAIL", subject, f"нужен {limit}", reason)


def check_python() -> Line:
    (lo, hi), version = PYTHON_RANGE, ".".join(map(str, sys.version_info[:3]))
    limit = f"{lo[0]}.{lo[1]} <= Python < {hi[0]}.{hi[1]}"
    return _accepted(f"Python {version}", limit,
                     None if lo <= sys.version_info[:2] < hi else f"needs {limit} (Soup 0.77.0's range)")


def check_torch() -> Line:
    version = _version("torch")
    if version is None:
        return Line("FAIL", "torch", "не установлен", "not installed")
    limit = f">= {OLDEST_TORCH[0]}.{OLDEST_TORCH[1]}"
    return _accepted(f"torch {version}", limit, None if _numbers(version) >= OLDEST_TORCH else f"needs {limit}")


def check_triton() -> Line:
    from solution.env import OLDEST_TRITON, triton_too_old

    version = _version("triton")
    if version is None:
        return Line("FAIL", "Triton", "не установлен: ядра не запустятся", "not installed: no kernel can run")
    return _accepted(f"Triton {version}", f">= {OLDEST_TRITON[0]}.{OLDEST_TRITON[1]}", triton_too_old(version))


def check_library(dist: str, module: str, patches: tuple[str, ...]) -> Line:
    """The installed ``dist`` through the check() of every patch module in ``patches`` (named by NAME)."""
    version = _version(dist, module)
    subject = f"{dist} {version}" if version else dist
    reasons, names = [], []
    for module_name in patches:
        patch = importlib.import_module(f"solution.patches.{module_name}")
        names.append(patch.NAME)
        reason = patch.check()
        if reason is not None:
            reasons.append(f"{patch.NAME}: {reason}")
    if version is None:
        return Line("FAIL", subject, "не установлен", "not installed")
    if reasons:
        return Line("FAIL", subject, "не принят, эти патчи не встанут (сток останется)",
                    "not accepted, these patches would be skipped: " + "; ".join(reasons))
    return Line("OK", subject, "принят патчами", f"accepted by the patches {', '.join(names)}")


# -- 2. the device ---------------------------------------------------------------------------------
# What a run without the GPU leaves unchecked (the GPU line and the summary say it).
GPU_CHECKS_RU = ("ядра, собранные и запущенные на GPU, ядро внимания только для CUDA, "
                 "настройка памяти CUDA (cuda_allocator)")
GPU_CHECKS_EN = ("the kernels compiled and run on the GPU, the CUDA-only attention kernel, "
                 "the CUDA memory allocator setting (cuda_allocator)")


def interpret_without_gpu() -> bool:
    """Without a CUDA GPU, turn Triton's CPU interpreter on (settings.use_interpreter) before any kernel
    module is imported. True when it did; False with a GPU, the interpreter already on, no PyTorch, or a
    kernel module already imported (too late: check_device says why nothing runs)."""
    from solution.settings import interpreter_enabled, use_interpreter

    try:
        import torch
    except ImportError:
        return False
    if torch.cuda.is_available() or interpreter_enabled():
        return False
    if any(name.startswith("solution.kernels.") and not name.rsplit(".", 1)[1].startswith("_")
           for name in sys.modules):
        return False
    use_interpreter()
    return True


def no_gpu_reason() -> tuple[str, str]:
    """(Russian, English) why the kernels run in Triton's CPU interpreter here, not on a GPU."""
    import torch

    if torch.cuda.is_available():
        return ("задан TRITON_INTERPRET=1: ядра идут в интерпретаторе Triton на CPU, не на GPU",
                "TRITON_INTERPRET=1 is set: the kernels run in Triton's CPU interpreter, not on the GPU")
    if torch.version.cuda is None:
        return (f"на этой машине нет CUDA GPU (PyTorch {torch.__version__} собран без CUDA)",
                f"no CUDA GPU on this machine (PyTorch {torch.__version__} is built without CUDA)")
    return ("на этой машине нет CUDA GPU (PyTorch не видит GPU или его драйвер)",
            "no CUDA GPU on this machine (PyTorch sees no GPU or no GPU driver)")


def check_device() -> tuple[list[Line], str | None]:
    """(lines, "cuda" / "cpu" where the kernel checks run, or None). On the CPU interpreter: a SKIP line for
    the GPU (why, what it leaves out), then the CPU's OK line."""
    from solution.env import check_support

    support = check_support()
    if not support.ok:
        return [Line("FAIL", "GPU", "ядра здесь не запустятся", support.reason)], None
    if support.device == "interpreter":
        ru, en = no_gpu_reason()
        return [Line("SKIP", "GPU", f"{ru}; проверки на GPU пропущены: {GPU_CHECKS_RU}",
                     f"{en}; the GPU checks are skipped: {GPU_CHECKS_EN}"),
                Line("OK", "CPU", "ядра проверяются в интерпретаторе Triton на CPU (числа, не скорость)",
                     "the kernels are checked in Triton's CPU interpreter instead (their numbers, not their "
                     "speed)")], "cpu"
    import torch

    major, minor = torch.cuda.get_device_capability()
    return [Line("OK", f"GPU {torch.cuda.get_device_name()} (sm_{major}{minor})", "принята",
                 "accepted (sm_75 or newer)")], "cuda"


# -- 3. the kernels (their checks: solution/selfcheck_kernels.py) ----------------------------------
def check_kernel(name: str, fn: Callable, needs_cuda: bool, limit: float, device: str | None) -> Line:
    subject = f"kernel {name}"
    if device is None:
        return Line("SKIP", subject, "устройство не принято (строка GPU выше)", "no accepted device (GPU line above)")
    if needs_cuda and device != "cuda":
        return Line("SKIP", subject, "проверка на GPU: ядро внимания PyTorch для строк разной длины есть только "
                    "на CUDA", "a GPU check: PyTorch's attention kernel for rows of different lengths exists only "
                    "on CUDA (on the CPU, attention runs row by row through PyTorch's standard attention)")
    from solution.kernels import _launches

    _launches.reset()
    errs, expected = fn(device)
    missing = [k for k in expected if _launches.LAUNCHES[k] == 0]
    exact = "wrong values" in errs
    if exact:
        figures = f"{int(errs['wrong values'])} wrong values (bit-exact required)"
        bad = errs["wrong values"] != 0
    else:
        figures = ", ".join(f"{k} {e:.1e}" for k, e in errs.items()) + f" (limit {limit:.1e})"
        bad = not all(e <= limit for e in errs.values())
    subject = f"{subject} ({device})"
    if missing:
        return Line("FAIL", subject, "ядро не запускалось", f"did not launch: {', '.join(missing)}")
    if bad:
        return Line("FAIL", subject, "не совпадает с эталоном", "does not match its reference", figures)
    return Line("OK", subject, "работает, совпадает с эталоном", "runs, matches its reference", figures)


# -- 4. the patches --------------------------------------------------------------------------------
def check_patches(device: str | None) -> Line:
    """apply() installs every patch; revert() puts every replaced object back (by identity)."""
    if device is None:
        return Line("SKIP", "patches", "устройство не принято: apply() ничего не ставит",
                    "no accepted device: apply() installs nothing")
    import solution
    from solution import _apply
    from solution.patches._base import _MISSING

    settings = dataclasses.replace(_apply.check_settings(), precompile=False)
    installed = solution.apply(settings=settings)
    swapped = list(_apply._swaps._log)
    skipped = [n for n in _apply.patch_names() if n not in installed and n != _apply.ALLOCATOR
               and n not in settings.skip_patches]
    solution.revert()

    def current(owner, name):
        return owner.__dict__.get(name, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, name, _MISSING)

    not_back = [f"{getattr(o, '__name__', type(o).__name__)}.{n}" for o, n, orig in swapped if current(o, n) is not orig]
    if not installed or skipped:
        return Line("FAIL", "patches", "не все патчи встали (причины — в строках [solution] ниже)",
                    f"not every patch installed; skipped: {', '.join(skipped) or 'all'}")
    if not_back or solution.installed():
        return Line("FAIL", "patches", "revert() не вернул стоковые объекты",
                    f"revert() left replaced objects: {', '.join(not_back) or 'installed() not empty'}")
    return Line("OK", "patches", f"{len(installed)} установлены и сняты, {len(swapped)} стоковых объектов на месте",
                f"{len(installed)} installed and reverted, all {len(swapped)} replaced objects back in place")


# --------------------------------------------------------------------------------------------------
def _run(subject: str, check: Callable, *args):
    """``check(*args)``'s result (a Line, or a tuple starting with a Line or a list of them), with what it
    printed kept in its first line's ``detail`` (shown under a failed line); an exception: a FAIL line."""
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            result = check(*args)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        result = Line("FAIL", subject, "ошибка при проверке", f"{type(exc).__name__}: {first}")
    line = result[0] if isinstance(result, tuple) else result
    line = line[0] if isinstance(line, list) else line
    line.detail = buf.getvalue().strip()
    return result


def run_all(emit: Callable[[str], None] = print) -> list[Line]:
    """Every check in order, each line emitted as soon as it is known; returns the lines."""
    lines = []

    def record(line: Line) -> None:
        lines.append(line)
        emit(line.text())
        if line.status == "FAIL" and line.detail:
            for extra in line.detail.splitlines()[-5:]:
                emit(f"       {extra}")

    for subject, check in (("Python", check_python), ("torch", check_torch), ("Triton", check_triton)):
        record(_run(subject, check))
    for dist, module, patches in LIBRARIES:
        record(_run(dist, check_library, dist, module, patches))
    result = _run("GPU", check_device)
    device_lines, device = result if isinstance(result, tuple) else ([result], None)
    for line in device_lines:
        record(line)
    for name, fn, needs_cuda, limit, _why in KERNELS:
        record(_run(f"kernel {name}", check_kernel, name, fn, needs_cuda, limit, device))
    record(_run("patches", check_patches, device))
    return lines


def summary(lines: list[Line]) -> list[str]:
    """Failed lines first, then (GPU checks skipped) where to run them, then the count."""
    failed = [l for l in lines if l.status == "FAIL"]
    ok = sum(l.status == "OK" for l in lines)
    skipped = sum(l.status == "SKIP" for l in lines)
    out = [l.text() for l in failed]
    if any(l.status == "SKIP" and l.subject == "GPU" for l in lines):
        out.append("Проверки на GPU пропущены: ядра проверены только в интерпретаторе Triton на CPU; запустите "
                   "python -m solution.selfcheck на машине с GPU, где пойдёт обучение / The GPU checks were "
                   "skipped: the kernels were checked only in Triton's CPU interpreter; run python -m "
                   "solution.selfcheck on the GPU machine where the training will run")
    if failed:
        out.append(f"ИТОГ / SUMMARY: {len(failed)} из {len(lines)} проверок не прошли / {len(failed)} of "
                   f"{len(lines)} checks failed ({ok} OK, {skipped} SKIP)")
    else:
        out.append(f"ИТОГ / SUMMARY: все проверки пройдены / every check passed ({ok} OK, {skipped} SKIP)")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv:
        print(f"error: python -m solution.selfcheck takes no arguments, got {' '.join(argv)!r}", file=sys.stderr)
        return 2
    interpret_without_gpu()  # no CUDA GPU: the kernels run in Triton's CPU interpreter
    lines = run_all()
    print("-" * 80)
    for text in summary(lines):
        print(text)
    return 1 if any(l.status == "FAIL" for l in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
