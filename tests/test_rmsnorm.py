"""Fused RMSNorm (solution/kernels/rmsnorm.py) against an fp64 reference and against stock
transformers' Qwen2RMSNorm: forward, grad input, grad weight; odd sizes, non-contiguous inputs,
both dtypes, torch.utils.checkpoint, autocast, and the patch's install / fallback / revert.
Row tiling: the interpreter's default (one big tile of many rows), the GPU's (one row per
program) and small multi-row tiles with a partial last tile are all run, wherever the test runs.

Tolerances (relative L2 error, tests.conftest.rel_err):
  * fp32 everywhere: 1e-5 against fp64 and stock. Both compute in fp32 and differ only in
    summation order and rsqrt rounding (~1e-7 per element); 1e-5 leaves ample margin.
  * any fp16 operand: F16_TOL = 4 U16 (U16 = 2^-11 ~ 4.9e-4, one fp16 rounding, relative) =
    1.95e-3. Each output goes through at most two fp16 roundings (stock rounds the normalized
    value to fp16 before the weight multiply, then the product; backward the product's gradient,
    then dx), each erring by at most U16 against fp64: 2 U16. Against stock (same roundings, fp32
    inside) an fp32 difference of ~1e-7 can flip a rounding: one fp16 ulp, at most 2 U16, on each
    of the two: 4 U16.
"""
import pytest
import torch
import torch.utils.checkpoint as cp
import triton

from solution.kernels import _launches
from solution.kernels import rmsnorm as rmsnorm_mod
from solution.kernels.rmsnorm import MAX_HIDDEN, rmsnorm
from tests.conftest import rel_err

Qwen2RMSNorm = pytest.importorskip("transformers.models.qwen2.modeling_qwen2").Qwen2RMSNorm

F16, F32 = torch.float16, torch.float32
EPS = 1e-6
DTYPE_PAIRS = [(F32, F32), (F16, F32), (F16, F16), (F32, F16)]  # (input, weight); (F32, F32) is the workload


U16 = 2.0 ** -11  # fp16 unit roundoff: one rounding's largest relative error
F16_TOL = 4 * U16  # two fp16 roundings, each possibly flipped against stock (the module docstring)


def tol(*dtypes) -> float:
    return F16_TOL if F16 in dtypes else 1e-5


def ref_fp64(x, w, eps=EPS):
    """The exact math in fp64 (no intermediate roundings)."""
    x64, w64 = x.detach().double(), w.detach().double()
    return w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)


def make_module(hidden, w_dtype, device, requires_grad=True):
    m = Qwen2RMSNorm(hidden, eps=EPS).to(device=device, dtype=w_dtype)
    with torch.no_grad():
        m.weight.copy_(1.0 + 0.5 * torch.randn(hidden))  # not all ones: the weight must matter
    m.weight.requires_grad_(requires_grad)
    return m


def run(fn, x, w, g):
    """Forward + grads of (x, w) for upstream grad g."""
    x = x.detach().requires_grad_(True)
    out = fn(x)
    wants = [x] + ([w] if w.requires_grad else [])
    grads = torch.autograd.grad(out, wants, g)
    return out, grads[0], (grads[1] if w.requires_grad else None)


def check_against_stock_and_ref(x, m):
    """Our kernel vs stock module vs fp64 reference (forward, dx, dw)."""
    w = m.weight
    out_dtype = torch.promote_types(x.dtype, w.dtype)
    g = torch.randn(x.shape, dtype=out_dtype, device=x.device)
    ours = run(lambda t: rmsnorm(t, w, EPS), x, w, g)
    stock = run(m, x, w, g)
    assert ours[0].dtype == stock[0].dtype == out_dtype and ours[0].shape == x.shape
    assert ours[1].dtype == x.dtype and ours[1].shape == x.shape
    t = tol(x.dtype, w.dtype)
    # forward vs fp64 and vs stock
    assert rel_err(ours[0], ref_fp64(x, w)) < t
    assert rel_err(ours[0], stock[0]) < t
    # grads vs fp64 autograd (of the exact math) and vs stock
    x64 = x.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    ref64 = w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)
    dx64, dw64 = torch.autograd.grad(ref64, (x64, w64), g.double())
    assert rel_err(ours[1], dx64) < t and rel_err(ours[1], stock[1]) < t
    if w.requires_grad:
        assert ours[2].dtype == w.dtype and ours[2].shape == w.shape
        assert rel_err(ours[2], dw64) < t and rel_err(ours[2], stock[2]) < t
    else:
        assert ours[2] is None


