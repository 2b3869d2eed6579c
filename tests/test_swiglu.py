"""SwiGLU of the fused NF4 MLP (solution/kernels/swiglu.py): its two launchers,
``swiglu_fp16_of_fp32(g16, u16)`` and ``swiglu_backward_fp16_of_fp32(dh16, g16, u16, dg_out, du_out)``.

What they are anchored to:
1. Stock's computation. Stock Qwen2MLP holds g and u as fp32 tensors (copies of fp16 GEMM outputs)
   and computes ``F.silu(g) * u`` in fp32; the down projection casts h to fp16, and the gate / up
   projections' backward cast autograd's fp32 dg / du to fp16. So the reference here is
   ``(F.silu(g16.float()) * u16.float()).half()`` and autograd's gradients of that fp32 expression
   for the incoming gradient ``dh16.float()``, each ``.half()`` (``_stock``), run by torch on the
   test device.
2. The exact values: the same expression in fp64 (``_exact64``).

Tolerances and why:
- Against stock on the GPU: bit for bit (``STOCK_ULPS = 0``, and ``torch.equal`` in the GPU-only
  tests). swiglu.py computes torch's fp32 operations in torch's order with the same math library
  (libdevice ``expf``, IEEE ``div_rn``, the fma nvcc contracts in ``1 + g * (1 - s)``), then rounds
  once to fp16, as stock's cast does.
- Against stock on the CPU (Triton's interpreter): at most 1 fp16 ulp (``STOCK_ULPS = 1``).
  libdevice does not exist there; ``tl.exp`` runs numpy's expf while torch's CPU silu runs its own
  vectorized expf (Sleef). Both are within about 1 fp32 ulp of exp, so the two fp32 results differ
  by a few fp32 ulps (relative ~2^-21), far less than an fp16 ulp (2^-10 relative): rounding two
  such values to fp16 gives the same value or neighbours. (The interpreter's ``tl.fma`` is
  ``x * y + z`` with two roundings, as torch's CPU kernel computes it.) Every fp16 gate value is
  checked (``test_every_fp16_gate_value``); measured here: 0 ulps for h, 1 for dg and du at 1-2 of
  65,536 values.
- Against fp64, elementwise (``_assert_within_fp64_bound``): |out - exact| <= 2^-11 |exact| +
  2^-25 (the one fp16 rounding: half an ulp, relative for normal values, absolute in the subnormal
  range) + the fp32 error. With u = 2^-24 (fp32 unit roundoff) and expf within 2 ulps (4u,
  libdevice's bound; numpy's is tighter): silu(g) = g / (1 + e) is within ~6u relative, h and du
  (one more product) within ~7u: bounded by 2^-20 |exact|. dg = A * B with A = dh * u * s (~8u
  relative) and B = 1 + g * (1 - s), which cancels near g = -1.278 (silu's minimum): B's absolute
  error is ~8u |g| + u |B|, so dg's is below 2^-20 |A| (|B| + |g|).

Layouts covered: odd shapes, a row count that is not a multiple of the row tile (8 rows on the GPU,
256 in the interpreter), row-strided views (column slices of wider tensors, and the two halves of
one [T, 2I] tensor as a fused gate/up GEMM would produce; nf4_mlp.py itself passes separate
contiguous [T, 8960] tensors), strided outputs, and the in-place backward nf4_mlp.py makes
(dg_out is g16, du_out is u16). The model shape (tokens x 8960) runs on the GPU only.
"""
import pytest
import torch
import torch.nn.functional as F

from solution.kernels import swiglu as sw
from solution.kernels._launches import LAUNCHES
from tests.conftest import HAS_CUDA

STOCK_ULPS = 0 if HAS_CUDA else 1  # see the module docstring
MODEL_WIDTH = 8960  # Qwen2.5-1.5B's intermediate size
FP16_OVERFLOW = 65520.0  # the smallest magnitude that rounds to inf in fp16 (65504 + half an ulp)


def _inputs(rows, cols, device, seed):
    """fp16 g (randn * 3: both tails of silu and its minimum), u, dh, as fp16 GEMM outputs."""
    gen = torch.Generator().manual_seed(seed)
    g = (torch.randn(rows, cols, generator=gen) * 3).half()
    u = torch.randn(rows, cols, generator=gen).half()
    dh = torch.randn(rows, cols, generator=gen).half()
    return g.to(device), u.to(device), dh.to(device)


