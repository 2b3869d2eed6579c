"""solution/kernels/_launches.py: the launch wrapper, its counter and cdiv."""
import torch
import triton
import triton.language as tl

from solution.kernels import _launches


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr, ADD: tl.constexpr = True):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=m, other=0.0).to(tl.float32)
    r = x * alpha + y if ADD else x * alpha - y
    tl.store(out_ptr + offs, r.to(out_ptr.dtype.element_ty), mask=m)


def test_counter_and_cdiv():
    _launches.reset()
    _launches.record("k")
    _launches.record("k")
    assert _launches.LAUNCHES["k"] == 2
    assert [_launches.cdiv(a, 16) for a in (0, 1, 16, 17)] == [0, 1, 1, 2]


def test_launch_runs_and_counts(device):
    _launches.reset()
    x = torch.randn(1000, device=device)
    y = torch.randn(1000, device=device)
    out = torch.empty_like(x)
    _launches.launch(_axpy_kernel, (_launches.cdiv(1000, 256),), "axpy", x, y, out, 1000, 2.0, BLOCK=256)
    torch.testing.assert_close(out, x * 2.0 + y)
    assert _launches.LAUNCHES["axpy"] == 1


def test_records_of_other_kernels_are_marked_not_ours():
    _launches.reset()
    _launches.record("torch_kernel_counted_for_a_test", ours=False)
    _launches.record("ours")
    assert _launches.LAUNCHES["torch_kernel_counted_for_a_test"] == 1
    assert "torch_kernel_counted_for_a_test" in _launches.NOT_OURS and "ours" not in _launches.NOT_OURS
