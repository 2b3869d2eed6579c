"""Fused SwiGLU (solution/kernels/swiglu.py) and its Qwen2MLP patch (solution/patches/qwen2_mlp.py).

Tolerances (fp16): the kernel reproduces stock's operations and roundings, so against torch's
``F.silu(g) * u`` the forward is expected bit for bit (table mode guarantees it; compute mode on
the CPU interpreter uses numpy's exp, not CUDA's expf, so a handful of values may land one fp16
ulp away -> checked as "max error <= 1 ulp of the output"). Against an fp64 reference, fp16
results carry the stock roundings: two roundings for h (rel. error <= ~2 * 2^-11 ~ 1e-3 per
element, ~5e-4 in norm) and up to three for dg, so we use rel_err < 2e-3. fp32: a few fp32
roundings -> 1e-6.
"""
import pytest
import torch
import torch.nn.functional as F

import solution.kernels.swiglu as sw
from solution.kernels._launches import LAUNCHES
from tests.conftest import HAS_CUDA, rel_err

FP16_TOL = 2e-3
FP32_TOL = 1e-6


@pytest.fixture(params=["auto", "table", "compute"])
def silu_mode(request, monkeypatch):
    monkeypatch.setattr(sw, "SILU_MODE", request.param)
    return request.param


def _inputs(shape, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g = (torch.randn(shape, generator=gen) * 3).to(dtype).to(device)  # wide range: both silu tails
    u = torch.randn(shape, generator=gen).to(dtype).to(device)
    dh = torch.randn(shape, generator=gen).to(dtype).to(device)
    return g, u, dh


def _reference64(g, u, dh):
    g64, u64, dh64 = (t.detach().double() for t in (g, u, dh))
    s = torch.sigmoid(g64)
    return g64 * s * u64, dh64 * u64 * s * (1 + g64 * (1 - s)), dh64 * g64 * s


def _stock(g, u, dh):
    g, u = g.detach().clone().requires_grad_(), u.detach().clone().requires_grad_()
    h = F.silu(g) * u
    dg, du = torch.autograd.grad(h, (g, u), dh)
    return h.detach(), dg, du


def _ours(g, u, dh, **kw):
    g, u = g.detach().clone().requires_grad_(), u.detach().clone().requires_grad_()
    h = sw.swiglu(g, u, **kw)
    dg, du = torch.autograd.grad(h, (g, u), dh)
    return h.detach(), dg, du


def _max_ulps(out, ref):
    """Largest distance in fp16 ulps (16-bit patterns of finite values of equal sign)."""
    def ordered(t):  # sign-magnitude bit patterns -> integers in value order (+0 == -0)
        b = t.contiguous().view(torch.int16).int()
        return torch.where(b < 0, -(b + 32768), b)
    return int((ordered(out) - ordered(ref)).abs().max()) if out.numel() else 0


@pytest.mark.parametrize("shape", [(37, 300), (3, 5, 129), (1, 1)])
def test_fp16_matches_stock_and_fp64(shape, silu_mode, device):
    g, u, dh = _inputs(shape, torch.float16, device)
    h, dg, du = _ours(g, u, dh)
    hs, dgs, dus = _stock(g, u, dh)
    assert h.dtype == dg.dtype == du.dtype == torch.float16 and h.shape == g.shape
    if silu_mode == "compute":  # forced: bitwise only where the toolchain matches (auto checks)
        assert _max_ulps(h, hs) <= 1 and _max_ulps(du, dus) <= 1
    else:  # table (and auto: table or an exact compute) -> bitwise identical to stock
        assert torch.equal(h, hs) and torch.equal(du, dus)
    # dg: the stock CPU silu_backward may round differently from CUDA's formula -> 1 ulp on CPU.
    assert _max_ulps(dg, dgs) <= (0 if HAS_CUDA else 1)
    ref_h, ref_dg, ref_du = _reference64(g, u, dh)
    assert rel_err(h, ref_h) < FP16_TOL
    assert rel_err(dg, ref_dg) < FP16_TOL
    assert rel_err(du, ref_du) < FP16_TOL


@pytest.mark.parametrize("shape", [(37, 300), (2, 3, 257)])
def test_fp32_matches_stock_and_fp64(shape, device):
    g, u, dh = _inputs(shape, torch.float32, device, seed=1)
    h, dg, du = _ours(g, u, dh)
    hs, dgs, dus = _stock(g, u, dh)
    ref_h, ref_dg, ref_du = _reference64(g, u, dh)
    for out, stock, ref in ((h, hs, ref_h), (dg, dgs, ref_dg), (du, dus, ref_du)):
        assert out.dtype == torch.float32
        assert rel_err(out, stock) < FP32_TOL and rel_err(out, ref) < FP32_TOL


def test_noncontiguous_layouts(device):
    """Row-strided slices (native), transposed (copied), 3-D, and every grad lands in g's shape."""
    big_g, big_u, dh = _inputs((40, 520), torch.float16, device, seed=2)
    g, u = big_g[:, 7:7 + 300], big_u[1:, 100:400]  # row strides 520, unit column stride
    dh = dh[:39, :300].t().contiguous().t()  # column-major gradient
    g = g[:39]
    hs, dgs, dus = _stock(g, u, dh)
    h, dg, du = _ours(g, u, dh)
    assert torch.equal(h, hs) and torch.equal(du, dus) and _max_ulps(dg, dgs) <= (0 if HAS_CUDA else 1)
    # transposed inputs (column stride != 1) go through a contiguous copy
    gt, ut, dht = g.t(), u.t(), dh.t()
    h2, dg2, du2 = _ours(gt, ut, dht)
    assert torch.equal(h2, hs.t()) and torch.equal(dg2, dg.t()) and torch.equal(du2, du.t())
    # an expanded (stride 0) incoming gradient, as from h.sum().backward()
    g3, u3 = g.detach().clone().requires_grad_(), u.detach().clone().requires_grad_()
    sw.swiglu(g3, u3).float().sum().backward()
    g4, u4 = g.detach().clone().requires_grad_(), u.detach().clone().requires_grad_()
    (F.silu(g4) * u4).float().sum().backward()
    assert torch.equal(u3.grad, u4.grad) and _max_ulps(g3.grad, g4.grad) <= (0 if HAS_CUDA else 1)


def test_halves_of_one_tensor(device):
    """g, u = the two halves of one [tokens, 2 * I] tensor (a fused gate/up matmul)."""
    inter = 136
    gu0, _, dh = _inputs((2, 9, 2 * inter), torch.float16, device, seed=3)
    dh = dh[..., :inter]
    hs, dgs, dus = _stock(gu0[..., :inter], gu0[..., inter:], dh)
    for inplace in (False, True):
        # as two strided views through swiglu()
        gu = gu0.clone().requires_grad_()
        gu_t = gu * 1  # non-leaf, so in-place is allowed
        h = sw.swiglu(gu_t[..., :inter], gu_t[..., inter:], inplace_backward=inplace)
        (dgu,) = torch.autograd.grad(h, gu, dh)
        assert torch.equal(h, hs)
        assert torch.equal(dgu[..., inter:], dus) and _max_ulps(dgu[..., :inter], dgs) <= (0 if HAS_CUDA else 1)
        # packed API: one [.., 2I] gradient, no concatenation
        gu_t = gu * 1
        h = sw.swiglu_packed(gu_t, inplace_backward=inplace)
        (dgu2,) = torch.autograd.grad(h, gu, dh)
        assert torch.equal(h, hs) and torch.equal(dgu2, dgu)


def test_inplace_backward_semantics(device):
    g0, u0, dh = _inputs((33, 260), torch.float16, device, seed=4)
    hs, dgs, dus = _ours(g0, u0, dh)
    gl, ul = g0.clone().requires_grad_(), u0.clone().requires_grad_()
    g, u = gl * 1, ul * 1  # non-leaves: their buffers may be reused for dg, du
    h = sw.swiglu(g, u, inplace_backward=True)
    dg, du = torch.autograd.grad(h, (g, u), dh, retain_graph=True)
    assert torch.equal(dg, dgs) and torch.equal(du, dus)
    assert dg.data_ptr() == g.data_ptr() and du.data_ptr() == u.data_ptr()  # really in place
    with pytest.raises(RuntimeError, match="inplace"):  # a second backward must not read grads as g
        torch.autograd.grad(h, (g, u), dh)
    # leaves are never overwritten
    gl2, ul2 = g0.clone().requires_grad_(), u0.clone().requires_grad_()
    h = sw.swiglu(gl2, ul2, inplace_backward=True)
    dg, du = torch.autograd.grad(h, (gl2, ul2), dh)
    assert torch.equal(gl2, g0) and torch.equal(ul2, u0) and torch.equal(dg, dgs)
    # the same tensor as g and u: no in-place (dg and du would collide)
    x = g0.clone().requires_grad_()
    xs = x * 1
    (dx,) = torch.autograd.grad(sw.swiglu(xs, xs, inplace_backward=True), x, dh)
    x2 = g0.clone().requires_grad_()
    (dx_ref,) = torch.autograd.grad(F.silu(x2) * x2, x2, dh)
    assert rel_err(dx, dx_ref) < FP16_TOL


def test_overlap_detection():
    gu = torch.zeros(4, 20)
    assert not sw._overlap(gu[:, :10], gu[:, 10:])
    assert sw._overlap(gu[:, :10], gu[:, 5:15])
    assert sw._overlap(gu, gu)
    assert not sw._overlap(torch.zeros(3), torch.zeros(3))


def test_bump_version_raises_each_counter_by_exactly_one():
    """_bump_version marks each tensor modified once, however many rows it has (a tensor given as a
    list of tensors would be iterated by its first dimension: one bump per row)."""
    a, b = torch.zeros(4096, 8), torch.zeros(3, 2)
    va, vb = a._version, b._version
    sw._bump_version(a, b)
    assert (a._version, b._version) == (va + 1, vb + 1)
    sw._bump_version(a)
    assert (a._version, b._version) == (va + 2, vb + 1)


def test_no_grad_path_and_launch_count(device):
    g, u, _ = _inputs((5, 70), torch.float16, device, seed=5)
    before_f, before_b = LAUNCHES["swiglu_fwd"], LAUNCHES["swiglu_bwd"]
    with torch.no_grad():
        h = sw.swiglu(g, u)
    assert torch.equal(h, F.silu(g) * u)  # auto mode: bitwise
    assert LAUNCHES["swiglu_fwd"] >= before_f + 1 and LAUNCHES["swiglu_bwd"] == before_b


def test_unsupported_inputs_use_stock_expression(device):
    g = torch.randn(4, 8, dtype=torch.float64, device=device)
    u = torch.randn(4, 8, dtype=torch.float64, device=device)
    assert sw.unsupported_reason(g, u) is not None
    assert torch.equal(sw.swiglu(g, u), F.silu(g) * u)
    assert sw.unsupported_reason(g.half(), u.float()) is not None


# ------------------------------------------------------------------------------------------
# The Qwen2MLP patch
# ------------------------------------------------------------------------------------------

def _tiny_mlp(dtype, device, act="silu"):
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

    cfg = Qwen2Config(hidden_size=48, intermediate_size=136, hidden_act=act)
    torch.manual_seed(0)
    return Qwen2MLP(cfg).to(device=device, dtype=dtype)


def _run_mlp(mlp, x, dy):
    x = x.detach().clone().requires_grad_()
    out = mlp(x)
    grads = torch.autograd.grad(out, [x] + [p for p in mlp.parameters()], dy)
    return out.detach(), grads


@pytest.fixture
def only_our_patch(monkeypatch):
    """apply()/revert() with PATCHES limited to this patch; always reverted afterwards."""
    import solution
    import solution._apply as ap

    monkeypatch.setattr(ap, "PATCHES", ["solution.patches.qwen2_mlp"])
    solution.revert()
    yield solution
    solution.revert()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_qwen2_mlp_patch_outputs_and_grads(dtype, only_our_patch, device):
    mlp = _tiny_mlp(dtype, device)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 11, 48, generator=gen).to(device=device, dtype=dtype)
    dy = torch.randn(2, 11, 48, generator=gen).to(device=device, dtype=dtype)
    out_s, grads_s = _run_mlp(mlp, x, dy)
    assert "qwen2_mlp" in only_our_patch.apply(verbose=False)
    before = LAUNCHES["swiglu_bwd"]
    out, grads = _run_mlp(mlp, x, dy)
    assert LAUNCHES["swiglu_bwd"] == before + 1  # our kernel really ran
    only_our_patch.revert()
    if dtype == torch.float16:
        # h is bitwise equal (auto mode), so the output is too; weight grads go through dg, which may
        # be 1 ulp off on the CPU (see the kernel tests) -> fp16 tolerance.
        assert torch.equal(out, out_s)
        tol = 0 if HAS_CUDA else FP16_TOL
    else:
        assert rel_err(out, out_s) < FP32_TOL
        tol = 1e-5  # fp32 matmuls over 136 / 48 terms on top of 1e-6 elementwise differences
    for a, b in zip(grads, grads_s):
        assert a.shape == b.shape and rel_err(a, b) <= tol


