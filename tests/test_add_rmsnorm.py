"""Residual add + RMSNorm (solution/kernels/add_rmsnorm.py): its launchers, as the decoder-layer node
calls them, wrapped here in a small autograd Function (``add_rmsnorm``, test-only) so that autograd's
own rounding chain can be compared with theirs. The backward has one mode, the node's: residual fp32,
x fp16 (the gradients fp32 and fp16), grad_h present (every test uses both h and y, as the layer
does); the wrapper takes only those input dtypes, and the forward's other dtype triples are checked
with the forward launcher alone. The node's norm weights are frozen and no kernel computes a weight gradient: where a test
trains the weight, the wrapper computes its gradient with torch from the kernel's rstd (stock's
formula: the sum over rows of grad_y * (h * rstd).to(h.dtype), in fp32).

Checked against (a) the stock ops, ``h = residual + x`` then Qwen2RMSNorm's stock forward, run by
autograd, (b) the exact math in fp64, and (c) where the result must be bit-identical, exact
equality: h against torch's add (same fp32 add, same single rounding), y against our own RMSNorm
kernel applied to h (the same jit helper), and the backward's rounding chain against the chain
autograd would run, built from our RMSNorm dx kernel (the norm's gradient in h's dtype) and torch
ops (the accumulation in h's dtype, the casts to residual's and x's dtypes). (c) is asserted bit
for bit in Triton's CPU interpreter, where both sides run the same numpy arithmetic; on a GPU
two different compiled kernels may contract or order fp32 operations differently, so there it is
held to the tolerances below.

Tolerances (relative L2 error, tests.conftest.rel_err):
  * all fp32: 1e-5. Ours and stock both compute in fp32 and differ only in the order of the row
    sums (mean of squares; mean of dy * xhat) and rsqrt's rounding, ~1e-7 per element.
  * any fp16 operand: F16_TOL = 4 U16 (U16 = 2^-11 ~ 4.9e-4, one fp16 rounding, relative) =
    1.95e-3. Results stored in fp16 carry one rounding (U16) against fp64, and against stock an
    fp32 difference of ~1e-7 can flip it: one fp16 ulp, at most 2 U16; the gradient of x adds at
    most one more rounding (the cast of dh to fp16), flipped too: 2 x 2 U16.
"""
import pytest
import torch
import torch.utils.checkpoint as cp

from solution.kernels import _launches
from solution.kernels import rmsnorm as rmsnorm_mod
from solution.kernels.add_rmsnorm import _launch_backward, _launch_forward
from solution.kernels.rmsnorm import rmsnorm_supported
from torch.autograd.function import once_differentiable
from tests.conftest import rel_err

modeling_qwen2 = pytest.importorskip("transformers.models.qwen2.modeling_qwen2")
Qwen2RMSNorm = modeling_qwen2.Qwen2RMSNorm
STOCK_NORM_FORWARD = Qwen2RMSNorm.forward  # read at import, before any patch is applied

F16, F32 = torch.float16, torch.float32
EPS = 1e-6
# (residual, x, weight) dtypes. The first is the workload's: fp32 residual stream, fp16 attention
# output (o_proj under fp16 autocast), fp32 frozen norm weight.
WORKLOAD = (F32, F16, F32)
# The forward's: any fp16 / fp32 triple. The backward's: residual fp32 and x fp16 (its gradients'
# dtypes), either weight dtype (add_rmsnorm.sm75_specs compiles both).
DTYPES = [WORKLOAD, (F32, F32, F32), (F16, F16, F16), (F16, F16, F32), (F16, F32, F32)]
BWD_DTYPES = [WORKLOAD, (F32, F16, F16)]


U16 = 2.0 ** -11  # fp16 unit roundoff: one rounding's largest relative error
F16_TOL = 4 * U16  # two fp16 roundings, each possibly flipped against stock (the module docstring)


def _as_rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """View t as [rows, n_cols] with unit column stride (what the launchers take); copies only when no
    such view exists."""
    if t.dim() == 0 or t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, n_cols)
    except RuntimeError:  # leading dims cannot be merged into one row stride
        return t.reshape(-1, n_cols)


