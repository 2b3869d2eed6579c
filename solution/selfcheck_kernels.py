"""The kernel checks of ``python -m solution.selfcheck`` (``KERNELS``): each kernel module on small random inputs
of odd sizes against a float64 reference (solution/_references.py), forward and backward. Kernel modules are
imported inside each check, so that selfcheck can turn Triton's interpreter on first."""
from __future__ import annotations

from collections.abc import Callable

EPS = 1e-6  # the RMSNorm epsilon of the checks

def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64; inf when out holds NaN or inf."""
    import torch

    out64, ref64 = out.detach().to(torch.float64).cpu(), ref.detach().to(torch.float64).cpu()
    if not torch.isfinite(out64).all():
        return float("inf")
    denom = ref64.norm().item()
    return (out64 - ref64).norm().item() / (denom if denom > 0 else 1.0)


def compare(ours: Callable, ref: Callable, args: list, wrt: tuple[int, ...] = (), n_grad_outputs: int | None = None,
            seed: int = 0) -> dict[str, float]:
    """Worst relative errors of ``ours(*args)`` against ``ref(*args in float64)``: {"forward": outputs,
    "backward": gradients of the arguments at ``wrt`` for the same random upstream gradients through the
    first ``n_grad_outputs`` outputs (default all)}."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def leaves(as_f64: bool):
        out = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and a.is_floating_point():
                a = a.detach().to(torch.float64) if as_f64 else a.detach().clone()
                a.requires_grad_(i in wrt)
            out.append(a)
        return out

    def as_tuple(x):
        return tuple(x) if isinstance(x, (tuple, list)) else (x,)

    mine, theirs = leaves(False), leaves(True)
    outs, ref_outs = as_tuple(ours(*mine)), as_tuple(ref(*theirs))
    errs = {"forward": max(rel_err(o, r) for o, r in zip(outs, ref_outs))}
    if wrt:
        k = n_grad_outputs or len(outs)
        ups = [torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in outs[:k]]
        grads = torch.autograd.grad(outs[:k], [mine[i] for i in wrt], ups)
        ref_grads = torch.autograd.grad(ref_outs[:k], [theirs[i] for i in wrt],
                                        [u.to(torch.float64) for u in ups])
        errs["backward"] = max(rel_err(g, r) for g, r in zip(grads, ref_grads))
    return errs