def _stock(g16, u16, dh16):
    """Stock Qwen2MLP's values: fp32 silu(g) * u and its autograd backward, each cast to fp16."""
    g32 = g16.float().requires_grad_()
    u32 = u16.float().requires_grad_()
    h32 = F.silu(g32) * u32
    dg32, du32 = torch.autograd.grad(h32, (g32, u32), dh16.float())
    return h32.detach().half(), dg32.half(), du32.half()


def _ours(g16, u16, dh16):
    """h, dg, du from the two launchers (backward out of place, into fresh NaN-filled tensors)."""
    h = sw.swiglu_fp16_of_fp32(g16, u16)
    dg = torch.full_like(g16, float("nan"))
    du = torch.full_like(u16, float("nan"))
    sw.swiglu_backward_fp16_of_fp32(dh16, g16, u16, dg, du)
    return h, dg, du


def _exact64(g16, u16, dh16):
    """fp64 values of h, dg, du and of dg's factors A = dh * u * s and B = 1 + g (1 - s)."""
    g, u, dh = (t.detach().double().cpu() for t in (g16, u16, dh16))
    s = torch.sigmoid(g)
    a = dh * u * s
    b = 1 + g * (1 - s)
    return g * s * u, a * b, dh * g * s, a, b


def _ordered(t):
    """fp16 bit patterns as integers in value order (+0 and -0 both 0)."""
    b = t.detach().cpu().contiguous().view(torch.int16).int()
    return torch.where(b < 0, -(b + 32768), b)


def _assert_close_to_stock(name, out, ref, max_ulps):
    """NaN exactly where stock has NaN; elsewhere (infinities included) at most ``max_ulps`` fp16
    ulps from stock's value (0: equal, as torch.equal)."""
    assert out.dtype == ref.dtype == torch.float16 and out.shape == ref.shape, name
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(out), nan), f"{name}: NaN at other places than stock's"
    dist = (_ordered(out) - _ordered(ref)).abs()[~nan.cpu()]
    worst = int(dist.max()) if dist.numel() else 0
    assert worst <= max_ulps, f"{name}: {int((dist > max_ulps).sum())} values > {max_ulps} ulp from stock (max {worst})"


def _assert_within_fp64_bound(g16, u16, dh16, h, dg, du):
    """Each value of finite inputs within the derived bound of the module docstring from fp64 (inf
    only where the exact value is at fp16's overflow threshold or beyond, with its sign)."""
    h64, dg64, du64, a64, b64 = _exact64(g16, u16, dh16)
    g64 = g16.double().cpu()
    keep = torch.isfinite(g64) & torch.isfinite(u16.double().cpu()) & torch.isfinite(dh16.double().cpu())
    fp16_rounding = lambda ref: 2.0**-11 * ref.abs() + 2.0**-25  # noqa: E731
    bounds = (("h", h, h64, 2.0**-20 * h64.abs()),
              ("du", du, du64, 2.0**-20 * du64.abs()),
              ("dg", dg, dg64, 2.0**-20 * a64.abs() * (b64.abs() + g64.abs())))
    for name, out, ref, fp32_err in bounds:
        out64 = out.double().cpu()
        # fp16 overflow: values from 65520 on round to inf (stock's cast too); an fp32 value within
        # its error of that threshold may round either way
        inf = keep & torch.isinf(out64)
        assert (ref[inf].abs() >= FP16_OVERFLOW * (1 - 2.0**-20)).all(), f"{name}: inf below fp16's overflow"
        assert torch.equal(torch.sign(out64[inf]), torch.sign(ref[inf])), f"{name}: inf of the wrong sign"
        assert not torch.isnan(out64[keep]).any(), f"{name}: NaN for finite inputs"
        finite = keep & ~inf
        err = (out64 - ref).abs()[finite]
        tol = (fp16_rounding(ref) + fp32_err)[finite]
        bad = err > tol
        assert not bad.any(), (f"{name}: {int(bad.sum())} values beyond the fp64 bound "
                               f"(worst err/tol {float((err / tol).max()):.3g})")


def _check(g16, u16, dh16, h, dg, du):
    """The two anchors: stock's values within STOCK_ULPS, and the fp64 bound."""
    hs, dgs, dus = _stock(g16, u16, dh16)
    for name, out, ref in (("h", h, hs), ("dg", dg, dgs), ("du", du, dus)):
        _assert_close_to_stock(name, out, ref, STOCK_ULPS)
    _assert_within_fp64_bound(g16, u16, dh16, h, dg, du)


