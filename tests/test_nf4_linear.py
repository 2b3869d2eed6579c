"""Frozen NF4 linear (our dequant kernel + cuBLAS) vs bitsandbytes' own Linear4bit.forward.

Stock and ours run on the same layer and the same inputs. bnb's CPU path is dequant + F.linear
(its gemm_4bit default op), the GPU path at M > 1536 is dequant + F.linear too, so with the same
fp16 weight bits the forward and the input gradient must be EQUAL, not merely close. An fp64
reference checks the math independently.

Every test runs on the ``device`` fixture (the GPU when there is one). On CUDA, bnb runs its own
fused 4-bit GEMM for small row counts and our patch deliberately leaves those calls to bnb, so
there the inputs get more rows (``tokens``: > 1536, bnb's limit) while the CPU keeps the small
shapes (the interpreter is slow).
"""
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import bitsandbytes as bnb

import solution._apply as apply_mod
from solution.kernels import _launches, nf4_dequant
from solution.kernels.nf4_dequant import dequantize_nf4
from solution.patches._bnb import _PLANS, linear4bit_unsupported
from solution.patches import bnb_linear4bit
from solution.patches._base import Swaps
from tests.conftest import cast_launches, dequant_launches, rel_err


def make_linear4bit(in_f, out_f, bias=True, weight_dtype=torch.float16, nested=True, quant_type="nf4",
                    compute_dtype=torch.float16, device="cpu", seed=0):
    """A bnb Linear4bit like the workload's: NF4, double quant, fp16 compute, fp32 bias (what
    prepare_model_for_kbit_training leaves on q/k/v). Quantized from ``weight_dtype``."""
    g = torch.Generator().manual_seed(seed)
    lin = bnb.nn.Linear4bit(in_f, out_f, bias=bias, compute_dtype=compute_dtype,
                            compress_statistics=nested, quant_type=quant_type)
    w = (torch.randn(out_f, in_f, generator=g) * 0.05).to(weight_dtype)
    lin.weight = bnb.nn.Params4bit(w, requires_grad=False, compress_statistics=nested, quant_type=quant_type)
    if bias:
        lin.bias = torch.nn.Parameter(torch.randn(out_f, generator=g) * 0.1, requires_grad=False)
    return lin.to(device).train()


def bnb_dequant_rows(device) -> int:
    """Fewest rows M (tokens) for which bitsandbytes' gemm_4bit surely runs dequant + F.linear.

    CPU: any M (bnb's default gemm_4bit is dequant + F.linear). CUDA, read in bnb 0.50.2
    ``backends/cuda/ops.py``: ``M > _gemm_4bit_custom_max_m`` (1536) -> dequant + F.linear,
    always; ``M <= 4`` -> bnb's fused kernel, always; in between ``_gemm_4bit_use_custom_fn``
    (per architecture, weight size and SM count) decides, e.g. for a [128, 192] weight on an H200
    (sm_90, "small weight", < 1/4 wave) it picks the fused kernel up to M = 32, for larger small
    weights up to 320 / 512. Where bnb picks its fused kernel our patch leaves the call to bnb by
    design (its rounding differs), so GPU tests of our path need M > 1536."""
    if device != "cuda":
        return 1
    from bitsandbytes.backends.cuda import ops as cuda_ops

    return cuda_ops._gemm_4bit_custom_max_m + 1


