"""fp32 sums of fp16 / fp32 tensors (solution/kernels/fp32_add.py) and where they are used: the
fused NF4 MLP's backward (the decoder-layer node's residual add is the same call).
An fp32 addition of the same two values is exact to compare: bit for bit against torch."""
import pytest
import torch

from solution.kernels import _launches, fp32_add


@pytest.mark.parametrize("dtypes", [(torch.float16, torch.float16), (torch.float32, torch.float16),
                                    (torch.float32, torch.float32)])
@pytest.mark.parametrize("n", [1, 1000, 70001])
def test_add_as_fp32_is_torchs_promoted_add(dtypes, n, device):
    g = torch.Generator().manual_seed(n)
    a = (torch.randn(n, generator=g) * 100).to(device=device, dtype=dtypes[0])
    b = torch.randn(n, generator=g).to(device=device, dtype=dtypes[1])
    before = _launches.LAUNCHES["fp32_add_kernel"]
    out = fp32_add.add_as_fp32(a, b)
    assert _launches.LAUNCHES["fp32_add_kernel"] == before + 1
    assert out.dtype == torch.float32 and torch.equal(out, a.float() + b.float())


def test_unsupported_inputs_use_torch(device):
    a = torch.randn(4, 6, device=device)
    b = torch.randn(4, 6, device=device).half().t().contiguous().t()  # non-contiguous
    before = _launches.LAUNCHES["fp32_add_kernel"]
    assert torch.equal(fp32_add.add_as_fp32(a, b), a + b.float())
    assert _launches.LAUNCHES["fp32_add_kernel"] == before


def test_fused_mlp_backward_uses_it(device, monkeypatch):
    """The fused NF4 MLP's backward sums its two input gradients with the kernel, and the bits are
    those of torch's cast and add (the same backward with fp32_add.add_as_fp32 replaced by torch)."""
    from solution.patches._bnb import linear_plan
    from tests.test_nf4_mlp import inputs, nf4_mlp_autograd, nf4_mlp_module

    mlp = nf4_mlp_module(device)
    x, dy = inputs(device)
    plans = [linear_plan(m) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
    grads = {}
    for ours in (True, False):
        if not ours:
            monkeypatch.setattr(fp32_add, "add_as_fp32", lambda a, b: a.to(torch.float32) + b)
        xr = x.detach().clone().requires_grad_()
        y = nf4_mlp_autograd(xr, *plans, policy="speed")
        before = _launches.LAUNCHES["fp32_add_kernel"]
        (grads[ours],) = torch.autograd.grad(y, xr, dy.half())
        assert (_launches.LAUNCHES["fp32_add_kernel"] > before) == ours
    assert torch.equal(grads[True], grads[False])
