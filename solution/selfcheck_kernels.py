"""The kernel checks of ``python -m solution.selfcheck`` (solution/selfcheck.py): each of our kernel
modules run on small fresh random inputs, odd sizes included, against an fp32 / fp64 PyTorch
reference (solution/_references.py), forward and backward; ``KERNELS`` lists them. Kernel modules
are imported inside each check, so that selfcheck can turn Triton's interpreter on first.
"""
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
    """Relative errors of ``ours(*args)`` against ``ref(*args in float64)``: each output
    ("forward") and, for the arguments at positions ``wrt``, each gradient ("backward") after
    backpropagating the same random upstream gradients through the first ``n_grad_outputs``
    outputs (default all) of both. Returns {"forward": worst, "backward": worst}."""
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
    """(packed, quant_state) of a random [out_f, in_f] weight quantized by bitsandbytes as the
    workload's (NF4, blocksize 64, double quantization)."""
    import bitsandbytes.functional as bnbF
    import torch

    w = _randn(out_f, in_f, device=device, dtype=torch.float16, scale=0.05, seed=seed)
    return bnbF.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")


def _plan(out_f: int, in_f: int, device: str, seed: int):
    """(LinearPlan, fp16 reference weight, packed) for a random NF4 weight: our plan, and the
    weight decoded by the reference (kept so the plan's weak reference stays alive)."""
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


def _k_nf4_linear(dev):
    from solution import _references as R
    from solution.kernels.nf4_linear import nf4_linear_call

    plan, w16, _packed = _plan(24, 40, dev, seed=3)
    bias16 = _randn(24, device=dev, scale=0.1, seed=4).half()
    x = _randn(3, 5, 40, device=dev, seed=5)
    errs = compare(lambda x: nf4_linear_call(plan, x, bias16), lambda x: R.nf4_linear(x, w16, bias16), [x], wrt=(0,))
    return errs, ("nf4_dequant_cast",)


def _k_lora_nf4(dev):
    import torch

    from solution import _references as R
    from solution.kernels.lora_nf4 import DROPOUT_MASK, lora_dropout, lora_nf4

    plan, w16, _packed = _plan(24, 40, dev, seed=6)
    bias16 = _randn(24, device=dev, scale=0.1, seed=7).half()
    x = _randn(3, 5, 40, device=dev, seed=8)
    lora_a, lora_b = _randn(4, 40, device=dev, scale=0.2, seed=9), _randn(24, 4, device=dev, scale=0.2, seed=10)
    torch.manual_seed(11)
    xd, mask, mode, drop_scale = lora_dropout(torch.nn.Dropout(0.25).train(), x)
    factor = mask.to(torch.float64) * drop_scale if mode == DROPOUT_MASK else mask  # dropout's multiplier
    scaling = 2.0
    errs = compare(lambda x, a, b: lora_nf4(x, a, b, bias16, plan, xd, mask, mode, drop_scale, scaling),
                   lambda x, a, b: R.lora_nf4(x, factor, a, b, w16, bias16, scaling),
                   [x, lora_a, lora_b], wrt=(0, 1, 2))
    return errs, ("nf4_dequant_cast", "lora_combine", "lora_grad_sum", "pair_cast")


def _k_nf4_mlp(dev):
    from solution import _references as R
    from solution.kernels.nf4_mlp import nf4_mlp

    (gate, wg, _pg), (up, wu, _pu) = _plan(72, 40, dev, seed=12), _plan(72, 40, dev, seed=13)
    down, wd, _pd = _plan(40, 72, dev, seed=14)
    x = _randn(3, 5, 40, device=dev, seed=15)
    errs = compare(lambda x: nf4_mlp(x, gate, up, down, "speed"), lambda x: R.nf4_mlp(x, wg, wu, wd),
                   [x], wrt=(0,))
    return errs, ("nf4_dequant_cast", "nf4_dequant", "swiglu_fwd", "swiglu_bwd", "fp32_add_kernel")


def _k_rmsnorm(dev):
    from solution import _references as R
    from solution.kernels.rmsnorm import rmsnorm

    x, w = _randn(7, 40, device=dev, seed=16), 1 + _randn(40, device=dev, scale=0.5, seed=17)
    errs = compare(lambda x, w: rmsnorm(x, w, EPS), lambda x, w: R.rmsnorm(x, w, EPS), [x, w], wrt=(0, 1))
    return errs, ("_rmsnorm_fwd_kernel", "_rmsnorm_bwd_dx_kernel", "_rmsnorm_bwd_dw_kernel")