def tokens(prefix, device) -> tuple:
    """Leading dims of a test input: ``prefix`` on the CPU; on CUDA its last entry grows until the
    row count exceeds bnb's fused-GEMM limit (``bnb_dequant_rows``)."""
    need = bnb_dequant_rows(device)
    if math.prod(prefix) >= need:
        return tuple(prefix)
    others = math.prod(prefix[:-1])
    return (*prefix[:-1], -(-need // others))


def fresh_x(shape, device, dtype=torch.float32, seed=1, pad_rows=0, noncontig=False):
    """Random activations; ``pad_rows`` zeroed trailing rows (right padding); ``noncontig`` a
    strided view."""
    g = torch.Generator().manual_seed(seed)
    if noncontig:
        full = torch.randn(*shape[:-1], shape[-1] * 2, generator=g)
        x = full.to(device=device, dtype=dtype)[..., ::2]
        assert not x.is_contiguous()
    else:
        x = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
    if pad_rows:
        x = x.clone()
        x[-1, -pad_rows:] = 0
    return x.requires_grad_(True)


class CountOps(TorchDispatchMode):
    """Records the aten ops (torch kernels, allocations, views) run inside the with-block, and
    each call of our Triton launchers as "triton" (what runs inside a launcher, e.g. the output
    allocation of lora_combine or the copies of Triton's CPU interpreter, is not recorded)."""

    def __init__(self, monkeypatch, launchers=()):
        """launchers: (owner, attribute) of further functions that launch Triton kernels."""
        super().__init__()
        self.ops = []
        from torch.utils._python_dispatch import _disable_current_modes

        for owner, attr in ((nf4_dequant.DequantPlan, "launch"), *launchers):
            original = getattr(owner, attr)

            def launch(*args, _original=original, **kwargs):
                self.ops.append("triton")
                with _disable_current_modes():
                    return _original(*args, **kwargs)

            monkeypatch.setattr(owner, attr, launch)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def take(self):
        """The ops recorded so far that launch work or allocate (views and metadata ops dropped);
        clears the record."""
        ops, self.ops = self.ops, []
        return [op for op in ops if op not in ("view", "t", "reshape", "_unsafe_view", "expand", "detach",
                                               "alias", "slice", "as_strided")]


class Patched:
    """Install the bnb_linear4bit patch for a with-block, restore exactly afterwards."""

    def __enter__(self):
        self.swaps = Swaps()
        bnb_linear4bit.install(self.swaps)
        return self

    def __exit__(self, *exc):
        self.swaps.restore()


def run(layer, x, grad_seed=2):
    x.grad = None
    if layer.bias is not None:
        layer.bias.grad = None
    out = layer(x)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out.device, out.dtype)
    out.backward(g)
    gb = None if layer.bias is None or layer.bias.grad is None else layer.bias.grad.clone()
    return out.detach(), x.grad.clone(), gb, g


def fp64_reference(layer, x, g):
    """out = fp16(x) @ W^T + fp16(bias) in fp64; grad_x = g @ W (W = bnb's fp16 weight)."""
    w = dequantize_nf4(layer.weight, layer.weight.quant_state).double()
    xh = x.detach().to(torch.float16).double()
    out = xh @ w.t()
    if layer.bias is not None:
        out = out + layer.bias.detach().to(torch.float16).double()
    return out, g.double() @ w


CASES = [
    # (in, out, x shape prefix, pad_rows, noncontig)
    (192, 128, (2, 7), 0, False),   # q/o-like (in > out here to stay small)
    (192, 32, (3, 5), 2, False),    # k/v-like, right-padded rows
    (256, 96, (2, 9), 0, True),     # strided (non-contiguous) input
    (99, 40, (4, 3), 0, False),     # odd in_features: 3960 elements, partial last block
    (130, 70, (1, 13), 1, False),   # 9100 elements, blocks spanning rows
]


@pytest.mark.parametrize("in_f,out_f,prefix,pad,noncontig", CASES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16])
def test_matches_stock_exactly(in_f, out_f, prefix, pad, noncontig, x_dtype, device):
    layer = make_linear4bit(in_f, out_f, device=device)
    x = fresh_x((*tokens(prefix, device), in_f), device, x_dtype, pad_rows=pad, noncontig=noncontig)
    assert linear4bit_unsupported(layer, x) is None  # our path on the CPU and on the GPU
    _launches.reset()
    with Patched():
        out, gx, _, g = run(layer, x)
    # forward + backward: one dequantization each, nothing kept in between; the fp16 cast of a
    # contiguous fp32 x (forward) and of the fp32 gradient (backward) ride in the same launch
    fwd_fused = x_dtype == torch.float32 and not noncontig
    bwd_fused = x_dtype == torch.float32
    assert cast_launches() == fwd_fused + bwd_fused
    assert dequant_launches() == 2
    assert layer.bias.dtype == torch.float16  # bnb's in-place bias cast happened on our path too
    ref_out, ref_gx, _, _ = run(layer, x)       # stock bnb
    assert out.dtype == ref_out.dtype == x_dtype and gx.dtype == x_dtype
    assert torch.equal(out, ref_out)
    assert torch.equal(gx, ref_gx)
    r_out, r_gx = fp64_reference(layer, x, g.to(torch.float16))
    # fp16 GEMM output (one rounding of a fp32-accumulated sum): per element <= 2^-11 relative
    assert rel_err(out, r_out) < 2e-3
    assert rel_err(gx, r_gx) < 2e-3