def _weight_grad(h2, gy2, rstd, w_dtype):
    """The norm weight's gradient in torch (no kernel computes it): fp32 sum over rows of
    gy * (h * rstd).to(h.dtype), cast to the weight's dtype."""
    normed = (h2.float() * rstd[:, None]).to(h2.dtype).float()
    return (gy2.float() * normed).sum(0).to(w_dtype)


# The launchers in autograd (what the node does by hand in its forward and backward).
class AddRMSNormFunction(torch.autograd.Function):
    """autograd wrapper: forward returns (h, y) and saves h (an output, so no extra memory), the
    weight and rstd (4 bytes per row); backward is the node's call (both gradients, grad_h given)."""

    @staticmethod
    def forward(ctx, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float):
        if (residual.dtype, x.dtype) != (F32, F16):
            raise TypeError("the backward's one mode: residual fp32, x fp16")
        h, y, rstd = _forward_rows(residual, x, weight, eps)
        ctx.save_for_backward(h, weight.contiguous(), rstd)
        ctx.w_dtype = weight.dtype
        return h, y

    @staticmethod
    @once_differentiable  # no double backward: raise instead of silently wrong 2nd derivatives
    def backward(ctx, grad_h, grad_y):
        h, w, rstd = ctx.saved_tensors
        n_cols = h.shape[-1]
        h2 = h.view(-1, n_cols)
        gy2, gh2 = _as_rows(grad_y, n_cols), _as_rows(grad_h, n_cols)
        d_res, d_x = _launch_backward(h2, w, gy2, gh2, rstd)
        d_w = _weight_grad(h2, gy2, rstd, ctx.w_dtype) if ctx.needs_input_grad[2] else None
        return d_res.view(h.shape), d_x.view(h.shape), d_w, None


def _forward_rows(residual, x, weight, eps):
    """The forward launcher on residual / x of any strides: (h, y, rstd)."""
    n_cols = x.shape[-1]
    r2, x2 = _as_rows(residual, n_cols), _as_rows(x, n_cols)
    return _launch_forward(r2, x2, weight.contiguous(), float(eps), x.shape)


def add_rmsnorm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, y) = (residual + x, Qwen2RMSNorm(h)) in one pass, with the stock ops' exact dtypes and
    roundings: h in promote(residual, x), y = ``weight * (h.float() * rstd).to(h.dtype)`` in
    promote(h, weight). residual fp32, x fp16 (the backward's mode): same shape [..., N], any
    strides; weight [N], fp16/fp32. Both outputs are contiguous; differentiable w.r.t. residual, x
    and weight."""
    return AddRMSNormFunction.apply(residual, x, weight, eps)



def add_rmsnorm_supported(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Can the kernels handle these tensors (dtypes fp16/fp32, same shapes, hidden <= MAX_HIDDEN,
    one device)? Which devices the kernels run on is checked by the caller."""
    return (isinstance(residual, torch.Tensor) and isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)
            and residual.shape == x.shape and rmsnorm_supported(residual, weight) and rmsnorm_supported(x, weight))



def tol(*dtypes) -> float:
    return F16_TOL if F16 in dtypes else 1e-5


def make_weight(hidden, dtype, device, requires_grad=True):
    w = (1.0 + 0.5 * torch.randn(hidden)).to(device=device, dtype=dtype)  # not all ones: it must matter
    return w.requires_grad_(requires_grad)


def stock_norm(h, w):
    """Qwen2RMSNorm's stock forward with weight w, a tensor of the caller's graph (any patch of
    the class is bypassed)."""
    m = Qwen2RMSNorm(h.shape[-1], eps=EPS)
    del m.weight  # so that a plain tensor can take the parameter's place
    m.weight = w
    return STOCK_NORM_FORWARD(m, h)