def test_qwen2_mlp_fallbacks(only_our_patch, device, monkeypatch):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

    gelu_mlp = _tiny_mlp(torch.float32, device, act="gelu")
    x = torch.randn(3, 48, device=device)
    cpu_mlp = _tiny_mlp(torch.float32, "cpu")
    x_cpu = torch.randn(3, 48)
    only_our_patch.apply(verbose=False)
    assert Qwen2MLP.forward is not Qwen2MLP.forward._solution_stock
    before = LAUNCHES["swiglu_fwd"]
    out_gelu = gelu_mlp(x)  # not silu: the stock forward
    with monkeypatch.context() as m:  # CPU without the interpreter: the stock forward
        m.setenv("TRITON_INTERPRET", "0")
        out_cpu = cpu_mlp(x_cpu)
    assert LAUNCHES["swiglu_fwd"] == before  # no kernel ran
    only_our_patch.revert()
    assert torch.equal(out_gelu, gelu_mlp(x)) and torch.equal(out_cpu, cpu_mlp(x_cpu))


def test_apply_revert_restore_exact_original(only_our_patch):
    from transformers.models.qwen2 import modeling_qwen2

    original = modeling_qwen2.Qwen2MLP.__dict__["forward"]
    installed = only_our_patch.apply(verbose=False)
    assert "qwen2_mlp" in installed
    assert modeling_qwen2.Qwen2MLP.__dict__["forward"] is not original
    assert modeling_qwen2.Qwen2MLP.forward._solution_stock is original
    assert only_our_patch.apply(verbose=False) == installed  # idempotent
    only_our_patch.revert()
    assert modeling_qwen2.Qwen2MLP.__dict__["forward"] is original