def test_torch_ops_per_call(device, monkeypatch):
    """The work of one forward + backward on our path (fp32 activations, as in training), pinned
    so that extra casts or copies show up: forward = 1 Triton launch (dequant + cast of x) +
    addmm (GEMM + bias) + cast back to fp32; backward = 1 Triton launch (dequant + cast of the
    gradient) + mm + cast back. Stock bnb on CUDA: 6 kernels forward, 6 backward."""
    layer = make_linear4bit(128, 64, device=device)
    x = fresh_x((*tokens((3, 4), device), 128), device)
    g = torch.randn(*x.shape[:-1], 64, device=device)
    with Patched():
        run(layer, x)  # builds the layer's plan and the scratch buffer
        x.grad = None
        _launches.reset()
        counter = CountOps(monkeypatch)
        with counter:
            out = layer(x)
        fwd = counter.take()
        with counter:
            out.backward(g)
        bwd = counter.take()
    assert dict(_launches.LAUNCHES) == {"nf4_dequant_cast": 2}
    assert fwd == ["empty", "triton", "addmm", "_to_copy"]
    assert bwd == ["empty", "triton", "mm", "_to_copy"]


def test_plan_cache_follows_the_layer(device):
    """The per-layer plan is reused while the weight is the same and rebuilt when it changes;
    layers of different sizes share (and grow) the scratch buffer without mixing weights."""
    small, big = make_linear4bit(64, 32, device=device, seed=3), make_linear4bit(192, 96, device=device, seed=4)
    xs = fresh_x((*tokens((2, 3), device), 64), device).detach()
    xb = fresh_x((*tokens((2, 3), device), 192), device).detach()
    ref_s, ref_b = small(xs), big(xb)
    with Patched():
        out_s = small(xs)
        plan = _PLANS[small]
        assert torch.equal(small(xs), out_s) and _PLANS[small] is plan  # cached
        assert torch.equal(big(xb), ref_b) and torch.equal(small(xs), ref_s)  # buffer grown, re-viewed
        # new quantized weight (what loading another checkpoint does): a new plan, new numbers
        small.weight = make_linear4bit(64, 32, device=device, seed=5).weight
        small.weight.module = small  # as bnb's from_prequantized loading sets it
        out_new = small(xs)
        assert _PLANS[small] is not plan
    assert torch.equal(out_new, small(xs)) and not torch.equal(out_new, ref_s)
    # the cache does not keep layers alive (Params4bit refers back to its module)
    import gc
    import weakref

    gone = weakref.ref(small)
    del small, plan
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_state_dtypes(weight_dtype, device):
    """Weights quantized from bf16 / fp32 (quant_state.dtype): bnb's forward dequantizes
    straight into fp16 but its backward into the state dtype then casts; ours follows both."""
    layer = make_linear4bit(192, 64, weight_dtype=weight_dtype, device=device)
    x = fresh_x((*tokens((3, 4), device), 192), device)
    with Patched():
        out, gx, _, _ = run(layer, x)
    ref_out, ref_gx, _, _ = run(layer, x)
    assert torch.equal(out, ref_out) and torch.equal(gx, ref_gx)


def test_trainable_bias(device):
    layer = make_linear4bit(128, 48, device=device)
    layer.bias.requires_grad_(True)
    x = fresh_x((*tokens((10,), device), 128), device)  # 2-D: bnb's MatMul4Bit sums the bias grad over dim 0 only
    with Patched():
        out, gx, gb, g = run(layer, x)
    ref_out, ref_gx, ref_gb, _ = run(layer, x)
    assert torch.equal(out, ref_out) and torch.equal(gx, ref_gx)
    assert gb.dtype == ref_gb.dtype == torch.float16
    # bias grad: an fp16 sum over rows; both sum in a fp32 accumulator, order may differ
    assert rel_err(gb, ref_gb) < 1e-3
    assert rel_err(gb, g.to(torch.float16).double().sum(0)) < 1e-3
    # 3-D input: ours sums over every leading dim (bnb's sum(0) would give the wrong shape)
    x3 = fresh_x((*tokens((2, 5), device), 128), device)
    with Patched():
        _, _, gb3, g3 = run(layer, x3)
    assert gb3.shape == (48,)
    assert rel_err(gb3, g3.to(torch.float16).double().reshape(-1, 48).sum(0)) < 1e-3