def make_inputs(shape, r_dt, x_dt, device, seed):
    torch.manual_seed(seed)
    r = (torch.randn(shape, device=device) * 2 + 0.3).to(r_dt)
    x = torch.randn(shape, device=device).to(x_dt)
    return r, x


def fp64_forward(r64, x64, w64):
    """(h, y) of the exact math (in the inputs' dtype, fp64)."""
    h64 = r64 + x64
    return h64, w64 * h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + EPS)


def fp64_reference(r, x, w, gh, gy):
    """(h, y, dres, dx, dw) of the exact math in fp64."""
    r64, x64, w64 = (t.detach().double().requires_grad_(True) for t in (r, x, w))
    h64, y64 = fp64_forward(r64, x64, w64)
    d = torch.autograd.grad((h64, y64), (r64, x64, w64), (gh.double(), gy.double()))
    return (h64, y64, *d)


def ours_and_stock(r, x, w, gh, gy):
    """[h, y, dres, dx, dw] from add_rmsnorm and from the stock ops (dw None when w is frozen)."""
    results = []
    for impl in ("ours", "stock"):
        rr, xx = r.detach().requires_grad_(True), x.detach().requires_grad_(True)
        ww = w.detach().requires_grad_(w.requires_grad)
        if impl == "ours":
            h, y = add_rmsnorm(rr, xx, ww, EPS)
        else:
            h = rr + xx
            y = stock_norm(h, ww)
        wants = (rr, xx, ww) if ww.requires_grad else (rr, xx)
        d = torch.autograd.grad((h, y), wants, (gh, gy))
        results.append([h, y, d[0], d[1], d[2] if ww.requires_grad else None])
    return results


def upstream_grads(r, x, w, seed):
    """(gh, gy): random gradients of h and y in their dtypes."""
    torch.manual_seed(seed + 1)
    h_dt = torch.promote_types(r.dtype, x.dtype)
    y_dt = torch.promote_types(h_dt, w.dtype)
    return torch.randn(r.shape, device=r.device).to(h_dt), torch.randn(r.shape, device=r.device).to(y_dt)


def check_all(r, x, w, seed=0):
    """Ours vs stock vs fp64 (forward, every input gradient, the weight gradient)."""
    gh, gy = upstream_grads(r, x, w, seed)
    ours, stock = ours_and_stock(r, x, w, gh, gy)
    ref = fp64_reference(r, x, w, gh, gy)
    t = tol(r.dtype, x.dtype, w.dtype)
    # dtypes and shapes are stock's
    for a, b in zip(ours, stock):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape
    assert ours[0].dtype == gh.dtype and ours[1].dtype == gy.dtype and ours[2].dtype == r.dtype
    assert ours[3].dtype == x.dtype
    # the sum is exact: bit-equal to torch's add
    assert torch.equal(ours[0], stock[0])
    for i, name in ((1, "y"), (2, "dres"), (3, "dx"), (4, "dw")):
        if ours[i] is None:
            continue
        assert rel_err(ours[i], stock[i]) < t, name
        assert rel_err(ours[i], ref[i]) < t, name
    return ours, gh, gy


def check_forward(r, x, w):
    """The forward launcher alone, any dtype triple: h bit-equal to torch's add; y against stock and
    fp64, and against our RMSNorm of h (the same jit helper): the same bits in the interpreter, on
    the GPU within tol()."""
    h, y, _ = _forward_rows(r, x, w, EPS)
    hs = r + x
    ys = stock_norm(hs, w)
    assert h.dtype == hs.dtype and y.dtype == ys.dtype and y.shape == ys.shape == r.shape
    assert torch.equal(h, hs)
    _, y64 = fp64_forward(r.double(), x.double(), w.double())
    t = tol(r.dtype, x.dtype, w.dtype)
    assert rel_err(y, ys) < t and rel_err(y, y64) < t
    y_ref, _ = rmsnorm_mod._launch_forward(h.view(-1, r.shape[-1]), w, EPS)
    if r.device.type == "cpu":
        assert torch.equal(y, y_ref.view(r.shape))
    else:
        assert rel_err(y, y_ref.view(r.shape)) < t


