"""LoRA on a frozen NF4 linear (q_proj / v_proj) as the decoder-layer node (solution/step/layer.py)
runs it, piece by piece: solution/kernels/lora_nf4.py's ``lora_dropout`` (``draws``,
``padded_draw_shape``, ``draw_padded_mask``), ``dequant_and_cast_inputs``, ``lora_forward_gemms``,
``lora_backward_gemms``, ``cast_pair`` / ``cast_four`` / ``cast_grads``, against real peft (0.21)
``lora.bnb.Linear4bit`` on a real bnb Linear4bit and against torch.

- Forward. Under torch.autocast(fp16) peft computes ``base_layer(x)`` (bnb: fp16(x) @ W^T + fp16
  bias, back to x's dtype) and ``lora_B(lora_A(dropout(x))) * scaling`` (fp16 GEMMs on autocast's
  fp16 casts). ``lora_forward_gemms`` makes those GEMMs on the same fp16 operands (one launch
  dequantizes W and casts x and dropout(x); one casts A and B), so its base and LoRA outputs, and
  their sum made with torch as peft makes it (the node makes it in kernels/qkv_rope.py), are EQUAL
  to peft's, with the same dropout draws (same seed).
- Dropout. ``lora_dropout`` runs the op torch's F.dropout runs (the CPU's Bernoulli noise, CUDA's
  native_dropout) and keeps the mask; on packed rows it draws over stock's padded shape: the same
  mask bits as stock's ``nn.Dropout`` on the padded tensor, the generator left where stock leaves it.
- Backward. ``lora_backward_gemms`` + ``cast_grads`` (the sums and dropout's backward made with
  torch here; the node's kernels/qkv_grad.py makes them) against autograd through peft's layer:
  the same GEMMs, so equal on the CPU; on a GPU cuBLAS may pick other kernels for other GEMM shapes
  (peft's weight gradients come from 3-D autograd matmuls), so gradients there get a tolerance.
- Casts: the very bits of torch's ``.to``.
An fp64 reference checks the arithmetic of the whole layer independently of both.

On the CPU, peft decides "autocast or not" with ``torch.is_autocast_enabled()`` (the CUDA
autocast); the fixture ``autocast_ctx`` makes that question mean the CPU autocast there, so peft
takes the same branch as in GPU training. Every test runs on the ``device`` fixture; on CUDA the
row count is raised above bnb's fused small-M GEMM limit (``tokens``, tests/test_nf4_linear.py),
where bnb computes dequant + cuBLAS as the node does.
"""
import pytest
import torch
from peft import LoraConfig
from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit

from solution.kernels import _launches, lora_nf4
from solution.patches._bnb import linear4bit_bias, linear_plan
from solution.step import packing
from tests.conftest import cast_launches, dequant_launches, rel_err
from tests.test_nf4_linear import CountOps, bnb_weight16, fresh_x, make_linear4bit, tokens

F16 = torch.float16
R, ALPHA = 16, 32  # the workload's LoRA: scaling 2.0


def make_lora_layer(in_f, out_f, dropout, lora_dtype, device, seed=0):
    """peft's lora.bnb.Linear4bit over ``make_linear4bit``; random A and B (peft initialises B to
    zero: random ones make every gradient non-trivial) in ``lora_dtype``."""
    base = make_linear4bit(in_f, out_f, bias=True, device=device, seed=seed)
    cfg = LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=dropout, target_modules=["q_proj"], bias="none")
    layer = LoraLinear4bit(base, "default", config=cfg, r=R, lora_alpha=ALPHA)
    g = torch.Generator().manual_seed(seed + 7)
    for lin in (layer.lora_A["default"], layer.lora_B["default"]):
        lin.weight = torch.nn.Parameter((torch.randn(lin.weight.shape, generator=g) * 0.05).to(device, lora_dtype))
    return layer.train()


def parts(layer):
    """(base layer, A, B, dropout module, scaling) of the active adapter."""
    return (layer.get_base_layer(), layer.lora_A["default"].weight, layer.lora_B["default"].weight,
            layer.lora_dropout["default"], layer.scaling["default"])


class NativeDropout(torch.nn.Module):
    """Dropout through torch.native_dropout (what nn.Dropout runs on CUDA), for any device."""

    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x):
        return torch.native_dropout(x, self.p, self.training)[0]


