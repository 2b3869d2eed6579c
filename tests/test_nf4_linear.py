"""Frozen NF4 linear (our dequant kernel + cuBLAS) vs bitsandbytes' own Linear4bit.forward.

Stock and ours run on the same layer and the same inputs. bnb's CPU path is dequant + F.linear
(its gemm_4bit default op), the GPU path at M > 1536 is dequant + F.linear too, so with the same
fp16 weight bits the forward and the input gradient must be EQUAL, not merely close. An fp64
reference checks the math independently.
"""
import pytest
import torch

import bitsandbytes as bnb

import solution._apply as apply_mod
from solution.kernels import _launches
from solution.kernels.nf4_dequant import dequantize_nf4
from solution.patches import bnb_linear4bit
from solution.patches._base import Swaps
from tests.conftest import rel_err


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
    x = fresh_x((*prefix, in_f), device, x_dtype, pad_rows=pad, noncontig=noncontig)
    _launches.reset()
    with Patched():
        out, gx, _, g = run(layer, x)
    assert _launches.LAUNCHES["nf4_dequant"] == 2  # forward + backward, nothing kept in between
    assert layer.bias.dtype == torch.float16  # bnb's in-place bias cast happened on our path too
    ref_out, ref_gx, _, _ = run(layer, x)       # stock bnb
    assert out.dtype == ref_out.dtype == x_dtype and gx.dtype == x_dtype
    assert torch.equal(out, ref_out)
    assert torch.equal(gx, ref_gx)
    r_out, r_gx = fp64_reference(layer, x, g.to(torch.float16))
    # fp16 GEMM output (one rounding of a fp32-accumulated sum): per element <= 2^-11 relative
    assert rel_err(out, r_out) < 2e-3
    assert rel_err(gx, r_gx) < 2e-3


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_state_dtypes(weight_dtype, device):
    """Weights quantized from bf16 / fp32 (quant_state.dtype): bnb's forward dequantizes
    straight into fp16 but its backward into the state dtype then casts; ours follows both."""
    layer = make_linear4bit(192, 64, weight_dtype=weight_dtype, device=device)
    x = fresh_x((3, 4, 192), device)
    with Patched():
        out, gx, _, _ = run(layer, x)
    ref_out, ref_gx, _, _ = run(layer, x)
    assert torch.equal(out, ref_out) and torch.equal(gx, ref_gx)


def test_trainable_bias(device):
    layer = make_linear4bit(128, 48, device=device)
    layer.bias.requires_grad_(True)
    x = fresh_x((10, 128), device)  # 2-D: bnb's MatMul4Bit sums the bias grad over dim 0 only
    with Patched():
        out, gx, gb, g = run(layer, x)
    ref_out, ref_gx, ref_gb, _ = run(layer, x)
    assert torch.equal(out, ref_out) and torch.equal(gx, ref_gx)
    assert gb.dtype == ref_gb.dtype == torch.float16
    # bias grad: an fp16 sum over rows; both sum in a fp32 accumulator, order may differ
    assert rel_err(gb, ref_gb) < 1e-3
    assert rel_err(gb, g.to(torch.float16).double().sum(0)) < 1e-3
    # 3-D input: ours sums over every leading dim (bnb's sum(0) would give the wrong shape)
    x3 = fresh_x((2, 5, 128), device)
    with Patched():
        _, _, gb3, g3 = run(layer, x3)
    assert gb3.shape == (48,)
    assert rel_err(gb3, g3.to(torch.float16).double().reshape(-1, 48).sum(0)) < 1e-3


def test_no_grad_and_autocast(device):
    layer = make_linear4bit(192, 64, device=device)
    x = fresh_x((2, 3, 192), device).detach()
    autocast = torch.autocast(device_type=device, dtype=torch.float16)
    with torch.no_grad():
        with Patched():
            out = layer(x)
            with autocast:
                out_ac = layer(x)
        ref, ref_ac = layer(x), None
        with autocast:
            ref_ac = layer(x)
    assert torch.equal(out, ref) and torch.equal(out_ac, ref_ac)


def test_unsupported_layers_use_stock(device):
    """FP4 and an fp32 compute dtype are left to bnb (no launch of ours, same result)."""
    for kwargs in ({"quant_type": "fp4"}, {"compute_dtype": torch.float32}):
        layer = make_linear4bit(128, 32, device=device, **kwargs)
        x = fresh_x((4, 128), device)
        _launches.reset()
        with Patched():
            out, gx, _, _ = run(layer, x)
        assert _launches.LAUNCHES["nf4_dequant"] == 0
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
@pytest.mark.parametrize("tokens", [(4, 512), (3, 500)])
def test_model_shapes_gpu(in_f, out_f, bias, tokens):
    """M = 2048 and 1500 tokens (bnb uses dequant + cuBLAS at both on a T4 / H200 for these
    weights): forward and input gradient identical to bnb's; under autocast as in training."""
    layer = make_linear4bit(in_f, out_f, bias=bias, device="cuda")
    x = fresh_x((*tokens, in_f), "cuda")
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
    _launches.reset()
    with Patched():
        out, gx, _, _ = run(layer, x)
    ref_out, ref_gx, _, _ = run(layer, x)
    assert _launches.LAUNCHES["nf4_dequant"] == 0
    assert torch.equal(out, ref_out) and torch.equal(gx, ref_gx)
