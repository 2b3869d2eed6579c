"""The frozen NF4 linear's pieces against bitsandbytes itself: solution/kernels/nf4_linear.py
(``LinearPlan``: ``dequant_and_cast``, ``input_grad16``, ``round_bwd``; ``input_reason``; the
shared scratch buffer) and solution/patches/_bnb.py (the per-layer plan cache ``linear_plan``,
``call_reason``, ``linear4bit_bias``, ``release``).

The decoder-layer node (solution/step/layer.py) runs k_proj, o_proj and the q / v base layers as
``w16, x16 = plan.dequant_and_cast(x)``; ``F.linear(x16, w16, linear4bit_bias(layer))``; in backward
``plan.input_grad16(fp16(grad))``. bitsandbytes 0.50.2's ``Linear4bit.forward`` computes
``x.to(fp16)``, casts the bias parameter to fp16 in place, dequantizes the weight straight into fp16
and calls ``F.linear`` (its CPU gemm_4bit, and its CUDA one above 1536 rows), then casts the output
back to x's dtype; ``MatMul4Bit.backward`` computes ``fp16(grad) @ dequantize_4bit(W).to(fp16)``,
the weight dequantized into the state's dtype first. With the same fp16 operands the same GEMMs
give the same bits, so everything here is compared EXACTLY (``torch.equal``) with bnb's own
``dequantize_4bit``, ``x.to(torch.float16)`` and its ``Linear4bit`` forward / backward (autograd), on
fresh random inputs: odd sizes, right-padding rows, non-contiguous inputs, fp32 / fp16 / bf16
inputs, nested (double quant) and plain quant states quantized from fp16 / bf16 / fp32. An fp64
reference checks the arithmetic independently of both.

The layers' in_features avoid multiples of 16 that are not multiples of 64: bitsandbytes 0.50's
native CPU dequantization is wrong there (tests/test_nf4_dequant.py, tests/test_default_stack.py).

Every test runs on the ``device`` fixture (the GPU when there is one, else Triton's interpreter).
On CUDA bnb runs its own fused 4-bit GEMM for few rows (another rounding; the node does not mirror
it), so there the inputs get more than 1536 rows (``tokens``); the CPU keeps small shapes.
"""
import copy
import gc
import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import bitsandbytes as bnb
import bitsandbytes.functional as bnbF
from bitsandbytes.functional import QuantState

from solution.kernels import _launches, nf4_dequant, nf4_linear
from solution.kernels.nf4_linear import LinearPlan, input_reason
from solution.patches import _bnb
from solution.patches._bnb import call_reason, linear4bit_bias, linear_plan
from tests.conftest import rel_err

F16 = torch.float16


