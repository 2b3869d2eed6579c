"""solution/kernels/_launches.py: the launch wrapper, its counter, cdiv and pow2_at_least."""
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


class _FakeKernel:
    """Stands for a JITFunction: ``kernel[grid]`` returns a launcher that records its call."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


def test_launch_is_kernel_grid_with_the_same_arguments():
    """launch(kernel, grid, name, *args, **kwargs) counts under name, then calls
    kernel[grid](*args, **kwargs) once, with the grid and arguments unchanged."""
    _launches.reset()
    k = _FakeKernel()
    grid_fn = lambda meta: (3,)  # noqa: E731  (a callable grid passes through as well)
    _launches.launch(k, (5, 2), "fake", "X", 32, 1.5, BLOCK=8, num_warps=4, enable_fp_fusion=False)
    _launches.launch(k, grid_fn, "fake", "Y")
    assert k.calls == [((5, 2), ("X", 32, 1.5), {"BLOCK": 8, "num_warps": 4, "enable_fp_fusion": False}),
                       (grid_fn, ("Y",), {})]
    assert _launches.LAUNCHES["fake"] == 2 and "fake" not in _launches.NOT_OURS
    _launches.reset()
    assert sum(_launches.LAUNCHES.values()) == 0


def test_pow2_at_least():
    assert [_launches.pow2_at_least(n) for n in (-3, 0, 1, 2, 3, 4, 5, 1000, 1024, 1025)] == \
        [1, 1, 1, 2, 4, 4, 8, 1024, 1024, 2048]
    for n in range(1, 300):
        assert _launches.pow2_at_least(n) == triton.next_power_of_2(n)
