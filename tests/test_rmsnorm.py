"""Fused RMSNorm (solution/kernels/rmsnorm.py) through its launchers, as the decoder-layer node calls
them (``_launch_forward`` -> out, rstd; ``_launch_backward_dx`` -> the input gradient), against an fp64
reference and against stock transformers' Qwen2RMSNorm: forward, rstd, grad input; odd sizes, rows of
any stride (inputs and upstream gradients), every fp16 / fp32 pair of input and weight.
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
  * rstd (fp32, computed in fp32 from the input's values): 1e-5 against fp64, any dtype.
"""
import pytest
import torch
import triton

from solution.kernels import _launches
from solution.kernels import rmsnorm as rmsnorm_mod
from solution.kernels.rmsnorm import _launch_backward_dx, _launch_forward
from tests.conftest import rel_err

Qwen2RMSNorm = pytest.importorskip("transformers.models.qwen2.modeling_qwen2").Qwen2RMSNorm

F16, F32 = torch.float16, torch.float32
EPS = 1e-6
DTYPE_PAIRS = [(F32, F32), (F16, F32), (F16, F16), (F32, F16)]  # (input, weight); (F32, F32) is the workload


U16 = 2.0 ** -11  # fp16 unit roundoff: one rounding's largest relative error
F16_TOL = 4 * U16  # two fp16 roundings, each possibly flipped against stock (the module docstring)


def tol(*dtypes) -> float:
    return F16_TOL if F16 in dtypes else 1e-5


def make_module(hidden, w_dtype, device):
    m = Qwen2RMSNorm(hidden, eps=EPS).to(device=device, dtype=w_dtype)
    with torch.no_grad():
        m.weight.copy_(1.0 + 0.5 * torch.randn(hidden))  # not all ones: the weight must matter
    m.weight.requires_grad_(False)  # frozen, as the node's norm weights
    return m


def ours(x2, w, g2):
    """(out, rstd, dx) from the launchers, as the node calls them, for upstream gradient g2."""
    out, rstd = _launch_forward(x2, w, EPS)
    return out, rstd, _launch_backward_dx(x2, w, g2, rstd)


def check_against_stock_and_ref(x, m, g=None):
    """The launchers vs the stock module vs the fp64 reference (forward, rstd, dx); x [rows, N] with a
    unit column stride, g (default: random, contiguous) the output's upstream gradient."""
    w = m.weight
    out_dtype = torch.promote_types(x.dtype, w.dtype)
    if g is None:
        g = torch.randn(x.shape, dtype=out_dtype, device=x.device)
    out, rstd, dx = ours(x, w, g)
    xs = x.detach().clone().requires_grad_(True)
    stock = m(xs)
    dxs = torch.autograd.grad(stock, xs, g)[0]
    assert out.dtype == stock.dtype == out_dtype and out.shape == x.shape and out.is_contiguous()
    assert dx.dtype == x.dtype and dx.shape == x.shape and dx.is_contiguous()
    assert rstd.dtype == F32 and rstd.shape == (x.shape[0],)
    t = tol(x.dtype, w.dtype)
    x64 = x.detach().double().requires_grad_(True)
    rstd64 = torch.rsqrt(x64.pow(2).mean(-1) + EPS)
    ref64 = w.detach().double() * x64 * rstd64[:, None]
    dx64 = torch.autograd.grad(ref64, x64, g.double())[0]
    assert rel_err(rstd, rstd64) < 1e-5
    assert rel_err(out, ref64) < t and rel_err(out, stock) < t
    assert rel_err(dx, dx64) < t and rel_err(dx, dxs) < t


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
    per program), 'small_tiles' packs several rows per program in tiles of 256 elements so the
    last tile is partial. (The interpreter's own default, one big tile, is what every other test
    runs on the CPU.)"""
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
    """GPU: one row per program (the configs sm75_specs lists). Interpreter: the tiny CI model's
    [2048, 64] rows in at most 2 programs per kernel."""
    monkeypatch.setattr(rmsnorm_mod, "interpreter_enabled", lambda: False)
    block, _ = rmsnorm_mod._row_config(1536)
    assert rmsnorm_mod._rows_per_program(2048, block) == 1
    monkeypatch.setattr(rmsnorm_mod, "interpreter_enabled", lambda: True)
    block, _ = rmsnorm_mod._row_config(64)
    assert triton.cdiv(2048, rmsnorm_mod._rows_per_program(2048, block)) <= 2
    assert rmsnorm_mod._rows_per_program(3, 2048) == 4  # never more rows than the input has (pow2)


@pytest.mark.parametrize("x_dtype,w_dtype", [(F32, F32), (F16, F32)])
def test_one_launch_each_way(device, x_dtype, w_dtype):
    """The node's hidden size: one forward launch, one dx launch, nothing else."""
    torch.manual_seed(1)
    m = make_module(1536, w_dtype, device)
    x = torch.randn(10, 1536, device=device).to(x_dtype)
    _launches.reset()
    check_against_stock_and_ref(x, m)
    assert dict(_launches.LAUNCHES) == {"_rmsnorm_fwd_kernel": 1, "_rmsnorm_bwd_dx_kernel": 1}


@pytest.mark.parametrize("layout", ["row_slice", "strided_rows"])
@pytest.mark.parametrize("x_dtype", [F32, F16])
def test_row_strided_inputs(device, layout, x_dtype):
    """Rows that are not packed: each a slice of a wider row (row stride 130), or every other row
    (row stride 200); the outputs are contiguous."""
    torch.manual_seed(2)
    hidden = 100
    m = make_module(hidden, F32, device)
    if layout == "row_slice":
        x = torch.randn(20, 130, device=device).to(x_dtype)[:, 10:10 + hidden]
    else:
        x = torch.randn(24, hidden, device=device).to(x_dtype)[::2]
    assert not x.is_contiguous() and x.stride(-1) == 1
    check_against_stock_and_ref(x, m)


def test_row_strided_upstream_grad(device):
    torch.manual_seed(3)
    m = make_module(100, F32, device)
    x = torch.randn(6, 100, device=device)
    g = torch.randn(6, 130, device=device)[:, 5:105]  # the output's gradient with row stride 130
    assert not g.is_contiguous()
    check_against_stock_and_ref(x, m, g)


def test_empty_rows(device):
    m = make_module(16, F32, device)
    x = torch.randn(0, 16, device=device)
    _launches.reset()
    out, rstd, dx = ours(x, m.weight, torch.randn(0, 16, device=device))
    assert out.shape == dx.shape == (0, 16) and rstd.shape == (0,)
    assert sum(_launches.LAUNCHES.values()) == 0


# ------------------------------------------------------------------------------------------------
# GPU only: the workload's real shape
# ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPE_PAIRS)
def test_gpu_workload_shape(x_dtype, w_dtype):
    torch.manual_seed(7)
    m = make_module(1536, w_dtype, "cuda")
    x = torch.randn(4 * 512, 1536, device="cuda").to(x_dtype)
    check_against_stock_and_ref(x, m)