def ours(layer, x, g, seed=123, packed=None, defer=False):
    """The node's q / v projection on x with upstream gradient g: lora_dropout (seeded as stock),
    lora_forward_gemms, lora_backward_gemms, cast_grads; the sums (base + LoRA output, the input
    gradients through dropout's backward) with torch's ops in stock's dtypes."""
    base, a, b, dropout, s = parts(layer)
    plan = linear_plan(base)
    torch.manual_seed(seed)
    xd, mask, mode, drop_scale = lora_nf4.lora_dropout(dropout, x, defer=defer, packed=packed)
    base16, lora16, x16, saved = lora_nf4.lora_forward_gemms(plan, x, xd, mask, a, b, linear4bit_bias(base))
    out = base16.to(x.dtype) + lora16 * s  # peft: result + lora_B(...) * scaling (fp16 product, promoted)
    g16 = g.to(F16)
    gs16 = g16 * s  # autograd's backward of `output * scaling` on the fp16 LoRA output
    grads16 = gbase16, gxd16, ga16, gb16 = lora_nf4.lora_backward_gemms(plan, g16, gs16, saved, True, True, True)
    da, db = lora_nf4.cast_grads(ga16, gb16, a.dtype, b.dtype)
    gxd = gxd16.to(x.dtype)  # autocast's cast of dropout(x) to fp16: its backward casts back
    if mode == lora_nf4.DROPOUT_MASK:  # CUDA's native_dropout_backward
        gxd = torch.ops.aten.native_dropout_backward(gxd, mask, drop_scale)
    elif mode == lora_nf4.DROPOUT_NOISE:  # the CPU's x * noise
        gxd = gxd * mask
    dx = gbase16.to(x.dtype) + gxd
    return {"base": base16, "lora": lora16, "out": out, "x": dx, "A": da, "B": db, "mask": mask, "mode": mode,
            "drop_scale": drop_scale, "x16": x16, "saved": saved, "grads16": grads16}


def stock_parts(layer, x, ctx, seed=123):
    """peft's pieces under ``ctx`` (fp16 autocast): base_layer(x) and lora_B(lora_A(dropout(x))),
    the dropout seeded as in peft's forward (the base layer draws nothing)."""
    base, _, _, dropout, _ = parts(layer)
    torch.manual_seed(seed)
    with torch.no_grad(), ctx():
        return base(x), layer.lora_B["default"](layer.lora_A["default"](dropout(x)))


def stock(layer, x, g, ctx, seed=123):
    """peft's forward under ``ctx`` and autograd's gradients for x, A and B."""
    _, a, b, _, _ = parts(layer)
    xx = x.detach().requires_grad_(True)
    torch.manual_seed(seed)
    with ctx():
        out = layer(xx)
    dx, da, db = torch.autograd.grad(out, (xx, a, b), g)
    return {"out": out.detach(), "x": dx, "A": da, "B": db}


def fp64_reference(layer, x, g, keep_scaled):
    """out = fp16(x) W^T + fp16(b) + s ((x * keep) A16^T) B16^T and its gradients in fp64 (W: bnb's
    fp16 weights; ``keep_scaled``: dropout's multiplier per element, 0 where dropped)."""
    base, a, b, _, s = parts(layer)
    w_f, w_b = bnb_weight16(base).double(), bnb_weight16(base, backward=True).double()
    a, b = a.detach().to(F16).double(), b.detach().to(F16).double()
    k = keep_scaled.double() if torch.is_tensor(keep_scaled) else keep_scaled
    xd = x.double() * k
    h = xd @ a.t()
    out = x.to(F16).double() @ w_f.t() + base.bias.detach().to(F16).double() + s * h @ b.t()
    g64 = g.to(F16).double()
    gh = s * g64 @ b
    return {"out": out, "x": g64 @ w_b + (gh @ a) * k,
            "A": gh.reshape(-1, a.shape[0]).t() @ xd.reshape(-1, a.shape[1]),
            "B": s * g64.reshape(-1, b.shape[0]).t() @ h.reshape(-1, a.shape[0])}


def keep_scaled(res):
    """Dropout's multiplier from ``ours``'s result: 1, the CPU's scaled noise, or mask * scale."""
    if res["mode"] == lora_nf4.NO_DROPOUT:
        return 1.0
    if res["mode"] == lora_nf4.DROPOUT_NOISE:
        return res["mask"]
    return res["mask"].double() * res["drop_scale"]


def u_of(dtype) -> float:
    """Unit roundoff of the last rounding a result gets: 2^-8 for bf16 (the bf16 LoRA gradients),
    else the fp16 GEMM outputs' 2^-11."""
    return 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11


