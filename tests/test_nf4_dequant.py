"""NF4 dequantization kernel vs bitsandbytes 0.50.2: bit for bit.

The oracle is bnb itself (``bitsandbytes.functional.dequantize_4bit``; on the GPU its CUDA
kernels, on the CPU its C++ kernel or its torch fallback for odd last dims). Exactness is the
contract, so every comparison is on the fp16 bit patterns (no tolerance), plus an independent
formula (``formula_ref``) built from the storage format with torch ops.

Found while writing these tests: bnb 0.50.2's CPU C++ kernel (cdequantize_blockwise_cpu_nf4_*)
indexes blocks wrongly when the last dim is a multiple of 16 but not of the blocksize (e.g.
[96, 160]: 10x the quantization error). Model shapes are multiples of 64 and unaffected; for those
shapes the CPU oracle is the formula (bnb's own torch fallback agrees with it), the GPU test
compares with bnb's CUDA kernel, which indexes the flat array.
"""
import math

import pytest
import torch

import bitsandbytes.functional as bnbF
from bitsandbytes.functional import QuantState

from solution.kernels import _launches
from solution.kernels.nf4_dequant import NF4_LEVELS, DequantPlan, dequantize_nf4, unsupported_reason
from tests.conftest import HAS_CUDA

# Qwen2.5-1.5B weight shapes [out, in]: q/o, k/v, gate/up, down
MODEL_SHAPES = [(1536, 1536), (256, 1536), (8960, 1536), (1536, 8960)]
# odd shapes: element count not a multiple of 64 (partial last block), odd last dim (a byte
# shared by two rows), a single element, fewer elements than one block, blocks spanning rows
ODD_SHAPES = [(7, 30), (3, 65), (5, 33), (1, 1), (2, 21), (129, 3), (96, 160)]


