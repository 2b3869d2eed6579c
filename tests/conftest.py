"""Test setup shared by every test.

Without CUDA, Triton kernels run through Triton's CPU interpreter: TRITON_INTERPRET=1 must be
set before triton is first imported, which is why it happens here, at collection time.
GPU-only tests carry @pytest.mark.gpu and skip cleanly without CUDA.
"""
import os

import pytest

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (runs in full on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


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

