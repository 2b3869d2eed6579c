"""LoRA on a frozen NF4 linear (peft's ``lora.bnb.Linear4bit``: q_proj, v_proj) as the decoder-layer
node runs it: ``lora_dropout`` (torch's dropout op, the mask drawn over stock's padded shape:
``draw_padded_mask``), ``dequant_and_cast_inputs`` (W dequantized, x and dropout(x) cast to fp16,
one launch), ``lora_forward_gemms`` / ``lora_backward_gemms`` (cuBLAS, fp16) and the LoRA weights'
casts fp32 <-> fp16 in one launch (``cast_pair``, ``cast_four``, ``cast_grads``).
What it replaces, why, risks, measurements: docs/kernels/lora_nf4.md.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from solution.kernels._device import runs_here
from solution.kernels._launches import cdiv, launch
from solution.kernels.nf4_dequant import MAX_CAST_ELEMENTS

# dropout modes (how the LoRA input gradient goes through dropout's backward)
NO_DROPOUT, DROPOUT_MASK, DROPOUT_NOISE = 0, 1, 2


@triton.jit(do_not_specialize=["n0", "n1"])
def pair_cast_kernel(src0_ptr, dst0_ptr, n0, src1_ptr, dst1_ptr, n1, BLOCK: tl.constexpr):
    """Two casts in one launch: dst0 = src0 in dst0's dtype over n0 elements (the first
    cdiv(n0, BLOCK) programs), dst1 likewise (the rest); round to nearest even, as torch's ``.to``."""
    pid = tl.program_id(0)
    first = tl.cdiv(n0, BLOCK)
    if pid < first:
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n0
        tl.store(dst0_ptr + offs, tl.load(src0_ptr + offs, mask=mask).to(dst0_ptr.dtype.element_ty), mask=mask)
    else:
        offs = (pid - first) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n1
        tl.store(dst1_ptr + offs, tl.load(src1_ptr + offs, mask=mask).to(dst1_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _cast_range(src_ptr, dst_ptr, n, pid, BLOCK: tl.constexpr):
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask).to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n0", "n1", "n2", "n3"])
def quad_cast_kernel(src0_ptr, dst0_ptr, n0, src1_ptr, dst1_ptr, n1, src2_ptr, dst2_ptr, n2,
                     src3_ptr, dst3_ptr, n3, BLOCK: tl.constexpr):
    """Four casts in one launch (``pair_cast_kernel``'s), program ranges of cdiv(n_i, BLOCK) in order."""
    pid = tl.program_id(0)
    e0 = tl.cdiv(n0, BLOCK)
    e1 = e0 + tl.cdiv(n1, BLOCK)
    e2 = e1 + tl.cdiv(n2, BLOCK)
    if pid < e0:
        _cast_range(src0_ptr, dst0_ptr, n0, pid, BLOCK)
    elif pid < e1:
        _cast_range(src1_ptr, dst1_ptr, n1, pid - e0, BLOCK)
    elif pid < e2:
        _cast_range(src2_ptr, dst2_ptr, n2, pid - e1, BLOCK)
    else:
        _cast_range(src3_ptr, dst3_ptr, n3, pid - e2, BLOCK)


PAIR_CAST_BLOCK = 4096  # the LoRA weights: 16 x 1536 = 24,576 elements (6 programs), v's B 4,096 (1)
# the casts training makes (fp32 LoRA weights): fp32 -> fp16 forward, fp16 -> fp32 backward.
# bf16 is left to torch: the interpreter's bf16 conversion did not round as torch does (CPU test).
_PAIR_CASTS = {(torch.float32, torch.float16), (torch.float16, torch.float32)}


def _one_launch_casts(tensors, dtypes) -> bool:
    """Can one of our cast launches make every ``t.to(dt)`` here: all the same ``_PAIR_CASTS`` cast
    (fp32 -> fp16 or fp16 -> fp32), contiguous tensors, one device where our kernels run."""
    first = tensors[0]
    cast = (first.dtype, dtypes[0])
    if cast not in _PAIR_CASTS or not runs_here(first.device):
        return False
    for t, dt in zip(tensors, dtypes):
        if t.dtype != cast[0] or dt != cast[1] or t.device != first.device or not t.is_contiguous():
            return False
    return True


def cast_pair(a: torch.Tensor, b: torch.Tensor, a_dtype: torch.dtype, b_dtype: torch.dtype):
    """(a.to(a_dtype), b.to(b_dtype)): one launch when ``_one_launch_casts`` allows, else torch's
    ``.to`` for each (a tensor already in its dtype is returned as it is)."""
    if not _one_launch_casts((a, b), (a_dtype, b_dtype)):
        return a.to(a_dtype), b.to(b_dtype)
    a_out = torch.empty(a.shape, dtype=a_dtype, device=a.device)
    b_out = torch.empty(b.shape, dtype=b_dtype, device=b.device)
    n0, n1 = a.numel(), b.numel()
    launch(pair_cast_kernel, (cdiv(n0, PAIR_CAST_BLOCK) + cdiv(n1, PAIR_CAST_BLOCK),), "pair_cast",
           a, a_out, n0, b, b_out, n1, BLOCK=PAIR_CAST_BLOCK, num_warps=4)
    return a_out, b_out


def cast_four(tensors, dtypes):
    """[t.to(dt) for t, dt in zip(tensors, dtypes)] for four tensors: one launch when
    ``_one_launch_casts`` allows, else ``cast_pair`` twice."""
    a, b, c, d = tensors
    dst = dtypes[0]
    if not _one_launch_casts(tensors, dtypes):
        return [*cast_pair(a, b, dtypes[0], dtypes[1]), *cast_pair(c, d, dtypes[2], dtypes[3])]
    outs = [torch.empty(t.shape, dtype=dst, device=a.device) for t in tensors]
    ns = [t.numel() for t in tensors]
    args = []
    for t, o, n in zip(tensors, outs, ns):
        args += (t, o, n)
    grid = (sum(cdiv(n, PAIR_CAST_BLOCK) for n in ns),)
    launch(quad_cast_kernel, grid, "quad_cast", *args, PAIR_CAST_BLOCK, num_warps=4)
    return outs


def _dropout_is_native(x: torch.Tensor) -> bool:
    """Does ``F.dropout`` run ``native_dropout`` for x? (``at::dropout``'s is_fused_kernel_acceptable:
    CUDA / XPU / lazy / privateuse1 tensors; the caller already checked 0 < p < 1 and x non-empty.)"""
    return x.device.type == "cuda"


class _Deferred:
    """Dropout's value not materialized: the cast launch computes fp16(dropout(x)) (CAST_B 3)."""

    def __init__(self, scale: float):
        self.scale = scale


def padded_draw_shape(x: torch.Tensor, packed) -> tuple[int, int] | None:
    """When x [.., N, H] holds the N packed real-token rows of ``packed`` (step/packing.py's
    Unpadded): [batch * seqlen, H], the padded shape a random draw must have to consume the
    generator as stock does (its real rows: ``idx``). None otherwise (draw over x itself)."""
    if packed is None or x.dim() < 2 or x.shape[:-1].numel() != packed.n_tokens:
        return None
    return (packed.batch * packed.seqlen, x.shape[-1])


def draw_padded_mask(p: float, padded_shape, dtype: torch.dtype, idx: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """LoRA dropout's bool mask on CUDA as stock draws it: ``native_dropout`` over ``padded_shape``
    in ``dtype``, then the rows ``idx`` (into ``out`` when given, else a new [len(idx), hidden]).
    The input is left uninitialized: the mask depends only on the random numbers. The one place the
    padded draw is written (lora_dropout, the node and step/cuda_graphs.py call it)."""
    _, mask = torch.native_dropout(torch.empty(padded_shape, dtype=dtype, device=idx.device), p, True)
    if out is None:
        return mask.index_select(0, idx)
    return torch.index_select(mask, 0, idx, out=out)


def draws(dropout: torch.nn.Module) -> bool:
    """``lora_dropout`` draws a mask for this module (an ``nn.Dropout`` in training with p > 0; not
    ``nn.Identity``, eval mode or p == 0)."""
    return not (isinstance(dropout, torch.nn.Identity) or not dropout.training or dropout.p == 0)


def lora_dropout(dropout: torch.nn.Module, x: torch.Tensor, defer: bool = False, packed=None, mask_source=None):
    """``dropout(x)`` for a plain ``nn.Dropout`` / ``nn.Identity`` with the ops and random numbers of
    torch's ``F.dropout`` (CUDA: ``native_dropout``, bool mask; CPU: the composite's Bernoulli
    noise / (1 - p)), keeping the mask: (xd, mask, mode, scale), xd None for the identity. The
    caller checked 0 <= p < 1 and inplace=False. ``defer`` (training; False: the tests' reference):
    xd a ``_Deferred`` for a fusable x. ``packed`` (step/packing.py's Unpadded, or None): draw over
    stock's padded shape. ``mask_source``: on CUDA, the masks of a CUDA graph's replay, or None."""
    if not draws(dropout):
        return None, None, NO_DROPOUT, 1.0
    p = dropout.p
    # Packed real tokens of a right-padded batch: draw over stock's padded shape, keep the real
    # rows, so the random numbers are stock's.
    padded_shape = padded_draw_shape(x, packed)
    with torch.no_grad():  # the node's backward makes the whole input gradient, dropout's part included
        if _dropout_is_native(x):
            if mask_source is not None:
                # a CUDA graph's replay: the mask was drawn before it, as below
                mask = mask_source.take(p, x)
            elif padded_shape is None:
                xd, mask = torch.native_dropout(x, p, True)
                return xd, mask, DROPOUT_MASK, 1.0 / (1.0 - p)
            else:
                mask = draw_padded_mask(p, padded_shape, x.dtype, packed.idx).view(x.shape)
            # native_dropout's value: src * keep * scale, scale = 1 / (1 - p) in fp32
            if defer and _fusable(x):
                xd = _Deferred(_native_dropout_scale(p))
            else:
                xd = x * mask * _native_dropout_scale(p)
            return xd, mask, DROPOUT_MASK, 1.0 / (1.0 - p)
        if padded_shape is None:
            noise = torch.empty_like(x).bernoulli_(1 - p)
        else:
            noise = torch.empty(padded_shape, dtype=x.dtype, device=x.device).bernoulli_(1 - p)
            noise = noise.index_select(0, packed.idx).view(x.shape)
        noise.div_(1 - p)
        return x * noise, noise, DROPOUT_NOISE, 1.0


@functools.lru_cache(maxsize=64)
def _native_dropout_scale(p: float) -> float:
    """The scale native_dropout's CUDA kernel multiplies by: 1 / (1 - p) computed in fp32."""
    one = torch.tensor(1.0, dtype=torch.float32)
    return float(one / torch.tensor(1.0 - p, dtype=torch.float32))


def _fusable(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.is_contiguous() and t.numel() < MAX_CAST_ELEMENTS


def dequant_and_cast_inputs(plan, x: torch.Tensor, xd, drop_mask=None, x16=None):
    """(w16, x16, xd16): one launch dequantizes W and casts x and dropout(x) to fp16 (fp32
    contiguous ones; torch casts the others). xd a ``_Deferred``: the launch computes
    fp16((x * drop_mask) * scale). ``x16`` given: x is not cast again."""
    w16 = plan.weight16()
    if isinstance(xd, _Deferred):  # lora_dropout checked that x is fusable
        xd16 = torch.empty(x.shape, dtype=torch.float16, device=x.device)
        if x16 is None:
            x16 = torch.empty(x.shape, dtype=torch.float16, device=x.device)
            plan.dq.launch(w16, a=x, a16=x16, b=drop_mask, b16=xd16, cast_b=3, scaling=xd.scale)
        else:
            plan.dq.launch(w16, a=x, b=drop_mask, b16=xd16, cast_b=3, scaling=xd.scale)
        return w16, x16, xd16
    jobs = []
    if x16 is None and _fusable(x):
        x16 = torch.empty(x.shape, dtype=torch.float16, device=x.device)
        jobs.append((x, x16))
    elif x16 is None:
        x16 = x if x.dtype == torch.float16 else x.to(torch.float16)
    if xd is None:
        xd16 = x16
    elif _fusable(xd):
        xd16 = torch.empty(xd.shape, dtype=torch.float16, device=xd.device)
        jobs.append((xd, xd16))
    else:
        xd16 = xd if xd.dtype == torch.float16 else xd.to(torch.float16)
    if not jobs:
        plan.dq.launch(w16)
    elif len(jobs) == 1:
        plan.dq.launch(w16, a=jobs[0][0], a16=jobs[0][1])
    else:
        plan.dq.launch(w16, a=x, a16=x16, b=xd, b16=xd16, cast_b=1)
    return w16, x16, xd16


def lora_forward_gemms(plan, x, xd, drop_mask, lora_a, lora_b, bias16, x16=None, ab16=None):
    """One projection's forward GEMMs: (base16, lora16, x16, saved): the fp16 base output (bias
    included) and LoRA B output (summed by qkv_rope.py), saved = (xd16, h16, a16, b16) for
    ``lora_backward_gemms``. ``ab16``: (fp16 A, fp16 B) cast by the caller, or None."""
    w16, x16, xd16 = dequant_and_cast_inputs(plan, x, xd, drop_mask, x16)
    base16 = F.linear(x16, w16, bias16)
    # autocast's two casts, one launch
    a16, b16 = cast_pair(lora_a, lora_b, torch.float16, torch.float16) if ab16 is None else ab16
    h16 = F.linear(xd16, a16)
    lora16 = F.linear(h16, b16)
    # the fp16 casts of A and B are saved (stock autocast saves them too), so backward does not cast again
    return base16, lora16, x16, (xd16, h16, a16, b16)


def lora_backward_gemms(plan, g16, gs16, saved, need_x, need_a, need_b):
    """One projection's backward GEMMs from g16 = fp16(grad_out) and gs16 = fp16(g16 * scaling):
    (grad_base16 (only when need_x), grad_xd16, grad_a, grad_b), all fp16."""
    grad_xd16, grad_a, grad_b = _lora_backward_gemms(gs16, saved, need_x, need_a, need_b)
    return (plan.input_grad16(g16) if need_x else None), grad_xd16, grad_a, grad_b


def cast_grads(grad_a, grad_b, a_dtype, b_dtype):
    """A's and B's fp16 gradients (None where not asked for) in the weights' dtypes: autograd's two
    casts, in one launch when both are there (``cast_pair``)."""
    if grad_a is not None and grad_b is not None:
        return cast_pair(grad_a, grad_b, a_dtype, b_dtype)
    return None if grad_a is None else grad_a.to(a_dtype), None if grad_b is None else grad_b.to(b_dtype)


def _lora_backward_gemms(gs16, saved, need_x, need_a, need_b):
    """The LoRA side's backward GEMMs: (grad_xd16, grad_a, grad_b), all fp16."""
    xd16, h16, a16, b16 = saved
    n_out, r, n_in = gs16.shape[-1], h16.shape[-1], xd16.shape[-1]
    grad_a = grad_b = grad_xd16 = None
    if need_b:  # lora_B: grad_weight = gs^T h
        grad_b = gs16.reshape(-1, n_out).t().mm(h16.reshape(-1, r))
    if need_a or need_x:
        grad_h16 = torch.matmul(gs16, b16)  # [..., r]
        if need_a:  # lora_A: grad_weight = grad_h^T xd16
            grad_a = grad_h16.reshape(-1, r).t().mm(xd16.reshape(-1, n_in))
    if need_x:
        grad_xd16 = torch.matmul(grad_h16, a16)
    return grad_xd16, grad_a, grad_b


def sm75_specs():
    """The A / B casts training launches: fp32 -> fp16 forward, fp16 -> fp32 backward."""
    for src, dst in (("fp32", "fp16"), ("fp16", "fp32")):
        sig = {}
        for i in range(4):
            sig.update({f"src{i}_ptr": f"*{src}", f"dst{i}_ptr": f"*{dst}", f"n{i}": "i32"})
        yield {
            "name": f"quad_cast({src}->{dst})", "fn": quad_cast_kernel,
            "signature": {**sig, "BLOCK": "constexpr"}, "constexprs": {"BLOCK": PAIR_CAST_BLOCK}, "num_warps": 4,
        }
    for src, dst in (("fp32", "fp16"), ("fp16", "fp32")):
        yield {
            "name": f"pair_cast({src}->{dst})", "fn": pair_cast_kernel,
            "signature": {"src0_ptr": f"*{src}", "dst0_ptr": f"*{dst}", "n0": "i32",
                          "src1_ptr": f"*{src}", "dst1_ptr": f"*{dst}", "n1": "i32", "BLOCK": "constexpr"},
            "constexprs": {"BLOCK": PAIR_CAST_BLOCK}, "num_warps": 4,
        }