def quantize(shape, dtype=torch.float16, nested=True, device="cpu", blocksize=64, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = (torch.randn(shape, generator=g) * 0.02).to(dtype).to(device)
    # a few large outliers so block scales span a wide range (as in real checkpoints)
    w.view(-1)[:: max(1, w.numel() // 17)] *= 40
    return bnbF.quantize_4bit(w, blocksize=blocksize, compress_statistics=nested, quant_type="nf4")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def with_dtype(qs: QuantState, dtype) -> QuantState:
    """The same state with another output dtype: bnb then dequantizes straight into ``dtype``
    (what its gemm_4bit fallback does with the fp16 activation dtype)."""
    return QuantState(absmax=qs.absmax, shape=qs.shape, code=qs.code, blocksize=qs.blocksize,
                      quant_type=qs.quant_type, dtype=dtype, offset=qs.offset, state2=qs.state2)


def bnb_cpu_kernel_trusted(shape, blocksize=64) -> bool:
    return shape[-1] % 16 != 0 or shape[-1] % blocksize == 0


def formula_ref(packed: torch.Tensor, qs: QuantState) -> torch.Tensor:
    """Independent reference of the storage format: codes unpacked in Python/torch, scales
    rebuilt with bnb's two fp32 roundings, product in fp32, one rounding to fp16."""
    n = math.prod(qs.shape)
    flat = packed.reshape(-1).to(torch.int64).cpu()
    codes = torch.stack([flat >> 4, flat & 15], 1).reshape(-1)[:n]
    if qs.nested:
        q = qs.absmax.cpu().long()
        a2 = qs.state2.absmax.cpu().repeat_interleave(qs.state2.blocksize)[: q.numel()]
        scale = (qs.state2.code.cpu()[q] * a2).float() + qs.offset.cpu().float()  # two roundings
    else:
        scale = qs.absmax.cpu().float()
    table = torch.tensor(NF4_LEVELS, dtype=torch.float32)
    prod32 = table[codes] * scale.repeat_interleave(qs.blocksize)[:n]
    return prod32.to(torch.float16).reshape(qs.shape)


def test_nf4_table_is_bnbs():
    assert torch.equal(torch.tensor(NF4_LEVELS, dtype=torch.float32), bnbF.get_4bit_type("nf4", device="cpu"))


@pytest.mark.parametrize("shape", MODEL_SHAPES[:2] + ODD_SHAPES)
@pytest.mark.parametrize("nested", [True, False])
def test_bit_exact_fp16_state(shape, nested, device):
    packed, qs = quantize(shape, torch.float16, nested, device)
    ours = dequantize_nf4(packed, qs)
    assert same_bits(ours.cpu(), formula_ref(packed, qs))
    if device == "cuda" or bnb_cpu_kernel_trusted(shape):
        assert same_bits(ours, bnbF.dequantize_4bit(packed, qs))


@pytest.mark.parametrize("shape", [(256, 1536), (7, 30), (3, 65)])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32])
def test_bit_exact_other_state_dtypes(shape, state_dtype, device):
    """States quantized from bf16 / fp32 weights. rounding_dtype=state dtype reproduces bnb's
    backward (dequantize_4bit(...) in the state dtype, then .to(fp16)); the default reproduces
    bnb's forward (dequantized straight into the fp16 activation dtype)."""
    packed, qs = quantize(shape, state_dtype, True, device)
    ref_bwd = bnbF.dequantize_4bit(packed, qs).to(torch.float16)
    assert same_bits(dequantize_nf4(packed, qs, rounding_dtype=qs.dtype), ref_bwd)
    ref_fwd = bnbF.dequantize_4bit(packed, with_dtype(qs, torch.float16))
    assert same_bits(dequantize_nf4(packed, qs), ref_fwd)


@pytest.mark.parametrize("blocksize", [32, 128, 256])
def test_other_blocksizes(blocksize, device):
    shape = (24, 200)  # 200 % 16 != 0: bnb's CPU kernel is right here
    packed, qs = quantize(shape, torch.float16, True, device, blocksize=blocksize)
    ours = dequantize_nf4(packed, qs)
    assert same_bits(ours, bnbF.dequantize_4bit(packed, qs))
    assert same_bits(ours.cpu(), formula_ref(packed, qs))


def test_out_buffer_is_reused(device):
    packed, qs = quantize((96, 192), torch.float16, True, device)
    big = torch.full((96 * 192 + 50,), float("nan"), dtype=torch.float16, device=device)
    view = big[: 96 * 192]
    _launches.reset()
    res = dequantize_nf4(packed, qs, out=view)
    assert _launches.LAUNCHES["nf4_dequant"] == 1
    assert res.shape == (96, 192) and res.data_ptr() == big.data_ptr()
    assert same_bits(res, bnbF.dequantize_4bit(packed, qs))
    assert torch.isnan(big[96 * 192:]).all()  # nothing written past the weight
    with pytest.raises(ValueError):
        dequantize_nf4(packed, qs, out=torch.empty(10, dtype=torch.float16, device=device))


def test_rejects_fp4(device):
    w = torch.randn(8, 64, dtype=torch.float16, device=device)
    packed, qs = bnbF.quantize_4bit(w, quant_type="fp4")
    assert unsupported_reason(packed, qs) is not None
    with pytest.raises(ValueError):
        dequantize_nf4(packed, qs)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # the interpreter's numpy cast of 70000
@pytest.mark.parametrize("cast_b", [0, 1])
@pytest.mark.parametrize("state_dtype", [torch.float16, torch.bfloat16])
def test_fused_casts(cast_b, state_dtype, device):
    """The fused launch (nf4_dequant_cast_kernel): the weight bits are those of the plain kernel,
    the casts those of torch (fp32 -> fp16 round to nearest even, overflow to inf, subnormals),
    nothing written past the outputs; with dequant=False only the casts run. (NaN is left out: its
    payload bits are not part of the contract.)"""
    packed, qs = quantize((40, 96), state_dtype, True, device)
    plan = DequantPlan(packed, qs)
    g = torch.Generator().manual_seed(3)
    n = 3 * 1000 + 7  # odd: a partial last cast block
    a = (torch.randn(n, generator=g) * 3).to(device)
    a[:6] = torch.tensor([70000.0, -1e-6, 3e-8, -65520.0, float("inf"), 65519.0])  # overflow, subnormals...
    b = torch.randn(n, generator=g).to(device)
    for round_bf16 in (False, True):
        for dequant in (True, False):
            out = torch.full((40 * 96 + 8,), 7.0, dtype=torch.float16, device=device)
            a16 = torch.full((n + 8,), 7.0, dtype=torch.float16, device=device)
            b16 = torch.full((n + 8,), 7.0, dtype=torch.float16, device=device)
            _launches.reset()
            plan.launch(out[: 40 * 96], round_bf16, dequant=dequant, a=a, a16=a16[:n],
                        b=b if cast_b == 1 else None, b16=b16[:n] if cast_b else None, cast_b=cast_b, scaling=2.0)
            assert dict(_launches.LAUNCHES) == {("nf4_dequant_cast" if dequant else "fp16_cast"): 1}
            ref_w = dequantize_nf4(packed, qs, rounding_dtype=torch.bfloat16 if round_bf16 else torch.float16)
            if dequant:
                assert same_bits(out[: 40 * 96].view(40, 96), ref_w)
            else:
                assert (out == 7).all()
            assert (out[40 * 96:] == 7).all()
            assert same_bits(a16[:n], a.to(torch.float16)) and (a16[n:] == 7).all()
            if cast_b == 1:
                assert same_bits(b16[:n], b.to(torch.float16))
            if cast_b:
                assert (b16[n:] == 7).all()


@pytest.mark.parametrize("shape", MODEL_SHAPES[2:])
def test_bit_exact_mlp_shapes_cpu(shape):
    """The two big MLP shapes through the interpreter too (a few seconds each)."""
    if HAS_CUDA:
        pytest.skip("covered by the GPU test")
    packed, qs = quantize(shape, torch.float16, True, "cpu")
    assert same_bits(dequantize_nf4(packed, qs), bnbF.dequantize_4bit(packed, qs))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", MODEL_SHAPES + ODD_SHAPES)
@pytest.mark.parametrize("state_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("nested", [True, False])
def test_bit_exact_gpu(shape, state_dtype, nested):
    """On the GPU against bnb's CUDA kernels: every model shape, both state dtypes, with and
    without double quantization. A fused multiply-add in the scale (code2*absmax2 + offset)
    would show up here as 1-ulp differences in some blocks."""
    packed, qs = quantize(shape, state_dtype, nested, "cuda")
    ref_fwd = bnbF.dequantize_4bit(packed, with_dtype(qs, torch.float16))
    assert same_bits(dequantize_nf4(packed, qs), ref_fwd)
    ref_bwd = bnbF.dequantize_4bit(packed, qs).to(torch.float16)
    assert same_bits(dequantize_nf4(packed, qs, rounding_dtype=qs.dtype), ref_bwd)
    if state_dtype == torch.float16:
        assert same_bits(dequantize_nf4(packed, qs).cpu(), formula_ref(packed, qs))