def _k_add_rmsnorm(dev):
    import torch

    from solution import _references as R
    from solution.kernels.add_rmsnorm import add_rmsnorm

    # the workload's dtypes: fp32 residual stream, fp16 attention output, fp32 norm weight
    r, x = _randn(3, 5, 40, device=dev, scale=2.0, seed=18), _randn(3, 5, 40, device=dev, dtype=torch.float16, seed=19)
    w = 1 + _randn(40, device=dev, scale=0.5, seed=20)
    errs = compare(lambda r, x, w: add_rmsnorm(r, x, w, EPS), lambda r, x, w: R.add_rmsnorm(r, x, w, EPS),
                   [r, x, w], wrt=(0, 1, 2))
    return errs, ("_add_rmsnorm_fwd_kernel", "_add_rmsnorm_bwd_kernel")


def _k_rope(dev):
    import torch

    from solution import _references as R
    from solution.kernels.rope import rope

    b, seq, d = 2, 5, 16
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))  # Qwen2's rotary frequencies
    freqs = torch.arange(seq, dtype=torch.float32)[:, None] * inv_freq[None]
    emb = torch.cat((freqs, freqs), -1)[None].expand(b, -1, -1)
    cos, sin = emb.cos().contiguous().to(dev), emb.sin().contiguous().to(dev)
    q, k = _randn(b, 3, seq, d, device=dev, seed=21), _randn(b, 1, seq, d, device=dev, seed=22)
    errs = compare(rope, R.rope, [q, k, cos, sin], wrt=(0, 1))
    return errs, ("_rope_qk_kernel",)


def _k_swiglu(dev):
    import torch

    from solution import _references as R
    from solution.kernels.swiglu import swiglu

    g, u = (_randn(5, 40, device=dev, dtype=torch.float16, scale=2.0, seed=s) for s in (23, 24))
    errs = compare(swiglu, R.swiglu, [g, u], wrt=(0, 1))
    return errs, ("swiglu_fwd", "swiglu_bwd")


def _k_fp32_add(dev):
    import torch

    from solution import _references as R
    from solution.kernels.fp32_add import residual_add

    r, y = _randn(7, 40, device=dev, seed=25), _randn(7, 40, device=dev, dtype=torch.float16, seed=26)
    errs = compare(residual_add, R.residual_add, [r, y], wrt=(0, 1))
    return errs, ("fp32_add_kernel",)


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


def _k_attn_layout(dev):
    import torch

    from solution import _references as R
    from solution.kernels.attn_layout import pad_heads, unpad_heads
    from solution.step import packing

    lengths, seqlen, rep = [5, 2, 7], 7, 3
    info = packing.make_unpadded(lengths, seqlen, torch.device(dev))
    rows = _randn(sum(lengths), 2, 16, device=dev, seed=27)
    errs = compare(lambda r: pad_heads(r, info, rep, torch.float16), lambda r: R.pad_heads(r, lengths, seqlen, rep),
                   [rows], wrt=(0,))
    padded = _randn(len(lengths), 2, seqlen, 16, device=dev, seed=28)
    more = compare(lambda p: unpad_heads(p, info), lambda p: R.unpad_heads(p, lengths), [padded], wrt=(0,))
    return {k: max(errs[k], more[k]) for k in errs}, ("pad_rows_kernel", "unpad_rows_kernel")


def _k_attn_varlen(dev):
    import torch

    from solution import _references as R
    from solution.kernels.attn_varlen import varlen_causal_attention
    from solution.step import packing

    lengths = [5, 2, 7]
    info = packing.make_unpadded(lengths, max(lengths), torch.device(dev))
    q, k, v = (_randn(1, sum(lengths), 2, 16, device=dev, dtype=torch.float16, seed=s) for s in (29, 30, 31))
    scale = 16 ** -0.5
    errs = compare(lambda q, k, v: varlen_causal_attention(q, k, v, info, scale),
                   lambda q, k, v: R.causal_attention_rows(q, k, v, lengths, scale), [q, k, v], wrt=(0, 1, 2))
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
    """The LM head's backward kernel (kernels/lm_head_grad.py) through the fused loss's gradient
    against fp16 torch's (``_k_lm_head_loss``'s comparison, its backward part)."""
    errs, _ = _k_lm_head_loss(dev)
    return {"backward": errs["backward"]}, ("_lm_head_ce_bwd_kernel",)


# (module, check, needs CUDA); every module of solution/kernels with a Triton kernel or a wrapper
KERNELS = (
    ("nf4_dequant", _k_nf4_dequant, False),
    ("nf4_linear", _k_nf4_linear, False),
    ("lora_nf4", _k_lora_nf4, False),
    ("nf4_mlp", _k_nf4_mlp, False),
    ("rmsnorm", _k_rmsnorm, False),
    ("add_rmsnorm", _k_add_rmsnorm, False),
    ("rope", _k_rope, False),
    ("swiglu", _k_swiglu, False),
    ("fp32_add", _k_fp32_add, False),
    ("qkv_grad", _k_qkv_grad, False),
    ("qkv_rope", _k_qkv_rope, False),
    ("attn_layout", _k_attn_layout, False),
    ("attn_varlen", _k_attn_varlen, True),
    ("lm_head_loss", _k_lm_head_loss, False),
    ("lm_head_grad", _k_lm_head_grad, False),
)
