"""Test setup shared by every test.

Without CUDA, Triton kernels run through Triton's CPU interpreter: TRITON_INTERPRET=1 must be
set before triton is first imported, which is why it happens here, at collection time.
GPU-only tests carry @pytest.mark.gpu and skip cleanly without CUDA.
At the end of a run the terminal summary lists the skipped tests grouped by reason, with counts
(pytest_terminal_summary), so that a CPU run says why its GPU tests did not run.
"""
import collections
import os
import re

import pytest

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


GPU_REASON = "needs a CUDA GPU (runs in full on the GPU machine)"
# A test's own skip reason that means the same as GPU_REASON ("needs CUDA", "bitsandbytes 4-bit
# needs CUDA", "native_dropout is the CUDA path"); "needs two CUDA GPUs" keeps its own line.
_NEEDS_CUDA = re.compile(r"needs (a )?CUDA(?! GPUs)|\bthe CUDA path\b")
_NOT_INSTALLED = re.compile(r"could not import '([^']+)'")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason=GPU_REASON)
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


def skip_reason(report) -> str:
    """A skipped test's reason in the summary's words: every "needs CUDA" reason as GPU_REASON, a
    missing module (pytest.importorskip) as "needs MODULE, not installed here", any other as the
    test gives it."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    reason = reason.removeprefix("Skipped: ").strip()
    if _NEEDS_CUDA.search(reason):
        return GPU_REASON
    missing = _NOT_INSTALLED.search(reason)
    if missing:
        return f"needs {missing.group(1)}, not installed here"
    return reason


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """After the run: the skipped tests grouped by reason, most first, one line each (a skip is
    not a failure; the line says why the test did not run here)."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if getattr(r, "skipped", False)]
    if not skipped:
        return
    counts = collections.Counter(skip_reason(r) for r in skipped)
    tests = "test" if len(skipped) == 1 else "tests"
    terminalreporter.write_sep("-", f"{len(skipped)} {tests} skipped (not failures), by reason")
    for reason, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        terminalreporter.write_line(f"{n:5d}  {reason}")


@pytest.fixture
def autocast_ctx(monkeypatch, device):
    """A factory of torch.autocast(fp16) contexts on the test device, with peft's
    torch.is_autocast_enabled() (no argument: the CUDA autocast) answering for that device, so that
    on the CPU peft sees the autocast it would see on the GPU."""
    if device == "cpu":
        original = torch.is_autocast_enabled

        def is_autocast_enabled(device_type=None):
            return original("cpu" if device_type is None else device_type)

        monkeypatch.setattr(torch, "is_autocast_enabled", is_autocast_enabled)
    return lambda: torch.autocast(device_type=device, dtype=torch.float16)


@pytest.fixture
def device():
    """Where kernel tests run: the GPU when there is one, else the CPU interpreter."""
    return "cuda" if HAS_CUDA else "cpu"


def pythonpath_without_repo(*first: str) -> str:
    """$PYTHONPATH for a child process: ``first``, then this process's entries other than the
    repository (site folders it needs, e.g. the GPU machine's wheels in /tmp/site), never the
    repository itself."""
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    keep = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and Path(p).resolve() != repo]
    return os.pathsep.join([*first, *keep])


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN-safe: NaN anywhere gives inf)."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(out64).all():
        return float("inf")
    denom = ref64.norm().item()
    return (out64 - ref64).norm().item() / (denom if denom > 0 else 1.0)


def cast_launches() -> int:
    """Launches that cast activations / gradients to fp16 next to a dequantization: the fused
    nf4_dequant_cast kernel."""
    from solution.kernels import _launches

    return _launches.LAUNCHES["nf4_dequant_cast"]


def dequant_launches() -> int:
    """Launches that dequantize an NF4 weight (alone or fused with casts)."""
    from solution.kernels import _launches

    return _launches.LAUNCHES["nf4_dequant"] + _launches.LAUNCHES["nf4_dequant_cast"]


def tiny_padded_batch(seed: int, device):
    """(input_ids, attention_mask, labels) for the tiny Qwen2 models' tests: 2 rows of 9 tokens
    (vocab 128), the second right-padded after 6 as trl's collator does, loss on positions 3+."""
    torch.manual_seed(seed)
    input_ids = torch.randint(0, 128, (2, 9))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 6:] = 0
    labels = input_ids.clone()
    labels[:, :3] = -100
    labels[1, 6:] = -100
    return tuple(t.to(device) for t in (input_ids, attention_mask, labels))