# ------------------------------------------------------------------------------------------
# GPU only (run by the lead on the GPU machine)
# ------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_fp16_bitwise_all_inputs():
    """Exhaustive: every fp16 g (65,536 patterns) x random u; forward and du bitwise equal to stock
    in auto mode, and in compute mode report how many differ (0 expected: then no table is used)."""
    x = sw._all_16bit_values(torch.float16, "cuda")
    x = x[torch.isfinite(x)]
    u = torch.randn_like(x)
    dh = torch.randn_like(x)
    hs, dgs, dus = _stock(x, u, dh)
    h, dg, du = _ours(x, u, dh)
    print("silu mode on this GPU:", sw.silu_mode_name(torch.float16, "cuda"))
    assert torch.equal(h, hs) and torch.equal(du, dus)
    assert torch.equal(dg, dgs), f"dg differs at {(dg != dgs).sum().item()} of {dg.numel()} (max {_max_ulps(dg, dgs)} ulp)"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [2048, 1500])
def test_gpu_fp16_bitwise_model_shape(tokens):
    g, u, dh = _inputs((tokens, 8960), torch.float16, "cuda", seed=7)
    hs, dgs, dus = _stock(g, u, dh)
    for inplace in (False, True):
        gl, ul = g.clone().requires_grad_(), u.clone().requires_grad_()
        gn, un = gl * 1, ul * 1
        h = sw.swiglu(gn, un, inplace_backward=inplace)
        dg, du = torch.autograd.grad(h, (gn, un), dh)
        assert torch.equal(h, hs) and torch.equal(du, dus) and torch.equal(dg, dgs)


@pytest.mark.gpu
def test_gpu_qwen2_mlp_autocast(only_our_patch):
    mlp = _tiny_mlp(torch.float32, "cuda")
    x = torch.randn(4, 33, 48, device="cuda")
    dy = torch.randn(4, 33, 48, device="cuda", dtype=torch.float16)
    with torch.autocast("cuda", dtype=torch.float16):
        out_s, grads_s = _run_mlp(mlp, x, dy)
    only_our_patch.apply(verbose=False)
    with torch.autocast("cuda", dtype=torch.float16):
        out, grads = _run_mlp(mlp, x, dy)
    only_our_patch.revert()
    assert torch.equal(out, out_s)
    for a, b in zip(grads, grads_s):
        assert torch.equal(a, b)
