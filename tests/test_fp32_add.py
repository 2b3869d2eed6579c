"""fp32 sums of fp16 / fp32 tensors (solution/kernels/fp32_add.py) and where they are used: the
fused NF4 MLP's backward and the decoder layer's residual add.
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


def test_residual_add_values_and_gradients(device):
    g = torch.Generator().manual_seed(0)
    res = torch.randn(3, 5, 64, generator=g).to(device).requires_grad_()
    y = torch.randn(3, 5, 64, generator=g).half().to(device).requires_grad_()
    dout = torch.randn(3, 5, 64, generator=g).to(device)
    out = fp32_add.residual_add(res, y)
    gr, gy = torch.autograd.grad(out, (res, y), dout)
    res2, y2 = res.detach().clone().requires_grad_(), y.detach().clone().requires_grad_()
    ref = res2 + y2
    rr, ry = torch.autograd.grad(ref, (res2, y2), dout)
    assert torch.equal(out, ref) and torch.equal(gr, rr) and torch.equal(gy, ry) and gy.dtype == torch.float16


def test_unsupported_inputs_use_torch(device):
    a = torch.randn(4, 6, device=device)
    b = torch.randn(4, 6, device=device).half().t().contiguous().t()  # non-contiguous
    before = _launches.LAUNCHES["fp32_add_kernel"]
    assert torch.equal(fp32_add.add_as_fp32(a, b), a + b.float())
    assert _launches.LAUNCHES["fp32_add_kernel"] == before


def test_fused_mlp_backward_uses_it(device, monkeypatch):
    """The fused NF4 MLP's backward sums its two input gradients with the kernel, and the bits are
    those of torch's cast and add (the same backward with fp32_add.add_as_fp32 replaced by torch)."""
    from solution.kernels import nf4_mlp
    from solution.patches._bnb import linear_plan
    from tests.test_nf4_mlp import inputs, nf4_mlp_module

    mlp = nf4_mlp_module(device)
    x, dy = inputs(device)
    plans = [linear_plan(m) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
    grads = {}
    for ours in (True, False):
        if not ours:
            monkeypatch.setattr(fp32_add, "add_as_fp32", lambda a, b: a.to(torch.float32) + b)
        xr = x.detach().clone().requires_grad_()
        y = nf4_mlp.nf4_mlp(xr, *plans, policy="speed")
        before = _launches.LAUNCHES["fp32_add_kernel"]
        (grads[ours],) = torch.autograd.grad(y, xr, dy.half())
        assert (_launches.LAUNCHES["fp32_add_kernel"] > before) == ours
    assert torch.equal(grads[True], grads[False])


def test_decoder_layer_residual_add_with_nf4_mlp(device, monkeypatch):
    """A Qwen2 decoder layer whose MLP is bnb NF4 (fused path: fp16 MLP output) under fp16
    autocast, with the bnb / MLP / decoder-layer patches: the add kernel changes no bit of the
    output, the input gradient or any parameter gradient. Attention runs on SDPA's math backend:
    the memory-efficient kernel's backward is not bitwise reproducible run to run on a GPU (the
    first GPU run of this test failed on that, not on the add), and bit equality is the claim.
    The MLP's backward adds its two input gradients with the kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import solution
    from tests.test_add_rmsnorm import _apply_only, _layer_and_inputs, _layer_run
    from tests.test_nf4_linear import bnb_dequant_rows, make_linear4bit

    n = max(11, bnb_dequant_rows(device))
    layer, hidden, pos_emb = _layer_and_inputs(device, n=n)
    h, i = layer.mlp.hidden_size, layer.mlp.intermediate_size
    layer.mlp.gate_proj = make_linear4bit(h, i, bias=False, device=device, seed=1)
    layer.mlp.up_proj = make_linear4bit(h, i, bias=False, device=device, seed=2)
    layer.mlp.down_proj = make_linear4bit(i, h, bias=False, device=device, seed=3)
    runs = {}
    try:
        for flag in ("1", "0"):
            if flag == "0":  # the reference: torch's promoted adds where the kernel runs
                monkeypatch.setattr(fp32_add, "add_as_fp32", lambda a, b: a.to(torch.float32) + b)
                monkeypatch.setattr(fp32_add, "residual_add", lambda r, y: r + y)
            _apply_only(monkeypatch, ["bnb_linear4bit", "qwen2_mlp", "qwen2_decoder_layer"])
            _launches.reset()
            with sdpa_kernel(SDPBackend.MATH):
                runs[flag] = _layer_run(layer, hidden, pos_emb, autocast=True)
            assert (_launches.LAUNCHES["fp32_add_kernel"] == 2) == (flag == "1")  # residual + MLP backward
            assert _launches.LAUNCHES["swiglu_bwd"] == 1
    finally:
        solution.revert()
    (out0, dx0, g0), (out1, dx1, g1) = runs["0"], runs["1"]
    assert out1.dtype == torch.float32 and torch.equal(out0, out1) and torch.equal(dx0, dx1)
    assert g0.keys() == g1.keys() and all(torch.equal(g0[k], g1[k]) for k in g0)