def _randn(*shape, device, dtype=None, scale=1.0, seed=0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(device=device, dtype=dtype or torch.float32)


def _nf4(out_f: int, in_f: int, device: str, seed: int):
    """(packed, quant_state) of a random [out_f, in_f] weight, bitsandbytes' NF4 as the workload's."""
    import bitsandbytes.functional as bnbF
    import torch

    w = _randn(out_f, in_f, device=device, dtype=torch.float16, scale=0.05, seed=seed)
    return bnbF.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")


def _plan(out_f: int, in_f: int, device: str, seed: int):
    """(LinearPlan, reference fp16 weight, packed) for a random NF4 weight (packed keeps the plan's weakref alive)."""
    import torch

    from solution import _references as R
    from solution.kernels.nf4_linear import LinearPlan

    packed, qs = _nf4(out_f, in_f, device, seed)
    plan = LinearPlan(packed, qs, torch.float16)
    if plan.reason is not None:
        raise RuntimeError(f"NF4 weight refused: {plan.reason}")
    return plan, R.nf4_dequant(packed, qs).to(torch.float16), packed


def _k_nf4_dequant(dev):
    import torch

    from solution import _references as R
    from solution.kernels.nf4_dequant import DequantPlan, dequantize_nf4

    packed, qs = _nf4(7, 30, dev, seed=1)  # 210 elements: a partial last block, blocks across rows
    ours = dequantize_nf4(packed, qs)
    ref = R.nf4_dequant(packed, qs).to(torch.float16)
    wrong = int((ours.view(torch.int16) != ref.view(torch.int16)).sum())
    a = _randn(3, 11, device=dev, seed=2)  # the fused fp16 cast of an activation, same launch
    a16 = torch.empty_like(a, dtype=torch.float16)
    DequantPlan(packed, qs).launch(torch.empty_like(ours), a=a, a16=a16)
    wrong += int((a16.view(torch.int16) != a.to(torch.float16).view(torch.int16)).sum())
    return {"wrong values": float(wrong)}, ("nf4_dequant", "nf4_dequant_cast")


def _fb(fwd, bwd, ref, args, wrt, ups_like, seed: int = 0) -> dict[str, float]:
    """``compare`` for launchers without autograd: ``fwd(*args)`` -> outputs, ``bwd(*upstream gradients of the
    outputs at ``ups_like``)`` -> gradients of the arguments at ``wrt``; ``ref`` in float64 with autograd."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    outs = fwd(*args)
    outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
    theirs = [a.detach().to(torch.float64).requires_grad_(i in wrt) if isinstance(a, torch.Tensor)
              and a.is_floating_point() else a for i, a in enumerate(args)]
    ref_outs = ref(*theirs)
    ref_outs = tuple(ref_outs) if isinstance(ref_outs, (tuple, list)) else (ref_outs,)
    errs = {"forward": max(rel_err(o, r) for o, r in zip(outs, ref_outs))}
    ups = [torch.randn(outs[i].shape, generator=gen).to(outs[i].device, outs[i].dtype) for i in ups_like]
    grads = bwd(*ups)
    ref_grads = torch.autograd.grad([ref_outs[i] for i in ups_like], [theirs[i] for i in wrt],
                                    [u.to(torch.float64) for u in ups])
    errs["backward"] = max(rel_err(g, r) for g, r in zip(grads, ref_grads))
    return errs


def _k_nf4_linear(dev):
    """A frozen NF4 linear as the node runs it: weight and fp16(x) in one launch, F.linear; ``input_grad16``."""
    import torch
    import torch.nn.functional as F

    from solution import _references as R

    plan, w16, _packed = _plan(24, 40, dev, seed=3)
    x = _randn(15, 40, device=dev, seed=5)

    def fwd(x):
        w, x16 = plan.dequant_and_cast(x)
        return F.linear(x16, w)

    errs = _fb(fwd, lambda g: (plan.input_grad16(g.to(torch.float16)),), lambda x: R.nf4_linear(x, w16, None),
               [x], (0,), (0,))
    return errs, ("nf4_dequant_cast", "nf4_dequant")


def _k_lora_nf4(dev):
    """The node's LoRA launches that must equal torch's ops bit for bit: ``cast_four`` and fp16(dropout(x)) made
    in the dequantization launch (``dequant_and_cast_inputs`` with a deferred dropout)."""
    import torch

    from solution.kernels.lora_nf4 import _Deferred, _native_dropout_scale, cast_four, dequant_and_cast_inputs

    ws = [_randn(*shape, device=dev, scale=0.2, seed=6 + i) for i, shape in enumerate(((4, 40), (24, 4), (4, 40), (8, 4)))]
    outs = cast_four(ws, (torch.float16,) * 4)
    wrong = sum(int((o.view(torch.int16) != w.to(torch.float16).view(torch.int16)).sum()) for o, w in zip(outs, ws))
    plan, _w16, _packed = _plan(24, 40, dev, seed=10)
    x = _randn(3, 5, 40, device=dev, seed=11)
    mask = _randn(3, 5, 40, device=dev, seed=12) > -0.6
    scale = _native_dropout_scale(0.25)
    _, x16, xd16 = dequant_and_cast_inputs(plan, x, _Deferred(scale), mask)
    wrong += int((x16.view(torch.int16) != x.to(torch.float16).view(torch.int16)).sum())
    want = (x * mask * scale).to(torch.float16)  # native_dropout's value, then autocast's cast
    wrong += int((xd16.view(torch.int16) != want.view(torch.int16)).sum())
    return {"wrong values": float(wrong)}, ("quad_cast", "nf4_dequant_cast")


def _k_nf4_mlp(dev):
    import torch

    from solution import _references as R
    from solution.kernels.nf4_mlp import mlp_backward, mlp_forward, mlp_saved

    (gate, wg, _), (up, wu, _) = _plan(72, 40, dev, seed=12), _plan(72, 40, dev, seed=13)
    down, wd, _pd = _plan(40, 72, dev, seed=14)
    x = _randn(15, 40, device=dev, seed=15)
    kept = {}

    def fwd(x):
        y16, g16, u16, x16 = mlp_forward(x, gate, up, down)
        kept["saved"] = mlp_saved("speed", x16, g16, u16)
        return y16

    def bwd(dy):
        return (mlp_backward((gate, up, down), "speed", kept["saved"], dy.to(torch.float16)),)

    errs = _fb(fwd, bwd, lambda x: R.nf4_mlp(x, wg, wu, wd), [x], (0,), (0,))
    return errs, ("nf4_dequant_cast", "nf4_dequant", "swiglu_fwd", "swiglu_bwd", "fp32_add_kernel")


def _k_rmsnorm(dev):
    """The launchers as the node calls them: fp32 rows and weight, the weight frozen (no weight gradient)."""
    import torch

    from solution import _references as R
    from solution.kernels.rmsnorm import _launch_backward_dx, _launch_forward

    x, w = _randn(7, 40, device=dev, seed=16), 1 + _randn(40, device=dev, scale=0.5, seed=17)
    kept = {}

    def fwd(x):
        out, kept["rstd"] = _launch_forward(x, w, EPS)
        return out

    def bwd(g):
        return (_launch_backward_dx(x, w, g, kept["rstd"]),)

    errs = _fb(fwd, bwd, lambda x: R.rmsnorm(x, w.to(torch.float64), EPS), [x], (0,), (0,))
    return errs, ("_rmsnorm_fwd_kernel", "_rmsnorm_bwd_dx_kernel")


def _k_add_rmsnorm(dev):
    import torch

    from solution import _references as R
    from solution.kernels.add_rmsnorm import _launch_backward, _launch_forward

    # the workload's dtypes: fp32 residual stream, fp16 attention output, fp32 norm weight
    r, x = _randn(15, 40, device=dev, scale=2.0, seed=18), _randn(15, 40, device=dev, dtype=torch.float16, seed=19)
    w = 1 + _randn(40, device=dev, scale=0.5, seed=20)
    kept = {}

    def fwd(r, x):
        h, y, rstd = _launch_forward(r, x, w, EPS, r.shape)
        kept["h"], kept["rstd"] = h, rstd
        return h, y

    def bwd(gh, gy):
        return _launch_backward(kept["h"], w, gy, gh, kept["rstd"])

    errs = _fb(fwd, bwd, lambda r, x: R.add_rmsnorm(r, x, w.to(torch.float64), EPS), [r, x], (0, 1), (0, 1))
    return errs, ("_add_rmsnorm_fwd_kernel", "_add_rmsnorm_bwd_kernel")


def _k_swiglu(dev):
    import torch

    from solution import _references as R
    from solution.kernels.swiglu import swiglu_backward_fp16_of_fp32, swiglu_fp16_of_fp32

    g, u = (_randn(5, 40, device=dev, dtype=torch.float16, scale=2.0, seed=s) for s in (23, 24))

    def bwd(dh):
        dg, du = torch.empty_like(g), torch.empty_like(u)
        swiglu_backward_fp16_of_fp32(dh.to(torch.float16), g, u, dg, du)
        return dg, du

    errs = _fb(swiglu_fp16_of_fp32, bwd, R.swiglu, [g, u], (0, 1), (0,))
    return errs, ("swiglu_fwd", "swiglu_bwd")


def _k_fp32_add(dev):
    import torch

    from solution import _references as R
    from solution.kernels.fp32_add import add_as_fp32

    r, y = _randn(7, 40, device=dev, seed=25), _randn(7, 40, device=dev, dtype=torch.float16, seed=26)
    return {"forward": rel_err(add_as_fp32(r, y), R.residual_add(r.double(), y.double()))}, ("fp32_add_kernel",)


def _k_qkv_grad(dev):
    import torch

    from solution import _references as R
    from solution.kernels.lora_nf4 import DROPOUT_MASK
    from solution.kernels.qkv_grad import qkv_grad_sum

    parts = [_randn(7, 40, device=dev, dtype=torch.float16, seed=40 + i) for i in range(5)]
    masks = [_randn(7, 40, device=dev, seed=50 + i) > -0.5 for i in range(2)]
    aq, bq, ak, av, bv = parts
    scale = 1.0 / 0.7
    ours = qkv_grad_sum(aq, bq, masks[0], ak, av, bv, masks[1], DROPOUT_MASK, scale)
    ref = R.qkv_grad_sum(aq, bq, masks[0], ak, av, bv, masks[1], scale)
    return {"forward": rel_err(ours, ref)}, ("qkv_grad_sum",)


def _k_qkv_rope(dev):
    import torch

    from solution import _references as R
    from solution.kernels import qkv_rope

    n, hq, hk, d = 7, 4, 2, 16
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))  # Qwen2's rotary frequencies
    emb = torch.arange(n, dtype=torch.float32)[:, None] * inv_freq[None]
    emb = torch.cat((emb, emb), -1)[None]
    cos, sin = emb.cos().contiguous().to(dev), emb.sin().contiguous().to(dev)
    f16 = torch.float16
    bq, lq = (_randn(1, n, hq * d, device=dev, dtype=f16, seed=s) for s in (60, 61))
    bk, bv, lv = (_randn(1, n, hk * d, device=dev, dtype=f16, seed=s) for s in (62, 63, 64))
    ours = qkv_rope.forward(bq, lq, 2.0, bk, bv, lv, 2.0, cos, sin, hq, hk, d)
    ref = R.qkv_rope_forward(bq, lq, 2.0, bk, bv, lv, 2.0, cos, sin, hq, hk, d)
    errs = {"forward": max(rel_err(o, r) for o, r in zip(ours, ref))}
    dq, dk, dv = (_randn(1, n, hq, d, device=dev, dtype=f16, seed=s) for s in (65, 66, 67))
    ours = qkv_rope.backward(dq, dk, dv, cos, sin, 2.0, 0.5, hk, True)
    ref = R.qkv_rope_backward(dq, dk, dv, cos, sin, 2.0, 0.5, hk)
    errs["backward"] = max(rel_err(o, r) for o, r in zip(ours, ref))
    return errs, ("qkv_rope_pad", "qkv_rope_unpad")


def _k_attn_varlen(dev):
    import torch

    from solution import _references as R
    from solution.kernels.attn_varlen import varlen_backward, varlen_forward
    from solution.step import packing

    lengths = [5, 2, 7]
    info = packing.make_unpadded(lengths, max(lengths), torch.device(dev))
    q, k, v = (_randn(1, sum(lengths), 2, 16, device=dev, dtype=torch.float16, seed=s) for s in (29, 30, 31))
    scale = 16 ** -0.5
    kept = {}

    def fwd(q, k, v):
        kept["fwd"] = varlen_forward(q, k, v, info.cu_seqlens, info.max_len, scale)
        return kept["fwd"][0]

    def bwd(dout):
        out, lse, seed, offset = kept["fwd"]
        return varlen_backward(dout, q, k, v, out, lse, info.cu_seqlens, seed, offset, info.max_len, scale)

    errs = _fb(fwd, bwd, lambda q, k, v: R.causal_attention_rows(q, k, v, lengths, scale), [q, k, v], (0, 1, 2), (0,))
    return errs, ("efficient_attention_varlen",)


def _k_lm_head_loss(dev):
    import torch

    from solution import _references as R
    from solution.kernels.lm_head_loss import IGNORE_INDEX, fused_lm_head_loss

    vocab = 300  # not a multiple of any block: a ragged last block
    h, w = _randn(2, 7, 32, device=dev, seed=32), _randn(vocab, 32, device=dev, scale=0.3, seed=33)
    gen = torch.Generator().manual_seed(34)
    labels = torch.randint(0, vocab, (2, 7), generator=gen)
    labels[torch.rand((2, 7), generator=gen) < 0.3] = IGNORE_INDEX
    labels = labels.to(dev)
    found = {}

    def ours(h):
        out = fused_lm_head_loss(h, w, labels, compute_dtype=torch.float16)
        found["argmax"] = out.token_argmax
        return out.loss, out.token_entropy

    def ref(h):  # fp16 compute: the matmul's operands are fp16(hidden) and fp16(W), as under autocast
        loss, entropy, logits = R.lm_head_loss(R.as_fp16(h), w.to(torch.float16), labels)
        found["logits"] = logits.detach()
        return loss, entropy

    errs = compare(ours, ref, [h], wrt=(0,), n_grad_outputs=1)
    top2 = found["logits"].topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-2  # rows whose argmax fp16 rounding cannot flip
    wrong = (found["argmax"].reshape(-1).cpu() != found["logits"].argmax(-1).cpu()) & clear.cpu()
    if bool(wrong.any()):
        errs["argmax"] = float("inf")
    return errs, ("_lm_head_ce_rows_kernel",)


def _k_lm_head_grad(dev):
    """kernels/lm_head_grad.py: the backward part of ``_k_lm_head_loss``'s comparison."""
    errs, _ = _k_lm_head_loss(dev)
    return {"backward": errs["backward"]}, ("_lm_head_ce_bwd_kernel",)


# Norm-wise relative error limits against float64: one fp16 rounding errs by at most U16 = 2^-11 relative.
U16 = 2.0 ** -11
FP32_EXACTISH = 1e-5  # fp32 results: a few fp32 roundings and another summation order over <= 64 terms
# (module, check, needs CUDA, limit, why) for every kernel module; "wrong values" must be 0 whatever the limit.
KERNELS = (
    ("nf4_dequant", _k_nf4_dequant, False, 0.0, "bit-exact: the same decoding as bitsandbytes"),
    ("nf4_linear", _k_nf4_linear, False, 2 * U16, "fp16 x and output (one rounding each), fp32 accumulation"),
    ("lora_nf4", _k_lora_nf4, False, 0.0, "bit-exact: casts and torch's dropout value, one rounding each"),
    ("nf4_mlp", _k_nf4_mlp, False, 4 * U16, "four fp16 roundings in a row (x, gate / up, h, y; dy, dh, dg / du)"),
    ("rmsnorm", _k_rmsnorm, False, FP32_EXACTISH, "fp32 input and output"),
    ("add_rmsnorm", _k_add_rmsnorm, False, 2 * U16, "fp32 h and y; x's gradient rounded to fp16 once"),
    ("swiglu", _k_swiglu, False, 2 * U16, "one fp16 rounding of each output, on fp16 inputs"),
    ("fp32_add", _k_fp32_add, False, 1e-6, "one fp32 addition of exact fp32 values"),
    ("qkv_grad", _k_qkv_grad, False, 2 * U16, "fp16 parts summed in fp32, dropout's rounding to fp16"),
    ("qkv_rope", _k_qkv_rope, False, 2 * U16, "two fp16 roundings (the LoRA term, the output)"),
    ("attn_varlen", _k_attn_varlen, True, 4 * U16, "fp16 inputs and outputs, softmax and sums in fp32"),
    ("lm_head_loss", _k_lm_head_loss, False, 4 * U16, "fp16 logits, fp32 softmax: a few fp16 roundings"),
    ("lm_head_grad", _k_lm_head_grad, False, 4 * U16, "the fp16 logit gradient and the fp16 GEMM"),
)