def test_no_grad_and_autocast(device):
    layer = make_linear4bit(192, 64, device=device)
    x = fresh_x((*tokens((2, 3), device), 192), device).detach()
    autocast = torch.autocast(device_type=device, dtype=torch.float16)
    _launches.reset()
    with torch.no_grad():
        with Patched():
            out = layer(x)
            with autocast:
                out_ac = layer(x)
        ref, ref_ac = layer(x), None
        with autocast:
            ref_ac = layer(x)
    assert cast_launches() == 2
    assert torch.equal(out, ref) and torch.equal(out_ac, ref_ac)


def test_unsupported_layers_use_stock(device):
    """FP4 and an fp32 compute dtype are left to bnb (no launch of ours, same result)."""
    for kwargs in ({"quant_type": "fp4"}, {"compute_dtype": torch.float32}):
        layer = make_linear4bit(128, 32, device=device, **kwargs)
        x = fresh_x((*tokens((4,), device), 128), device)
        assert linear4bit_unsupported(layer, x) is not None
        _launches.reset()
        with Patched():
            out, gx, _, _ = run(layer, x)
        assert sum(_launches.LAUNCHES.values()) == 0
        ref_out, ref_gx, _, _ = run(layer, x)
        assert torch.equal(out, ref_out) and torch.equal(gx, ref_gx)


def test_apply_revert_restores_original(monkeypatch):
    original = bnb.nn.Linear4bit.__dict__["forward"]
    monkeypatch.setattr(apply_mod, "PATCHES", ["solution.patches.bnb_linear4bit"])
    apply_mod.revert()
    try:
        installed = apply_mod.apply(verbose=False)
        assert "bnb_linear4bit" in installed
        assert bnb.nn.Linear4bit.__dict__["forward"] is not original
        assert bnb.nn.Linear4bit.__dict__["forward"].__wrapped__ is original
    finally:
        apply_mod.revert()
    assert bnb.nn.Linear4bit.__dict__["forward"] is original


# ---------------------------------------------------------------------------------------------
# GPU: the model's shapes and token counts

MODEL_LINEARS = [(1536, 1536, True), (1536, 256, True), (1536, 8960, False), (8960, 1536, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("in_f,out_f,bias", MODEL_LINEARS)
@pytest.mark.parametrize("tok", [(4, 512), (3, 500)])
def test_model_shapes_gpu(in_f, out_f, bias, tok):
    """M = 2048 and 1500 tokens (bnb uses dequant + cuBLAS at both on a T4 / H200 for these
    weights: 1500 <= 1536, but its heuristic keeps the fused kernel to M <= 512 at most for them):
    forward and input gradient identical to bnb's; under autocast as in training."""
    layer = make_linear4bit(in_f, out_f, bias=bias, device="cuda")
    x = fresh_x((*tok, in_f), "cuda")
    assert linear4bit_unsupported(layer, x) is None
    with torch.autocast("cuda", dtype=torch.float16):
        with Patched():
            out, gx, _, _ = run(layer, x)
        ref_out, ref_gx, _, _ = run(layer, x)
    assert torch.equal(out, ref_out)
    assert torch.equal(gx, ref_gx)


@pytest.mark.gpu
def test_small_m_left_to_bnb_gpu():
    """Few tokens: bnb runs its fused 4-bit GEMM; we leave the call to it (same numerics)."""
    layer = make_linear4bit(1536, 256, device="cuda")
    x = fresh_x((1, 4, 1536), "cuda")
    assert "fused small-M" in linear4bit_unsupported(layer, x)
    _launches.reset()
    with Patched():
        out, gx, _, _ = run(layer, x)
    ref_out, ref_gx, _, _ = run(layer, x)
    assert sum(_launches.LAUNCHES.values()) == 0
    assert torch.equal(out, ref_out) and torch.equal(gx, ref_gx)