# ------------------------------------------------------------------------------------------------
# The op
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("r_dt,x_dt,w_dt", BWD_DTYPES)
@pytest.mark.parametrize("shape", [(3, 7, 40), (5, 100)])
def test_matches_stock_and_fp64(device, r_dt, x_dt, w_dt, shape):
    r, x = make_inputs(shape, r_dt, x_dt, device, seed=shape[-1])
    w = make_weight(shape[-1], w_dt, device)
    check_all(r, x, w)


@pytest.mark.parametrize("r_dt,x_dt,w_dt", DTYPES)
@pytest.mark.parametrize("shape", [(3, 7, 40), (5, 100)])
def test_forward_matches_stock_and_fp64(device, r_dt, x_dt, w_dt, shape):
    """The forward launcher alone, every dtype triple (check_forward)."""
    r, x = make_inputs(shape, r_dt, x_dt, device, seed=shape[-1])
    check_forward(r, x, make_weight(shape[-1], w_dt, device, requires_grad=False))


@pytest.mark.parametrize("r_dt,x_dt,w_dt", BWD_DTYPES)
def test_rounding_chain_is_autograds(device, r_dt, x_dt, w_dt):
    """y is our RMSNorm of h; dres / dx are what autograd makes of the stock graph given the norm's
    gradient: (grad_h + norm_grad in h.dtype) in h.dtype, then cast per input. The same bits
    (torch.equal) in the interpreter; on the GPU within tol()."""
    shape = (3, 7, 40)
    r, x = make_inputs(shape, r_dt, x_dt, device, seed=11)
    w = make_weight(40, w_dt, device, requires_grad=False)
    (h, y, dres, dx, _), gh, gy = check_all(r, x, w, seed=11)
    h2 = h.detach().view(-1, 40)
    y_ref, rstd = rmsnorm_mod._launch_forward(h2, w, EPS)
    dnorm = rmsnorm_mod._launch_backward_dx(h2, w, gy.reshape(-1, 40), rstd)  # in h.dtype
    dh = gh + dnorm.view(shape)  # torch's add in h.dtype
    expected = [(y, y_ref.view(shape)), (dres, dh.to(r_dt)), (dx, dh.to(x_dt))]
    for got, want in expected:
        assert got.dtype == want.dtype
        if device == "cpu":
            assert torch.equal(got, want)
        else:
            assert rel_err(got, want) < tol(r_dt, x_dt, w_dt)


@pytest.mark.parametrize("layout", ["row_slice", "strided_rows", "transposed"])
def test_non_contiguous_inputs_and_grads(device, layout):
    """Residual a slice of wider rows, x with every other token or a transposed view; the upstream
    gradients a transposed view (grad_h) and an expanded one (grad_y, row stride 0)."""
    torch.manual_seed(6)
    n = 40
    r = (torch.randn(4, 5, n + 30, device=device) * 2)[..., 10:10 + n]
    if layout == "row_slice":
        x = torch.randn(4, 5, n + 7, device=device).half()[..., :n]
    elif layout == "strided_rows":
        x = torch.randn(4, 10, n, device=device).half()[:, ::2, :]
    else:
        x = torch.randn(n, 5, 4, device=device).half().permute(2, 1, 0)
    assert not r.is_contiguous() and not x.is_contiguous() and x.shape == r.shape
    w = make_weight(n, F32, device)
    gh = torch.randn(n, 5, 4, device=device).permute(2, 1, 0)
    gy = torch.randn(1, 1, n, device=device).expand(4, 5, n)
    ours, stock = ours_and_stock(r, x, w, gh, gy)
    assert torch.equal(ours[0], stock[0])
    for a, b in zip(ours[1:], stock[1:]):  # y and the gradients: fp16 x (the module docstring)
        assert rel_err(a, b) < F16_TOL