# (1, 1): one element; (3, 5) and (37, 300): columns not a multiple of the 256-column tile;
# (257, 259): rows one past the interpreter's 256-row tile and the GPU's 8-row tile (ragged row count);
# (9, 8960): the model's width (35 whole column tiles) with a few tokens.
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (37, 300), (257, 259), (9, MODEL_WIDTH)])
def test_matches_stock_and_fp64(shape, device):
    """Forward and out-of-place backward: fp16 outputs of the inputs' shape, within STOCK_ULPS of
    stock and within the fp64 bound; one launch each."""
    g16, u16, dh16 = _inputs(*shape, device, seed=shape[0] * 1000 + shape[1])
    before_f, before_b = LAUNCHES["swiglu_fwd"], LAUNCHES["swiglu_bwd"]
    h, dg, du = _ours(g16, u16, dh16)
    assert (LAUNCHES["swiglu_fwd"], LAUNCHES["swiglu_bwd"]) == (before_f + 1, before_b + 1)
    assert h.dtype == torch.float16 and h.shape == g16.shape and h.is_contiguous()
    _check(g16, u16, dh16, h, dg, du)


# numpy warns of exp's overflow and of inf - inf / inf / inf: the values stock computes there too
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_every_fp16_gate_value(device):
    """All 65,536 fp16 bit patterns as g (infinities and NaNs included: silu(-inf) is NaN in stock,
    -inf / inf) against random u, dh: the STOCK_ULPS bound (NaN where stock has NaN), and the fp64
    bound at every finite g."""
    g16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16).view(256, 256)
    g16 = g16.to(device)
    _, u16, dh16 = _inputs(256, 256, device, seed=11)
    h, dg, du = _ours(g16, u16, dh16)
    assert torch.isnan(h).any() and torch.isinf(h).any()  # the non-finite patterns were really there
    _check(g16, u16, dh16, h, dg, du)


def _strided(t, pad, fill=float("nan")):
    """A copy of 2-D ``t`` as columns [pad, pad + cols) of a [rows, cols + 2 * pad] tensor filled
    with ``fill``: row stride cols + 2 * pad, unit column stride, a data pointer not at the start."""
    rows, cols = t.shape
    buf = torch.full((rows, cols + 2 * pad), fill, dtype=t.dtype, device=t.device)
    view = buf[:, pad:pad + cols]
    view.copy_(t)
    return buf, view


def test_row_strided_inputs_and_outputs(device):
    """g, u, dh as column slices of wider tensors (three different row strides), dg / du written
    into column slices of other wide tensors: the same bits as with contiguous tensors, within the
    anchors, and nothing written outside the output slices."""
    rows, cols = 41, 300
    g0, u0, dh0 = _inputs(rows, cols, device, seed=3)
    (_, g16), (_, u16), (_, dh16) = _strided(g0, 110), _strided(u0, 1), _strided(dh0, 17)
    assert (g16.stride(), u16.stride(), dh16.stride()) == ((520, 1), (302, 1), (334, 1))
    ref = _ours(g0, u0, dh0)
    h = sw.swiglu_fp16_of_fp32(g16, u16)
    (dg_buf, dg), (du_buf, du) = _strided(g0, 10, fill=7.0), _strided(u0, 3, fill=7.0)
    sw.swiglu_backward_fp16_of_fp32(dh16, g16, u16, dg, du)
    for name, out, r in zip(("h", "dg", "du"), (h, dg, du), ref):
        assert torch.equal(out, r), name
    for buf, pad in ((dg_buf, 10), (du_buf, 3)):
        assert (buf[:, :pad] == 7.0).all() and (buf[:, pad + cols:] == 7.0).all()
    _check(g16, u16, dh16, h, dg, du)