@pytest.mark.parametrize("x_dtype,w_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("hidden,rows", [(1536, 3), (100, 1), (100, 37), (7, 5)])
def test_matches_stock_and_fp64(device, x_dtype, w_dtype, hidden, rows):
    torch.manual_seed(hidden * 100 + rows)
    m = make_module(hidden, w_dtype, device)
    x = (torch.randn(rows, hidden, device=device) * 3 + 0.5).to(x_dtype)
    check_against_stock_and_ref(x, m)


@pytest.fixture(params=["one_row", "small_tiles"])
def tiling(request, monkeypatch):
    """Force a row tiling on whatever runs the test: 'one_row' is the GPU's launch config (one row
    per program; weight-gradient tiles 32 x 64), 'small_tiles' packs several rows per program in
    tiles of 256 elements so the last tile is partial. (The interpreter's own default, one big
    tile, is what every other test runs on the CPU.)"""
    elems = {"one_row": 0, "small_tiles": 256}[request.param]
    monkeypatch.setattr(rmsnorm_mod, "GPU_TILE_ELEMS", elems)
    monkeypatch.setattr(rmsnorm_mod, "INTERP_TILE_ELEMS", elems)
    return request.param


@pytest.mark.parametrize("x_dtype,w_dtype", [(F32, F32), (F16, F32)])
@pytest.mark.parametrize("hidden,rows", [(100, 37), (7, 45), (1536, 3)])
def test_row_tilings(device, tiling, x_dtype, w_dtype, hidden, rows):
    """small_tiles: hidden 100 -> 2 rows per program (19 programs), hidden 7 -> 32 rows (2 programs)."""
    torch.manual_seed(hidden + rows)
    m = make_module(hidden, w_dtype, device)
    x = (torch.randn(rows, hidden, device=device) * 2 - 0.3).to(x_dtype)
    check_against_stock_and_ref(x, m)


def test_launch_configs(monkeypatch):
    """GPU: one row per program, 32 x 64 weight-gradient tiles (the configs sm75_specs lists).
    Interpreter: the tiny CI model's [2048, 64] rows in at most 2 programs per kernel."""
    monkeypatch.setattr(rmsnorm_mod, "interpreter_enabled", lambda: False)
    block, _ = rmsnorm_mod._row_config(1536)
    assert rmsnorm_mod._rows_per_program(2048, block) == 1
    assert rmsnorm_mod._dw_config(2048, 1536) == (32, 64)
    monkeypatch.setattr(rmsnorm_mod, "interpreter_enabled", lambda: True)
    block, _ = rmsnorm_mod._row_config(64)
    assert triton.cdiv(2048, rmsnorm_mod._rows_per_program(2048, block)) <= 2
    block_m, block_n = rmsnorm_mod._dw_config(2048, 64)
    assert triton.cdiv(2048, block_m) * triton.cdiv(64, block_n) <= 2
    assert rmsnorm_mod._rows_per_program(3, 2048) == 4  # never more rows than the input has (pow2)


@pytest.mark.parametrize("x_dtype,w_dtype", [(F32, F32), (F16, F32)])
def test_three_dim_input_and_frozen_weight(device, x_dtype, w_dtype):
    """[B, L, H] as in the model, weight frozen as in the workload: no dw is computed."""
    torch.manual_seed(1)
    m = make_module(1536, w_dtype, device, requires_grad=False)
    x = torch.randn(2, 5, 1536, device=device).to(x_dtype)
    _launches.reset()
    check_against_stock_and_ref(x, m)
    assert _launches.LAUNCHES["_rmsnorm_bwd_dw_kernel"] == 0
    assert _launches.LAUNCHES["_rmsnorm_fwd_kernel"] == 1 and _launches.LAUNCHES["_rmsnorm_bwd_dx_kernel"] == 1


@pytest.mark.parametrize("layout", ["row_slice", "strided_rows", "transposed"])
@pytest.mark.parametrize("x_dtype", [F32, F16])
def test_non_contiguous_inputs(device, layout, x_dtype):
    torch.manual_seed(2)
    hidden = 100
    m = make_module(hidden, F32, device)
    if layout == "row_slice":      # each row a slice of a wider row: a [rows, N] view with row stride 130
        x = torch.randn(4, 5, 130, device=device).to(x_dtype)[..., 10:10 + hidden]
    elif layout == "strided_rows":  # every other token: leading dims cannot merge into one stride
        x = torch.randn(3, 12, hidden, device=device).to(x_dtype)[:, ::2, :]
    else:                           # hidden dim not unit stride: must be copied
        x = torch.randn(hidden, 6, device=device).to(x_dtype).t()
    assert not x.is_contiguous()
    check_against_stock_and_ref(x, m)


def test_non_contiguous_upstream_grad(device):
    torch.manual_seed(3)
    m = make_module(100, F32, device)
    x = torch.randn(6, 100, device=device, requires_grad=True)
    g = torch.randn(100, 6, device=device).t()  # grad of the output with non-unit column stride
    dx, dw = torch.autograd.grad(rmsnorm(x, m.weight, EPS), (x, m.weight), g)
    dxs, dws = torch.autograd.grad(m(x), (x, m.weight), g)
    assert rel_err(dx, dxs) < 1e-5 and rel_err(dw, dws) < 1e-5


def test_empty_rows(device):
    m = make_module(16, F32, device)
    x = torch.randn(0, 16, device=device, requires_grad=True)
    out = rmsnorm(x, m.weight, EPS)
    assert out.shape == (0, 16)
    dx, dw = torch.autograd.grad(out, (x, m.weight), torch.ones_like(out))
    assert dx.shape == (0, 16) and torch.equal(dw, torch.zeros_like(dw))


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_under_checkpoint(device, use_reentrant):
    """Recompute in backward (gradient checkpointing, as in the workload) gives the same grads."""
    torch.manual_seed(4)
    m = make_module(100, F32, device)
    x = torch.randn(2, 9, 100, device=device, requires_grad=True)
    g = torch.randn(2, 9, 100, device=device)

    def block(t):  # a little graph around the norm, like a decoder layer
        return rmsnorm(t * 1.5, m.weight, EPS) * 2.0

    out = cp.checkpoint(block, x, use_reentrant=use_reentrant)
    out.backward(g)  # reentrant checkpoint does not support autograd.grad(): use .grad fields
    dx, dw = x.grad.clone(), m.weight.grad.clone()
    x.grad = m.weight.grad = None
    out_s = m(x * 1.5) * 2.0  # stock module, no checkpoint
    out_s.backward(g)
    dxs, dws = x.grad, m.weight.grad
    assert rel_err(out, out_s) < 1e-5 and rel_err(dx, dxs) < 1e-5 and rel_err(dw, dws) < 1e-5


# ------------------------------------------------------------------------------------------------
# The patch
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def patched(monkeypatch):
    """solution.apply() with only this op's patch, reverted afterwards."""
    import solution
    import solution._apply as apply_mod

    solution.revert()
    monkeypatch.setattr(apply_mod, "PATCHES", ["solution.patches.qwen2_rmsnorm"])
    installed = solution.apply(verbose=False)
    assert "qwen2_rmsnorm" in installed
    yield
    solution.revert()


def test_apply_installs_and_revert_restores():
    import solution
    import solution._apply as apply_mod
    from transformers.models.qwen2 import modeling_qwen2

    original = modeling_qwen2.Qwen2RMSNorm.forward
    solution.revert()
    saved = apply_mod.PATCHES
    apply_mod.PATCHES = ["solution.patches.qwen2_rmsnorm"]
    try:
        assert "qwen2_rmsnorm" in solution.apply(verbose=False)
        assert modeling_qwen2.Qwen2RMSNorm.forward is not original
        assert modeling_qwen2.Qwen2RMSNorm.forward._solution_stock is original
    finally:
        solution.revert()
        apply_mod.PATCHES = saved
    assert modeling_qwen2.Qwen2RMSNorm.forward is original
    assert "forward" in modeling_qwen2.Qwen2RMSNorm.__dict__


def test_patch_check_accepts_installed_transformers():
    from solution.patches import qwen2_rmsnorm

    assert qwen2_rmsnorm.check() is None


@pytest.mark.parametrize("x_dtype,w_dtype", DTYPE_PAIRS)
def test_patched_module_matches_stock(device, patched, x_dtype, w_dtype):
    torch.manual_seed(5)
    m = make_module(100, w_dtype, device)
    x = torch.randn(3, 4, 100, device=device).to(x_dtype)
    g = torch.randn(3, 4, 100, device=device).to(torch.promote_types(x_dtype, w_dtype))
    _launches.reset()
    ours = run(m, x, m.weight, g)
    assert _launches.LAUNCHES["_rmsnorm_fwd_kernel"] == 1  # the kernel really ran
    stock = run(lambda t: type(m).forward._solution_stock(m, t), x, m.weight, g)
    assert ours[0].dtype == stock[0].dtype
    t = tol(x_dtype, w_dtype)
    for a, b in zip(ours, stock):
        assert rel_err(a, b) < t


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_patched_module_falls_back_for_other_dtypes(device, patched, dtype):
    m = make_module(32, dtype, device)
    x = torch.randn(3, 32, device=device, dtype=dtype)
    _launches.reset()
    out = m(x)
    assert sum(_launches.LAUNCHES.values()) == 0  # stock path, no kernel
    assert torch.equal(out, type(m).forward._solution_stock(m, x))


def test_patched_module_falls_back_for_huge_hidden(device, patched):
    m = make_module(MAX_HIDDEN + 2, F32, device)
    x = torch.randn(2, MAX_HIDDEN + 2, device=device)
    _launches.reset()
    m(x)
    assert sum(_launches.LAUNCHES.values()) == 0


def test_patched_module_under_autocast_keeps_stock_dtypes(device, patched):
    """Under fp16 autocast (the workload's mixed precision) the module sees the fp32 residual and
    fp32 weight; the output must stay fp32 exactly like stock, and values must match."""
    torch.manual_seed(6)
    m = make_module(64, F32, device)
    lin = torch.nn.Linear(64, 64).to(device)
    x = torch.randn(2, 3, 64, device=device, requires_grad=True)
    with torch.autocast(device_type=device, dtype=torch.float16):
        ours = m(x)
        y_ours = lin(ours)
        stock = type(m).forward._solution_stock(m, x)
        y_stock = lin(stock)
    assert ours.dtype == stock.dtype == F32
    assert y_ours.dtype == y_stock.dtype
    assert rel_err(ours, stock) < 1e-5
    dx = torch.autograd.grad(y_ours.float().sum(), x)[0]
    dxs = torch.autograd.grad(y_stock.float().sum(), x)[0]
    # the Linear ran in fp16 under autocast: its input (our fp32 norm output, ~1e-7 from stock's)
    # and its input gradient are rounded to fp16, either rounding possibly flipped: 2 x 2 U16
    assert rel_err(dx, dxs) < F16_TOL


# ------------------------------------------------------------------------------------------------
# GPU only: the workload's real shape
# ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPE_PAIRS)
def test_gpu_workload_shape(x_dtype, w_dtype):
    torch.manual_seed(7)
    m = make_module(1536, w_dtype, "cuda")
    x = torch.randn(4, 512, 1536, device="cuda").to(x_dtype)
    check_against_stock_and_ref(x, m)


@pytest.mark.gpu
def test_gpu_patched_under_autocast_and_checkpoint(patched):
    torch.manual_seed(8)
    m = make_module(1536, F32, "cuda", requires_grad=False)
    x = torch.randn(4, 377, 1536, device="cuda", requires_grad=True)
    g = torch.randn(4, 377, 1536, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        out = cp.checkpoint(m, x, use_reentrant=False)
        out_s = cp.checkpoint(lambda t: type(m).forward._solution_stock(m, t), x, use_reentrant=False)
    assert out.dtype == out_s.dtype == F32
    dx = torch.autograd.grad(out, x, g)[0]
    dxs = torch.autograd.grad(out_s, x, g)[0]
    assert rel_err(out, out_s) < 1e-5 and rel_err(dx, dxs) < 1e-5