def check_against_stock(o, s, device, keys=("x", "A", "B")):
    """Output equal; gradients equal on the CPU (the same GEMMs on the same operands); on a GPU
    within 4 roundings of the result's precision (fp16 GEMM outputs, fp32 accumulation in another
    order when cuBLAS picks another kernel for another shape; bf16 parameter gradients add their
    2^-8 cast)."""
    assert o["out"].dtype == s["out"].dtype and torch.equal(o["out"], s["out"])
    for k in keys:
        assert o[k].dtype == s[k].dtype, k
        if device == "cpu":
            assert torch.equal(o[k], s[k]), k
        else:
            assert rel_err(o[k], s[k]) < 4 * u_of(o[k].dtype), (k, rel_err(o[k], s[k]))


CASES = [
    # (in, out, x prefix, pad rows, non-contiguous x)
    (192, 128, (2, 6), 0, False),   # q-like
    (192, 32, (3, 5), 2, False),    # v-like (out < in), right-padded rows
    (256, 64, (2, 7), 0, True),     # strided input
    (99, 40, (2, 5), 1, False),     # odd sizes
]


@pytest.mark.parametrize("in_f,out_f,prefix,pad,noncontig", CASES)
@pytest.mark.parametrize("dropout", [0.0, 0.05])
@pytest.mark.parametrize("lora_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_peft(in_f, out_f, prefix, pad, noncontig, dropout, lora_dtype, device, autocast_ctx):
    """fp32 x (the residual stream after RMSNorm, as in training): peft's base output and LoRA
    output, the layer's output and its gradients for x, A and B; fp64 as an independent anchor.
    Launches: one dequantization each way (with the fp16 casts of x / dropout(x) forward where they
    are fp32 and contiguous), one launch casting fp32 A and B (torch's casts for other dtypes)."""
    layer = make_lora_layer(in_f, out_f, dropout, lora_dtype, device)
    x = fresh_x((*tokens(prefix, device), in_f), device, pad_rows=pad, noncontig=noncontig)
    g = fresh_x((*x.shape[:-1], out_f), device, seed=2)
    _launches.reset()
    o = ours(layer, x, g)
    assert dequant_launches() == 2 and cast_launches() == (0 if noncontig and not dropout else 1)
    # A and B to fp16 forward, their gradients back to fp32: one launch each (torch's casts otherwise)
    assert _launches.LAUNCHES["pair_cast"] == (2 if lora_dtype == torch.float32 else 0)
    base_ref, lora_ref = stock_parts(layer, x, autocast_ctx)
    assert base_ref.dtype == torch.float32 and torch.equal(o["base"].float(), base_ref)
    assert lora_ref.dtype == F16 and torch.equal(o["lora"], lora_ref)
    assert torch.equal(o["x16"], x.to(F16))
    s = stock(layer, x, g, autocast_ctx)
    check_against_stock(o, s, device)
    # fp64: ours within 2x stock's own error (the same fp16 GEMMs of the same operands: a lost
    # term or a wrong scale would be many times stock's error), stock within 4 roundings of the
    # result's precision (a check on the reference itself)
    r = fp64_reference(layer, x, g, keep_scaled(o))
    for k in ("out", "x", "A", "B"):
        e_stock = rel_err(s[k], r[k])
        assert e_stock < 4 * u_of(s[k].dtype), (k, e_stock)
        assert rel_err(o[k], r[k]) <= 2 * e_stock + 2.0 ** -30, (k, rel_err(o[k], r[k]), e_stock)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_fp16_input(device, autocast_ctx, dropout):
    """x already fp16 (no cast in bnb, an fp16 + fp16 sum in peft): output and x's gradient stay
    fp16; the output the same bits as peft's, the gradients too on the CPU (on the GPU within
    check_against_stock's 4 roundings); no cast in the dequantization launch."""
    layer = make_lora_layer(128, 64, dropout, torch.float32, device)
    x = fresh_x((*tokens((3, 4), device), 128), device, dtype=F16)
    g = fresh_x((*x.shape[:-1], 64), device, dtype=F16, seed=2)
    _launches.reset()
    o = ours(layer, x, g)
    assert cast_launches() == 0 and o["x16"] is x
    s = stock(layer, x, g, autocast_ctx)
    assert o["out"].dtype == o["x"].dtype == F16
    check_against_stock(o, s, device)


def test_native_dropout_mode(device, autocast_ctx, monkeypatch):
    """The CUDA dropout mode (native_dropout's bool mask; backward native_dropout_backward's
    (mask * g) * (1 / (1 - p))) exercised on any device: ours forced to native_dropout against peft
    whose dropout module runs native_dropout, the same seed."""
    monkeypatch.setattr(lora_nf4, "_dropout_is_native", lambda x: True)
    for x_dtype in (torch.float32, F16):
        layer = make_lora_layer(128, 48, 0.3, torch.float32, device)
        x = fresh_x((*tokens((2, 5), device), 128), device, dtype=x_dtype)
        g = fresh_x((*x.shape[:-1], 48), device, dtype=x_dtype, seed=2)
        o = ours(layer, x, g)
        assert o["mode"] == lora_nf4.DROPOUT_MASK and o["mask"].dtype == torch.bool
        layer.lora_dropout["default"] = NativeDropout(0.3)
        check_against_stock(o, stock(layer, x, g, autocast_ctx), device)


def stock_dropout_draw(drop, x, seed):
    """Stock's draw of ``drop`` (an nn.Dropout) on x from ``seed``, run twice from the same seed:
    (its value, the generator's next number after it, its scaled keep mask from a run on ones: the
    CPU's Bernoulli noise / (1 - p) itself, CUDA's mask * 1 / (1 - p), 0 where dropped)."""
    torch.manual_seed(seed)
    value = drop(x)
    after = torch.rand(1, device=x.device)
    torch.manual_seed(seed)
    keep = drop(torch.ones_like(x))
    return value, after, keep


def test_dropout_draws_as_stock(device, monkeypatch):
    """lora_dropout on x itself (no packed batch): the value torch's dropout gives with the same
    seed, its mask (the CPU's scaled Bernoulli noise / CUDA's bool mask), the generator advanced as
    stock's; forced to the native mode, torch.native_dropout's. No draw (None, the generator
    untouched) for nn.Identity, eval mode and p = 0."""
    for p in (0.05, 0.5):
        for dtype in (torch.float32, F16):
            x = fresh_x((3, 7, 40), device, dtype, seed=11)
            drop = torch.nn.Dropout(p).train()
            ref, after_ref, ref_keep = stock_dropout_draw(drop, x, 3)
            torch.manual_seed(3)
            xd, mask, mode, scale = lora_nf4.lora_dropout(drop, x)
            assert torch.equal(torch.rand(1, device=device), after_ref)
            assert torch.equal(xd, ref)
            if device == "cuda":
                assert mode == lora_nf4.DROPOUT_MASK and scale == 1.0 / (1.0 - p)
                assert torch.equal(mask, ref_keep != 0)
            else:
                assert mode == lora_nf4.DROPOUT_NOISE and scale == 1.0
                assert torch.equal(mask, ref_keep)
    monkeypatch.setattr(lora_nf4, "_dropout_is_native", lambda x: True)
    x = fresh_x((3, 7, 40), device, seed=12)
    torch.manual_seed(4)
    ref, ref_mask = torch.native_dropout(x, 0.3, True)
    torch.manual_seed(4)
    xd, mask, mode, _ = lora_nf4.lora_dropout(torch.nn.Dropout(0.3).train(), x)
    assert mode == lora_nf4.DROPOUT_MASK and torch.equal(xd, ref) and torch.equal(mask, ref_mask)
    for module in (torch.nn.Identity(), torch.nn.Dropout(0.3).eval(), torch.nn.Dropout(0.0).train()):
        assert not lora_nf4.draws(module)
        torch.manual_seed(5)
        assert lora_nf4.lora_dropout(module, x) == (None, None, lora_nf4.NO_DROPOUT, 1.0)
        after = torch.rand(1, device=device)
        torch.manual_seed(5)
        assert torch.equal(after, torch.rand(1, device=device))
    assert lora_nf4.draws(torch.nn.Dropout(0.3).train())


LENGTHS, SEQLEN = [5, 2, 7], 7  # a right-padded batch of 3 rows: 14 real tokens of 21 positions


def _padded_case(device, hidden, dtype=torch.float32, seed=21):
    """(info, x_pad [batch, seqlen, hidden], x_packed [1, N, hidden]): the real tokens packed as the
    node sees them (tests/test_unpad.py tests the packing itself)."""
    info = packing.make_unpadded(LENGTHS, SEQLEN, torch.device(device))
    x_pad = fresh_x((len(LENGTHS), SEQLEN, hidden), device, dtype, seed=seed)
    x_packed = packing.unpad_rows(x_pad.view(-1, hidden), info).view(1, -1, hidden)
    return info, x_pad, x_packed


def test_padded_draw_shape():
    """The padded shape is [batch * seqlen, H] exactly when x holds the packed batch's real rows."""
    info = packing.make_unpadded(LENGTHS, SEQLEN, torch.device("cpu"))
    assert lora_nf4.padded_draw_shape(torch.empty(1, 14, 8), info) == (21, 8)
    assert lora_nf4.padded_draw_shape(torch.empty(14, 8), info) == (21, 8)
    assert lora_nf4.padded_draw_shape(torch.empty(1, 14, 8), None) is None
    assert lora_nf4.padded_draw_shape(torch.empty(1, 13, 8), info) is None  # not the packed rows
    assert lora_nf4.padded_draw_shape(torch.empty(8), info) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_packed_dropout_draws_over_the_padded_shape(device, dtype):
    """Packed rows: lora_dropout keeps exactly the real rows of the draw stock's nn.Dropout makes
    over the padded tensor (value and mask) and leaves the generator where stock's leaves it."""
    hidden, p = 24, 0.3
    info, x_pad, x_packed = _padded_case(device, hidden, dtype)
    drop = torch.nn.Dropout(p).train()
    ref, after_ref, ref_keep = stock_dropout_draw(drop, x_pad, 6)
    real = lambda t: packing.unpad_rows(t.reshape(-1, hidden), info).view(x_packed.shape)  # noqa: E731
    torch.manual_seed(6)
    xd, mask, mode, scale = lora_nf4.lora_dropout(drop, x_packed, packed=info)
    assert torch.equal(torch.rand(1, device=device), after_ref)
    assert torch.equal(xd, real(ref))
    if device == "cuda":
        assert mode == lora_nf4.DROPOUT_MASK and torch.equal(mask, real(ref_keep) != 0)
    else:
        assert mode == lora_nf4.DROPOUT_NOISE and torch.equal(mask, real(ref_keep))


def test_draw_padded_mask_is_native_dropouts(device):
    """draw_padded_mask: native_dropout's mask over the padded shape (what stock's nn.Dropout runs
    on CUDA, on a tensor of the same shape and dtype: the mask does not depend on the values), its
    real rows, with ``out`` or without, the generator advanced as stock's. On CUDA against
    nn.Dropout itself."""
    hidden, p = 24, 0.05
    for dtype in (torch.float32, F16):
        info, x_pad, _ = _padded_case(device, hidden, dtype)
        torch.manual_seed(8)
        if device == "cuda":
            ref_mask = torch.nn.Dropout(p).train()(torch.ones_like(x_pad)) != 0
        else:
            ref_mask = torch.native_dropout(x_pad, p, True)[1]
        ref_mask = ref_mask.view(-1, hidden)
        after_ref = torch.rand(1, device=device)
        torch.manual_seed(8)
        mask = lora_nf4.draw_padded_mask(p, (info.batch * info.seqlen, hidden), dtype, info.idx)
        assert torch.equal(torch.rand(1, device=device), after_ref)
        assert mask.dtype == torch.bool and torch.equal(mask, ref_mask.index_select(0, info.idx))
        out = torch.empty(len(info.idx), hidden, dtype=torch.bool, device=device)
        torch.manual_seed(8)
        assert lora_nf4.draw_padded_mask(p, (info.batch * info.seqlen, hidden), dtype, info.idx, out=out) is out
        assert torch.equal(out, mask)


def test_deferred_dropout_value_is_the_same_bits(device, monkeypatch):
    """Packed rows in the native mode (the node's training path: the mask drawn over the padded
    shape): with ``defer`` the dequantization launch makes fp16(dropout(x)) from x and the mask
    (``_Deferred``, cast mode 3) instead of torch's ``x * mask * scale`` in fp32 then a cast: every
    forward output and saved tensor, and so every gradient, bit for bit the same. The values
    themselves are stock's: x's real rows times native_dropout's value on the padded tensor."""
    monkeypatch.setattr(lora_nf4, "_dropout_is_native", lambda x: True)
    layer = make_lora_layer(128, 48, 0.3, torch.float32, device)
    info, x_pad, x = _padded_case(device, 128)
    g = fresh_x((*x.shape[:-1], 48), device, seed=9)
    results = {}
    for defer in (False, True):
        _launches.reset()
        results[defer] = ours(layer, x, g, seed=321, packed=info, defer=defer)
        assert dequant_launches() == 2 and cast_launches() == 1  # x and dropout(x) cast in one launch
    assert isinstance(dropout_value(layer, x, info, defer=True), lora_nf4._Deferred)
    assert dropout_value(layer, x, info, defer=False).dtype == torch.float32
    a, b = results[False], results[True]
    for k in ("base", "lora", "out", "x", "A", "B", "x16", "mask"):
        assert torch.equal(a[k], b[k]), k
    for t0, t1 in zip(a["saved"], b["saved"]):
        assert torch.equal(t0, t1)
    # the fp16 dropout value is stock's: native_dropout on the padded tensor, its real rows, cast
    torch.manual_seed(321)
    ref = torch.native_dropout(x_pad, 0.3, True)[0]  # stock's draw: the padded [batch, seqlen, H] tensor
    assert torch.equal(b["saved"][0], packing.unpad_rows(ref.view(-1, 128), info).view(x.shape).to(F16))


def dropout_value(layer, x, info, defer):
    """lora_dropout's value for the layer's dropout on packed rows (``defer`` as given)."""
    torch.manual_seed(0)
    return lora_nf4.lora_dropout(parts(layer)[3], x, defer=defer, packed=info)[0]


def test_given_x16_and_ab16(device):
    """The node's v projection reuses q's fp16(x) (``x16``: x is not cast again) and both take A and
    B cast by ``cast_four`` (``ab16``): the same bits as casting them here."""
    layer = make_lora_layer(128, 48, 0.1, torch.float32, device)
    base, a, b, _, _ = parts(layer)
    plan = linear_plan(base)
    x = fresh_x((*tokens((2, 5), device), 128), device)
    torch.manual_seed(1)
    xd, mask, _, _ = lora_nf4.lora_dropout(parts(layer)[3], x)
    ref = lora_nf4.lora_forward_gemms(plan, x, xd, mask, a, b, linear4bit_bias(base))
    x16 = x.to(F16)
    ab16 = tuple(lora_nf4.cast_four((a, b, a, b), (F16,) * 4)[:2])
    got = lora_nf4.lora_forward_gemms(plan, x, xd, mask, a, b, linear4bit_bias(base), x16=x16, ab16=ab16)
    assert got[2] is x16
    for r, t in zip((ref[0], ref[1], *ref[3]), (got[0], got[1], *got[3])):
        assert torch.equal(r, t)
    assert got[3][2] is ab16[0] and got[3][3] is ab16[1]


def test_backward_gemms_only_what_is_asked(device):
    """lora_backward_gemms computes only the gradients asked for (None for the others), each the
    same bits as when all are asked."""
    layer = make_lora_layer(99, 40, 0.0, torch.float32, device)
    x = fresh_x((*tokens((2, 5), device), 99), device)
    g = fresh_x((*x.shape[:-1], 40), device, seed=2)
    o = ours(layer, x, g)
    plan = linear_plan(parts(layer)[0])
    g16 = g.to(F16)
    full = o["grads16"]
    for need in [(False, True, True), (True, False, False), (False, False, True), (False, True, False)]:
        got = lora_nf4.lora_backward_gemms(plan, g16, g16 * 2.0, o["saved"], *need)
        asked = (need[0], need[0], need[1], need[2])  # grad_base and grad_xd both follow need_x
        for want, f, t in zip(asked, full, got):
            assert (t is None) != want
            if want:
                assert torch.equal(f, t)


def test_cast_mode_3_is_dropouts_value(device):
    """_cast_block CAST_B == 3 (what ``_Deferred`` asks of the launch): fp16((x * keep) * scale) in
    fp32, as torch computes native_dropout's value (negative zeros included), next to the plain
    cast of x, in the dequantization launch."""
    layer = make_lora_layer(128, 48, 0.0, torch.float32, device)
    plan = linear_plan(layer.get_base_layer())
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(37, 128, generator=gen).to(device)
    keep = (torch.rand(37, 128, generator=gen) > 0.3).to(device)
    scale = lora_nf4._native_dropout_scale(0.3)
    x16, xd16 = torch.empty_like(x, dtype=F16), torch.empty_like(x, dtype=F16)
    plan.dq.launch(plan.weight16(), a=x, a16=x16, b=keep, b16=xd16, cast_b=3, scaling=scale)
    ref = (x * keep * scale).half()
    assert torch.equal(x16, x.half())
    assert torch.equal(xd16.view(torch.int16), ref.view(torch.int16))  # bits: -0.0 too
    assert torch.equal(plan.weight16(), bnb_weight16(layer.get_base_layer()))


def test_ops_per_call(device, monkeypatch):
    """The work of one projection (fp32 x and LoRA weights, as in training), pinned so that an
    extra cast or copy shows up. Forward: the fp16 x and dropout(x) allocations + 1 Triton launch
    (W + both casts), the base GEMM, 1 Triton launch casting A and B, the two LoRA GEMMs. Backward:
    the three LoRA GEMMs (B's gradient, the gradient into h, A's gradient), the gradient into
    dropout(x), then 1 Triton launch (W) and the base input-gradient GEMM. (Stock peft + bnb on
    CUDA: ~15 kernels forward, ~17 backward.)"""
    layer = make_lora_layer(128, 64, 0.05, torch.float32, device)
    base, a, b, dropout, _ = parts(layer)
    plan = linear_plan(base)
    bias16 = linear4bit_bias(base)
    x = fresh_x((*tokens((2, 5), device), 128), device)
    xd, mask, _, _ = lora_nf4.lora_dropout(dropout, x)
    lora_nf4.lora_forward_gemms(plan, x, xd, mask, a, b, bias16)  # the scratch buffer exists before counting
    counter = CountOps(monkeypatch, [(lora_nf4, "cast_pair")])
    with counter:
        _, _, _, saved = lora_nf4.lora_forward_gemms(plan, x, xd, mask, a, b, bias16)
    assert counter.take() == ["empty", "empty", "triton", "addmm", "triton", "mm", "mm"]
    g16 = fresh_x((*x.shape[:-1], 64), device, F16, seed=2)
    gs16 = g16 * 2.0
    with counter:
        lora_nf4.lora_backward_gemms(plan, g16, gs16, saved, True, True, True)
    assert counter.take() == ["mm", "mm", "mm", "mm", "triton", "mm"]


# 65520, 1e6 and inf cast to fp16 overflow on purpose (to inf, as torch's .to does): on the CPU,
# Triton's interpreter casts with numpy, which warns "overflow encountered in cast" for them
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("src,dst", [(torch.float32, torch.float16), (torch.float16, torch.float32)])
@pytest.mark.parametrize("n0,n1", [(16 * 1536, 1536 * 16), (16 * 1536, 256 * 16), (5, 4097), (4096, 1)])
def test_cast_pair_is_torchs_two_casts(device, src, dst, n0, n1):
    """cast_pair: the very bits of ``.to`` for both tensors (round to nearest even, overflow to
    inf, subnormals, signed zero; NaN stays NaN), at the LoRA shapes, odd sizes and a block
    boundary; one launch."""
    special = torch.tensor([65504.0, 65520.0, 1e6, -1e6, 6e-8, 3e-8, -0.0, float("nan"), float("inf"),
                            1 + 2 ** -11, 1 + 3 * 2 ** -11, 2 ** -24 * 1.5])

    def make(n, seed):
        g = torch.Generator().manual_seed(seed)
        t = torch.randn(n, generator=g) * 3
        k = min(n, special.numel())
        t[:k] = special[:k]
        return t.to(src).to(device)

    a, b = make(n0, 1), make(n1, 2)
    before = _launches.LAUNCHES["pair_cast"]
    a_out, b_out = lora_nf4.cast_pair(a, b, dst, dst)
    assert _launches.LAUNCHES["pair_cast"] == before + 1
    bits = torch.int32 if dst == torch.float32 else torch.int16
    for got, ref in ((a_out, a.to(dst)), (b_out, b.to(dst))):
        assert got.dtype == dst and got.shape == ref.shape
        nan = ref.isnan()
        assert torch.equal(got.isnan(), nan)  # a NaN stays a NaN (its payload may differ)
        assert torch.equal(got[~nan].view(bits), ref[~nan].view(bits))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("src,dst", [(torch.float32, torch.float16), (torch.float16, torch.float32)])
def test_cast_four_is_torchs_four_casts(device, src, dst):
    """cast_four: the bits of ``.to`` for four tensors (q's and v's LoRA A / B shapes on a GPU, odd
    ones here), one launch; a mix of dtypes falls back to cast_pair's (torch's casts for bf16)."""
    g = torch.Generator().manual_seed(3)
    shapes = [(16, 1536), (1536, 16), (16, 1536), (256, 16)] if device == "cuda" else [(4, 37), (37, 4), (4, 5), (9, 4)]
    ts = [(torch.randn(*sh, generator=g) * 3).to(src).to(device) for sh in shapes]
    ts[0].view(-1)[:3] = torch.tensor([65520.0, -0.0, 6e-8])
    before = _launches.LAUNCHES["quad_cast"]
    outs = lora_nf4.cast_four(ts, (dst,) * 4)
    assert _launches.LAUNCHES["quad_cast"] == before + 1
    bits = torch.int32 if dst == torch.float32 else torch.int16
    for got, t in zip(outs, ts):
        ref = t.to(dst)
        assert got.dtype == dst and got.shape == ref.shape and torch.equal(got.view(bits), ref.view(bits))
    mixed_in = [ts[0], ts[1], ts[2].to(torch.bfloat16), ts[3]]
    mixed = lora_nf4.cast_four(mixed_in, (dst,) * 4)
    assert _launches.LAUNCHES["quad_cast"] == before + 1
    for got, t in zip(mixed, mixed_in):
        assert torch.equal(got, t.to(dst))


def test_cast_pair_falls_back_to_torch(device):
    """A tensor already in its dtype, a strided one, bf16: torch's ``.to``, no launch."""
    a = torch.randn(16, 64, device=device)
    b = torch.randn(64, 16, device=device)
    before = _launches.LAUNCHES["pair_cast"]
    same, other = lora_nf4.cast_pair(a, b.half(), torch.float32, torch.float32)
    assert same is a and torch.equal(other, b.half().float())
    s0, s1 = lora_nf4.cast_pair(a.t(), b, F16, F16)  # a.t() is not contiguous
    assert torch.equal(s0, a.t().half()) and torch.equal(s1, b.half())
    d0, d1 = lora_nf4.cast_pair(a.bfloat16(), b.bfloat16(), F16, F16)
    assert torch.equal(d0, a.bfloat16().half()) and torch.equal(d1, b.bfloat16().half())
    assert _launches.LAUNCHES["pair_cast"] == before


def test_cast_grads(device):
    """cast_grads: A's and B's fp16 gradients in the weights' dtypes, the bits of ``.to``: one launch
    when both are there (fp32 weights), torch's casts for one alone or bf16; None stays None."""
    g = torch.Generator().manual_seed(5)
    ga = (torch.randn(16, 40, generator=g) * 3).to(F16).to(device)
    gb = (torch.randn(24, 16, generator=g) * 3).to(F16).to(device)
    before = _launches.LAUNCHES["pair_cast"]
    da, db = lora_nf4.cast_grads(ga, gb, torch.float32, torch.float32)
    assert _launches.LAUNCHES["pair_cast"] == before + 1
    assert torch.equal(da, ga.float()) and torch.equal(db, gb.float())
    assert lora_nf4.cast_grads(None, None, torch.float32, torch.float32) == (None, None)
    da, db = lora_nf4.cast_grads(ga, None, torch.float32, torch.float32)
    assert db is None and torch.equal(da, ga.float())
    da, db = lora_nf4.cast_grads(None, gb, torch.float32, torch.bfloat16)
    assert da is None and db.dtype == torch.bfloat16 and torch.equal(db, gb.to(torch.bfloat16))
    da, db = lora_nf4.cast_grads(ga, gb, torch.bfloat16, torch.bfloat16)
    assert torch.equal(da, ga.to(torch.bfloat16)) and torch.equal(db, gb.to(torch.bfloat16))
    assert _launches.LAUNCHES["pair_cast"] == before + 1


@pytest.mark.gpu
@pytest.mark.parametrize("out_f", [1536, 256])  # q_proj, v_proj
@pytest.mark.parametrize("dropout", [0.0, 0.05])
@pytest.mark.parametrize("lora_dtype", [torch.float32, torch.bfloat16])
def test_model_shapes_gpu(out_f, dropout, lora_dtype, autocast_ctx):
    """[4, 512, 1536] fp32 activations (the residual stream after RMSNorm), as in training: peft's
    pieces equal, gradients within check_against_stock's GPU limit."""
    layer = make_lora_layer(1536, out_f, dropout, lora_dtype, "cuda")
    x = fresh_x((4, 512, 1536), "cuda")
    g = fresh_x((4, 512, out_f), "cuda", seed=2)
    o = ours(layer, x, g)
    base_ref, lora_ref = stock_parts(layer, x, autocast_ctx)
    assert torch.equal(o["base"].float(), base_ref) and torch.equal(o["lora"], lora_ref)
    check_against_stock(o, stock(layer, x, g, autocast_ctx), "cuda")