@pytest.mark.parametrize("in_place", [False, True])
def test_halves_of_one_tensor(device, in_place):
    """g = gu[:, :I], u = gu[:, I:] of one [T, 2I] tensor (row stride 2I), as a fused gate/up GEMM
    would lay them out; the backward out of place, or in place into the two halves: the same bits
    as the contiguous launch, within the anchors."""
    rows, inter = 19, 136
    gu, _, dh16 = _inputs(rows, 2 * inter, device, seed=4)
    dh16 = dh16[:, :inter]
    g16, u16 = gu[:, :inter], gu[:, inter:]
    ref = _ours(g16.contiguous(), u16.contiguous(), dh16.contiguous())
    stock = _stock(g16, u16, dh16)
    h = sw.swiglu_fp16_of_fp32(g16, u16)
    if in_place:
        dgu = gu.clone()
        sw.swiglu_backward_fp16_of_fp32(dh16, dgu[:, :inter], dgu[:, inter:], dgu[:, :inter], dgu[:, inter:])
    else:
        dgu = torch.full_like(gu, float("nan"))
        sw.swiglu_backward_fp16_of_fp32(dh16, g16, u16, dgu[:, :inter], dgu[:, inter:])
    dg, du = dgu[:, :inter], dgu[:, inter:]
    for name, out, r, s in zip(("h", "dg", "du"), (h, dg, du), ref, stock):
        assert torch.equal(out, r), name
        _assert_close_to_stock(name, out, s, STOCK_ULPS)


@pytest.mark.parametrize("rows", [37, 257])
def test_in_place_backward(device, rows):
    """nf4_mlp.mlp_backward's call: swiglu_backward_fp16_of_fp32(dh16, g16, u16, g16, u16) leaves dg
    in g16's buffer and du in u16's (same storage), the bits of the out-of-place launch, within
    the anchors. 257 rows: a ragged last row tile (several programs in the interpreter too)."""
    g0, u0, dh16 = _inputs(rows, 300, device, seed=5 + rows)
    h_ref, dg_ref, du_ref = _ours(g0, u0, dh16)
    g16, u16 = g0.clone(), u0.clone()
    ptrs = (g16.data_ptr(), u16.data_ptr())
    assert torch.equal(sw.swiglu_fp16_of_fp32(g16, u16), h_ref)  # the forward leaves g16 / u16 alone
    assert torch.equal(g16, g0) and torch.equal(u16, u0)
    sw.swiglu_backward_fp16_of_fp32(dh16, g16, u16, g16, u16)
    assert (g16.data_ptr(), u16.data_ptr()) == ptrs
    assert torch.equal(g16, dg_ref) and torch.equal(u16, du_ref)
    _check(g0, u0, dh16, h_ref, g16, u16)


def test_zero_rows_launch_nothing(device):
    """No tokens: an empty [0, 8960] h, and no kernel launched by either launcher."""
    g16 = torch.empty(0, MODEL_WIDTH, dtype=torch.float16, device=device)
    before = LAUNCHES["swiglu_fwd"], LAUNCHES["swiglu_bwd"]
    h = sw.swiglu_fp16_of_fp32(g16, g16)
    sw.swiglu_backward_fp16_of_fp32(g16, g16, g16, g16, g16)
    assert h.shape == (0, MODEL_WIDTH) and h.dtype == torch.float16
    assert (LAUNCHES["swiglu_fwd"], LAUNCHES["swiglu_bwd"]) == before


# ------------------------------------------------------------------------------------------------
# GPU only: bit for bit against torch's CUDA kernels (libdevice expf there)
# ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_every_finite_fp16_gate_value_bitwise():
    """Every finite fp16 g (63,488 values) against random u, dh: h, dg, du torch.equal to stock."""
    g16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    g16 = g16[torch.isfinite(g16)].view(248, 256).cuda()
    _, u16, dh16 = _inputs(248, 256, "cuda", seed=12)
    for name, out, ref in zip(("h", "dg", "du"), _ours(g16, u16, dh16), _stock(g16, u16, dh16)):
        assert torch.equal(out, ref), f"{name}: {int((out != ref).sum())} of {out.numel()} differ from stock"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [2048, 1499])
def test_gpu_model_shape_bitwise(tokens):
    """[tokens, 8960] (1499: a ragged last 8-row tile): forward, and the in-place backward as
    nf4_mlp makes it, torch.equal to stock; within the fp64 bound."""
    g0, u0, dh16 = _inputs(tokens, MODEL_WIDTH, "cuda", seed=7)
    hs, dgs, dus = _stock(g0, u0, dh16)
    h = sw.swiglu_fp16_of_fp32(g0, u0)
    g16, u16 = g0.clone(), u0.clone()
    sw.swiglu_backward_fp16_of_fp32(dh16, g16, u16, g16, u16)
    assert torch.equal(h, hs)
    assert torch.equal(g16, dgs)
    assert torch.equal(u16, dus)
    _assert_within_fp64_bound(g0, u0, dh16, h, g16, u16)