def make_linear4bit(in_f, out_f, bias=True, weight_dtype=torch.float16, nested=True, quant_type="nf4",
                    compute_dtype=torch.float16, device="cpu", seed=0):
    """A bnb Linear4bit like the workload's: NF4, double quant, fp16 compute, fp32 bias (what
    prepare_model_for_kbit_training leaves on q/k/v). Quantized from ``weight_dtype`` (the state's
    dtype)."""
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
    always; below, bnb may pick its fused kernel (per architecture, weight size and SM count),
    whose rounding differs from dequant + cuBLAS, so GPU comparisons with bnb need M > 1536."""
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
    """Random activations (no grad); ``pad_rows`` zeroed trailing rows of the last batch row (right
    padding); ``noncontig`` a strided view."""
    g = torch.Generator().manual_seed(seed)
    if noncontig:
        full = torch.randn(*shape[:-1], shape[-1] * 2, generator=g)
        x = full.to(device=device, dtype=dtype)[..., ::2]
        assert not x.is_contiguous()
    else:
        x = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
    if pad_rows:
        x[-1, -pad_rows:] = 0
    return x


def with_dtype(qs: QuantState, dtype) -> QuantState:
    """The same state with another output dtype: bnb's dequantize_4bit then produces ``dtype``
    directly (what its gemm_4bit does with the fp16 activations' dtype in the forward)."""
    return QuantState(absmax=qs.absmax, shape=qs.shape, code=qs.code, blocksize=qs.blocksize,
                      quant_type=qs.quant_type, dtype=dtype, offset=qs.offset, state2=qs.state2)


def bnb_weight16(layer, backward=False) -> torch.Tensor:
    """bitsandbytes' fp16 weight: forward (gemm_4bit) dequantizes straight into fp16; backward
    (MatMul4Bit) into the state's dtype, then ``.to(fp16)``."""
    w, qs = layer.weight, layer.weight.quant_state
    if backward:
        return bnbF.dequantize_4bit(w.data, qs).to(F16)
    return bnbF.dequantize_4bit(w.data, with_dtype(qs, F16))


def stock(layer, x, g):
    """(out, dx): bnb's own Linear4bit forward and MatMul4Bit backward (autograd)."""
    xx = x.detach().requires_grad_(True)
    out = layer(xx)
    return out.detach(), torch.autograd.grad(out, xx, g)[0]


def ours(layer, x, g):
    """What the node computes for a frozen NF4 linear: (out, dx, w_fwd, x16, w_bwd). The weights
    are copied out of the scratch buffer, which the next dequantization overwrites."""
    plan = linear_plan(layer)
    assert call_reason(plan, layer, x) is None, call_reason(plan, layer, x)
    w16, x16 = plan.dequant_and_cast(x)
    out = F.linear(x16, w16, linear4bit_bias(layer)).to(x.dtype)
    w_fwd = w16.clone()
    dx = plan.input_grad16(g.to(F16)).to(x.dtype)  # autograd's backward of out.to(x.dtype): g cast to fp16
    return out, dx, w_fwd, x16, plan.weight16().clone()


def fp64_reference(layer, x, g):
    """out = fp16(x) @ W^T + fp16(bias) and dx = fp16(g) @ W in fp64 (W: bnb's fp16 weights)."""
    w_f = bnb_weight16(layer).double()
    w_b = bnb_weight16(layer, backward=True).double()
    out = x.to(F16).double() @ w_f.t()
    if layer.bias is not None:
        out = out + layer.bias.detach().to(F16).double()
    return out, g.to(F16).double() @ w_b


def assert_fp64_anchored(o, s, r, dtype):
    """Ours ``o`` within 2x stock's ``s`` own error against the fp64 reference ``r`` (both compute
    the same fp16 GEMM of the same operands; a lost term or a wrong weight would be many times
    stock's error), and stock itself within 4 roundings of the output's precision (fp16 GEMM
    output, 2^-11 relative each, or the bf16 copy's 2^-8): a check on the reference itself."""
    u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    e_stock = rel_err(s, r)
    assert e_stock < 4 * u, e_stock
    assert rel_err(o, r) <= 2 * e_stock + 2.0 ** -30, (rel_err(o, r), e_stock)


class CountOps(TorchDispatchMode):
    """Records the aten ops (torch kernels, allocations, views) run inside the with-block, and
    each call of our Triton launchers as "triton" (what runs inside a launcher, e.g. the copies of
    Triton's CPU interpreter, is not recorded)."""

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


CASES = [
    # (in, out, x shape prefix, pad_rows, noncontig)
    (192, 128, (2, 7), 0, False),   # q/o-like (in > out here to stay small)
    (192, 32, (3, 5), 2, False),    # k/v-like, right-padded rows
    (256, 96, (2, 9), 0, True),     # strided (non-contiguous) input
    (99, 40, (4, 3), 0, False),     # odd in_features: 3960 elements, partial last block
    (130, 70, (1, 13), 1, False),   # 9100 elements, blocks spanning rows
]


@pytest.mark.parametrize("in_f,out_f,prefix,pad,noncontig", CASES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_plan_matches_bnb_exactly(in_f, out_f, prefix, pad, noncontig, x_dtype, device):
    """dequant_and_cast: bnb's forward weight and ``x.to(fp16)``; input_grad16: bnb's backward
    weight and GEMM; F.linear on them: bnb's Linear4bit output and input gradient, all bit for bit.
    One launch each way: the fp16 cast of an fp32 contiguous x rides in the forward's
    dequantization launch (others are torch's casts, as bnb's), the backward only dequantizes."""
    layer = make_linear4bit(in_f, out_f, device=device, seed=in_f)
    x = fresh_x((*tokens(prefix, device), in_f), device, x_dtype, pad_rows=pad, noncontig=noncontig)
    g = fresh_x((*x.shape[:-1], out_f), device, x_dtype, seed=2)
    _launches.reset()
    out, dx, w_fwd, x16, w_bwd = ours(layer, x, g)
    fused = x_dtype == torch.float32 and not noncontig
    assert dict(_launches.LAUNCHES) == ({"nf4_dequant_cast": 1, "nf4_dequant": 1} if fused else {"nf4_dequant": 2})
    assert torch.equal(w_fwd, bnb_weight16(layer)) and torch.equal(w_bwd, bnb_weight16(layer, backward=True))
    assert x16.dtype == F16 and torch.equal(x16, x.to(F16))
    ref_out, ref_dx = stock(layer, x, g)
    assert out.dtype == ref_out.dtype == x_dtype and dx.dtype == ref_dx.dtype == x_dtype
    assert torch.equal(out, ref_out)
    assert torch.equal(dx, ref_dx)
    r_out, r_dx = fp64_reference(layer, x, g)
    assert_fp64_anchored(out, ref_out, r_out, x_dtype)
    assert_fp64_anchored(dx, ref_dx, r_dx, x_dtype)


@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize("weight_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_state_dtypes(weight_dtype, nested, device):
    """Weights quantized from fp16 / bf16 / fp32 (``quant_state.dtype``), with and without double
    quantization: bnb's forward dequantizes straight into fp16, its backward into the state dtype
    and then casts (a second rounding for bf16: ``round_bwd``); the plan follows both, bit for bit."""
    layer = make_linear4bit(192, 64, weight_dtype=weight_dtype, nested=nested, device=device, seed=3)
    qs = layer.weight.quant_state
    assert qs.dtype == weight_dtype and bool(qs.nested) == nested
    plan = linear_plan(layer)
    assert plan.reason is None and plan.round_bwd == (weight_dtype == torch.bfloat16)
    x = fresh_x((*tokens((3, 4), device), 192), device)
    g = fresh_x((*x.shape[:-1], 64), device, seed=2)
    out, dx, w_fwd, _, w_bwd = ours(layer, x, g)
    assert torch.equal(w_fwd, bnb_weight16(layer)) and torch.equal(w_bwd, bnb_weight16(layer, backward=True))
    # the bf16 case really is another weight in backward (else the test could not tell the chains apart)
    assert torch.equal(w_fwd, w_bwd) == (weight_dtype != torch.bfloat16)
    ref_out, ref_dx = stock(layer, x, g)
    assert torch.equal(out, ref_out) and torch.equal(dx, ref_dx)


def test_bias_cast_as_bnb(device):
    """linear4bit_bias: bnb's forward side effect (the fp32 bias parameter cast to fp16 IN PLACE,
    the same Parameter object), and the tensor bnb adds; None without a bias."""
    layer, twin = make_linear4bit(128, 48, device=device, seed=5), make_linear4bit(128, 48, device=device, seed=5)
    param, fp32_bias = layer.bias, layer.bias.detach().clone()
    assert param.dtype == torch.float32
    twin(fresh_x((*tokens((4,), device), 128), device))  # stock's forward casts twin's bias
    bias16 = linear4bit_bias(layer)
    assert bias16 is param and layer.bias is param and param.dtype == F16
    assert torch.equal(param, twin.bias) and torch.equal(param, fp32_bias.to(F16))
    assert linear4bit_bias(layer) is param and torch.equal(param, twin.bias)  # already fp16: unchanged
    assert linear4bit_bias(make_linear4bit(128, 48, bias=False, device=device)) is None


def test_ops_per_call(device, monkeypatch):
    """The work of one call on the node's path, pinned so that an extra cast, copy or weight
    allocation shows up: dequant_and_cast of an fp32 x = the fp16 x16 allocation + 1 Triton launch
    (the weight goes into the reused scratch buffer); input_grad16 = 1 Triton launch + the GEMM.
    (Stock bnb on CUDA: 6 kernels forward, 6 backward.)"""
    layer = make_linear4bit(128, 64, device=device)
    plan = linear_plan(layer)
    x = fresh_x((*tokens((3, 4), device), 128), device)
    g16 = fresh_x((*x.shape[:-1], 64), device, F16, seed=2)
    plan.dequant_and_cast(x)  # the scratch buffer exists (grown if needed) before counting
    counter = CountOps(monkeypatch)
    with counter:
        plan.dequant_and_cast(x)
    assert counter.take() == ["empty", "triton"]
    with counter:
        plan.input_grad16(g16)
    assert counter.take() == ["triton", "mm"]


def test_plan_cache_follows_the_layer(device):
    """linear_plan: one plan per layer, reused while its weight, quant state and compute dtype are
    the same objects, rebuilt when one changes (a new weight gives new numbers: bnb's); layers of
    different sizes share the scratch buffer, which grows and is re-viewed without mixing weights;
    the cache keeps no layer alive (bnb's Params4bit refers back to its module)."""
    _bnb.release()  # start from no scratch buffer, so that the big layer grows it
    small, big = make_linear4bit(64, 32, device=device, seed=3), make_linear4bit(192, 96, device=device, seed=4)
    xs, xb = fresh_x((*tokens((2, 3), device), 64), device), fresh_x((*tokens((2, 3), device), 192), device)
    gs, gb = fresh_x((*xs.shape[:-1], 32), device, seed=2), fresh_x((*xb.shape[:-1], 96), device, seed=2)
    plan = linear_plan(small)
    assert linear_plan(small) is plan and plan.reason is None  # cached
    out_s = ours(small, xs, gs)[0]
    assert torch.equal(out_s, stock(small, xs, gs)[0])
    base = plan.weight16()
    assert torch.equal(ours(big, xb, gb)[0], stock(big, xb, gb)[0])  # the buffer grows for the big weight
    assert plan.weight16().data_ptr() != base.data_ptr()  # the small plan re-views the grown buffer
    assert plan.weight16().data_ptr() == linear_plan(big).weight16().data_ptr()  # one shared buffer
    assert torch.equal(ours(small, xs, gs)[0], out_s) and linear_plan(small) is plan
    # a new quantized weight (what loading another checkpoint does): a new plan, bnb's new numbers
    small.weight = make_linear4bit(64, 32, device=device, seed=5).weight
    new_plan = linear_plan(small)
    assert new_plan is not plan
    out_new = ours(small, xs, gs)[0]
    assert torch.equal(out_new, stock(small, xs, gs)[0]) and not torch.equal(out_new, out_s)
    # a new quant state object on the same weight: rebuilt too
    small.weight.quant_state = copy.copy(small.weight.quant_state)
    assert linear_plan(small) is not new_plan
    gone = weakref.ref(small)
    del small, plan, new_plan
    gc.collect()
    assert gone() is None


def test_plan_follows_compute_dtype(device):
    """The compute dtype is read from the layer (None until bnb fixed it: left to bnb): a layer
    built without one is refused, after bnb's forward on fp32 x it computes in fp32 (refused), once
    it is fp16 the plan is rebuilt and taken, with bnb's results."""
    layer = make_linear4bit(128, 48, compute_dtype=None, device=device, seed=6)
    x = fresh_x((*tokens((2, 3), device), 128), device)
    plan = linear_plan(layer)
    assert plan.compute_dtype is None and "compute dtype None" in plan.reason
    assert call_reason(plan, layer, x) == plan.reason
    layer(x)  # bnb's set_compute_type: fp32 input -> fp32 compute
    assert layer.compute_type_is_set and layer.compute_dtype == torch.float32
    plan32 = linear_plan(layer)
    assert plan32 is not plan and "compute dtype torch.float32" in plan32.reason
    layer.compute_dtype = F16
    plan16 = linear_plan(layer)
    assert plan16 is not plan32 and plan16.reason is None and plan16.compute_dtype is F16
    g = fresh_x((*x.shape[:-1], 48), device, seed=2)
    out, dx = ours(layer, x, g)[:2]
    ref_out, ref_dx = stock(layer, x, g)
    assert torch.equal(out, ref_out) and torch.equal(dx, ref_dx)


def test_quant_state_repair_as_bnb(device):
    """A weight that lost its quant_state (e.g. after an FSDP-style conversion) is repaired from the
    module's as bnb's forward does first (``fix_4bit_weight_quant_state_from_module``)."""
    layer = make_linear4bit(128, 48, device=device, seed=7)
    qs = layer.weight.quant_state
    layer.quant_state = qs  # what bnb's quantization sets when the Params4bit knows its module
    layer.weight.quant_state = None
    plan = linear_plan(layer)
    assert layer.weight.quant_state is qs and plan.qs is qs and plan.reason is None
    x = fresh_x((*tokens((5,), device), 128), device)
    g = fresh_x((*x.shape[:-1], 48), device, seed=2)
    out, dx = ours(layer, x, g)[:2]
    ref_out, ref_dx = stock(layer, x, g)
    assert torch.equal(out, ref_out) and torch.equal(dx, ref_dx)


def test_release_drops_plans_and_scratch(device):
    """_bnb.release(): the layers' plans and the scratch buffers dropped; the next call builds them
    again, with the same bits."""
    layer = make_linear4bit(99, 40, device=device, seed=8)
    x = fresh_x((*tokens((6,), device), 99), device)
    g = fresh_x((*x.shape[:-1], 40), device, seed=2)
    first = ours(layer, x, g)
    plan = linear_plan(layer)
    _bnb.release()
    assert layer not in _bnb._PLANS and not nf4_linear._scratch
    again = ours(layer, x, g)
    assert linear_plan(layer) is not plan
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def _nested_state_with_blocksize(qs, blocksize):
    qs2 = copy.copy(qs)
    qs2.state2 = copy.copy(qs.state2)
    qs2.state2.blocksize = blocksize
    return qs2


def test_unsupported_layers_reasons(device):
    """Layers our path does not take say why (``LinearPlan.reason``), and every call on them says
    the same first (``input_reason`` / ``call_reason``): FP4, a compute dtype other than fp16, a
    nested state whose second-level blocksize is not 256 (bnb raises there), a weight repacked for
    bnb's CPU inference. The node then refuses the layer: stock's forward runs."""
    cases = {
        "is not nf4": make_linear4bit(128, 32, quant_type="fp4", device=device),
        "compute dtype torch.float32": make_linear4bit(128, 32, compute_dtype=torch.float32, device=device),
        "compute dtype torch.bfloat16": make_linear4bit(128, 32, compute_dtype=torch.bfloat16, device=device),
    }
    nested = make_linear4bit(128, 32, device=device)
    nested.weight.quant_state = _nested_state_with_blocksize(nested.weight.quant_state, 128)
    cases["second-level blocksize != 256"] = nested
    repacked = make_linear4bit(128, 32, device=device)
    repacked.weight.quant_state = copy.copy(repacked.weight.quant_state)
    repacked.weight.quant_state.packing_format_for_cpu = True
    cases["repacked for bnb's CPU inference"] = repacked
    for words, layer in cases.items():
        plan = linear_plan(layer)
        assert plan.reason is not None and words in plan.reason, (words, plan.reason)
        x = fresh_x((*tokens((4,), device), 128), device)
        assert input_reason(plan, x) == call_reason(plan, layer, x) == plan.reason
    # the same layer with a state our path takes: no reason
    assert linear_plan(make_linear4bit(128, 32, device=device)).reason is None


def test_input_reasons(device):
    """input_reason for one supported layer: None for fp32 / fp16 / bf16 inputs of the right width
    (any leading dims, strided), else why not: the input dtype, another device, a wrong width, an
    empty or 0-dim input."""
    layer = make_linear4bit(128, 32, device=device)
    plan = linear_plan(layer)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert input_reason(plan, fresh_x((3, 128), device, dtype)) is None
    assert input_reason(plan, fresh_x((2, 3, 128), device, noncontig=True)) is None
    assert input_reason(plan, torch.zeros(128, device=device)) is None  # one row, 1-D
    assert "input dtype torch.float64" in input_reason(plan, torch.zeros(3, 128, dtype=torch.float64, device=device))
    assert "input dtype torch.int64" in input_reason(plan, torch.zeros(3, 128, dtype=torch.long, device=device))
    assert "different devices" in input_reason(plan, torch.empty(3, 128, device="meta"))
    assert "shapes" in input_reason(plan, torch.zeros(3, 127, device=device))
    assert "shapes" in input_reason(plan, torch.zeros(0, 128, device=device))
    assert "shapes" in input_reason(plan, torch.zeros((), device=device))


def test_cpu_inference_repacking_left_to_bnb(device, monkeypatch):
    """call_reason: bnb's forward repacks the weight for its AVX512-BF16 CPU inference kernel (CPU,
    eval mode, no grad); that call is left to bnb. Training, or an input that needs a gradient, or
    a CUDA weight: our path."""
    layer = make_linear4bit(128, 32, device=device)
    monkeypatch.setattr(layer, "support_avx512bf16_for_cpu", True)
    plan = linear_plan(layer)
    x = fresh_x((4, 128), device)
    assert call_reason(plan, layer, x) is None  # training
    layer.eval()
    reason = call_reason(plan, layer, x)
    assert reason == (None if device == "cuda" else "bnb's CPU inference repacking path")
    assert call_reason(plan, layer, x.clone().requires_grad_(True)) is None


# ---------------------------------------------------------------------------------------------
# GPU: the model's shapes and token counts

MODEL_LINEARS = [(1536, 1536, True), (1536, 256, True), (1536, 8960, False), (8960, 1536, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("in_f,out_f,bias", MODEL_LINEARS)
def test_model_shapes_gpu(in_f, out_f, bias):
    """Qwen2.5-1.5B's linears, [4, 512, in] fp32 activations (2048 rows: bnb runs dequant + cuBLAS),
    under fp16 autocast as in training: the weights, output and input gradient identical to bnb's."""
    layer = make_linear4bit(in_f, out_f, bias=bias, device="cuda")
    x = fresh_x((4, 512, in_f), "cuda")
    g = fresh_x((4, 512, out_f), "cuda", seed=2)
    with torch.autocast("cuda", dtype=F16):
        out, dx, w_fwd, x16, w_bwd = ours(layer, x, g)
        ref_out, ref_dx = stock(layer, x, g)
    assert torch.equal(w_fwd, bnb_weight16(layer)) and torch.equal(w_bwd, bnb_weight16(layer, backward=True))
    assert torch.equal(out, ref_out)
    assert torch.equal(dx, ref_dx)
    assert isinstance(linear_plan(layer), LinearPlan) and linear_plan(layer).on_cuda