@pytest.fixture(params=["one_row", "small_tiles"])
def tiling(request, monkeypatch):
    """The GPU's launch config (one row per program) and multi-row tiles of 256 elements with a
    partial last tile, on whatever runs the test (see tests/test_rmsnorm.py)."""
    elems = {"one_row": 0, "small_tiles": 256}[request.param]
    monkeypatch.setattr(rmsnorm_mod, "GPU_TILE_ELEMS", elems)
    monkeypatch.setattr(rmsnorm_mod, "INTERP_TILE_ELEMS", elems)
    return request.param


@pytest.mark.parametrize("shape", [(37, 100), (45, 7)])
def test_row_tilings(device, tiling, shape):
    r, x = make_inputs(shape, F32, F16, device, seed=7)
    check_all(r, x, make_weight(shape[-1], F32, device))


def test_launches_and_frozen_weight(device):
    """One forward launch, one backward launch (the weight frozen, as the node's)."""
    r, x = make_inputs((2, 5, 40), *WORKLOAD[:2], device, seed=8)
    w = make_weight(40, F32, device, requires_grad=False)
    _launches.reset()
    check_all(r, x, w)
    assert dict(_launches.LAUNCHES) == {"_add_rmsnorm_fwd_kernel": 1, "_add_rmsnorm_bwd_kernel": 1}


def test_empty_rows(device):
    r = torch.randn(0, 16, device=device, requires_grad=True)
    x = torch.randn(0, 16, device=device, dtype=F16, requires_grad=True)
    w = make_weight(16, F32, device)
    h, y = add_rmsnorm(r, x, w, EPS)
    assert h.shape == y.shape == (0, 16)
    dres, dx, dw = torch.autograd.grad((h, y), (r, x, w), (torch.ones_like(h), torch.ones_like(y)))
    assert dres.shape == dx.shape == (0, 16) and torch.equal(dw, torch.zeros_like(dw))


def test_under_checkpoint(device):
    """Recomputed under torch.utils.checkpoint (as in the workload): same gradients."""
    r, x = make_inputs((2, 9, 40), F32, F16, device, seed=9)
    r.requires_grad_(True), x.requires_grad_(True)
    w = make_weight(40, F32, device)
    g = torch.randn(2, 9, 40, device=device)

    def block(a, b):  # a little graph around the op, like the decoder layer: h + f(y)
        h, y = add_rmsnorm(a, b, w, EPS)
        return h + y * 2.0

    dr, dx, dw = torch.autograd.grad(cp.checkpoint(block, r, x, use_reentrant=False), (r, x, w), g)
    hs = r + x
    out_s = hs + stock_norm(hs, w) * 2.0
    drs, dxs, dws = torch.autograd.grad(out_s, (r, x, w), g)
    assert rel_err(dr, drs) < 1e-5 and rel_err(dx, dxs) < F16_TOL and rel_err(dw, dws) < 1e-5  # dx: fp16


def test_supported():
    r, x = torch.randn(3, 40), torch.randn(3, 40).half()
    w = torch.ones(40)
    assert add_rmsnorm_supported(r, x, w)
    assert not add_rmsnorm_supported(r, x[:2], w)                       # shapes differ (broadcast)
    assert not add_rmsnorm_supported(r.bfloat16(), x, w)                # bf16
    assert not add_rmsnorm_supported(r.double(), x, w)                  # fp64
    assert not add_rmsnorm_supported(r, x, torch.ones(41))              # weight size
    big = rmsnorm_mod.MAX_HIDDEN + 1
    assert not add_rmsnorm_supported(torch.randn(1, big), torch.randn(1, big), torch.ones(big))


@pytest.mark.gpu
@pytest.mark.parametrize("r_dt,x_dt,w_dt", DTYPES + BWD_DTYPES[1:])
def test_gpu_workload_shape(r_dt, x_dt, w_dt):
    r, x = make_inputs((4, 512, 1536), r_dt, x_dt, "cuda", seed=16)
    w = make_weight(1536, w_dt, "cuda", requires_grad=False)
    check_forward(r, x, w)
    if (r_dt, x_dt, w_dt) in BWD_DTYPES:
        check_all(r, x, w)
