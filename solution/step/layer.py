"""The decoder layer as ONE autograd node (the packed step's layer; why and measurements: docs/layer_node.md).

``LayerPlan`` holds, once per layer, what stock's ~13 module calls ask at every call; ``LayerPlan.valid``
re-checks it each step. ``_LayerNode`` runs stock's operations in stock's order (the same dropout draws, the
same GEMMs on the same fp16 operands) as one straight sequence of our kernels and cuBLAS GEMMs, and back.

Contract. (a) A layer or step the node does not reproduce gets no plan: the whole step runs stock's forward,
said once (``plans``). (b) Numerics: fp16 roundings placed differently where GEMM shapes differ
(tests/test_default_stack.py; tests/test_layer_node.py: the same dropout draws exactly). (c) Memory: it saves
what stock's nodes save, or less. (d) Gradient checkpointing: under torch's plain checkpoint
(``own_checkpoint``) the node checkpoints itself (``_CheckpointedLayerNode``: the same bits as without);
under another checkpoint function it runs inside it, saving only through ``save_for_backward``.
"""
from __future__ import annotations

import contextlib
import functools
import weakref

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch.autograd.function import once_differentiable

from solution import state
from solution.hooks import global_hooks
from solution.kernels import add_rmsnorm, attn_varlen, fp32_add, nf4_mlp, qkv_rope, rmsnorm
from solution.kernels._launches import record
from solution.kernels.nf4_dequant import MAX_CAST_ELEMENTS
from solution.kernels.lora_nf4 import cast_four, cast_grads, lora_backward_gemms, lora_dropout, lora_forward_gemms
from solution.kernels.qkv_grad import qkv_grad_sum
from solution.say import say_once
from solution.step import attention

_PLANS: "weakref.WeakKeyDictionary" = state.kept(weakref.WeakKeyDictionary())  # layer -> LayerPlan | reason str

NODE_COUNT = "decoder_layer_node"  # counted in kernels/_launches.LAUNCHES per node forward
CHECKPOINT_COUNT = "decoder_layer_node_checkpointed"  # per forward of the node's own checkpointing


# -- the plan -------------------------------------------------------------------------------------

class LoraPlan:
    """One LoRA-on-NF4 projection (q or v): the base weight's LinearPlan, its fp16 bias, the LoRA weights
    (the parameters), the dropout module (lora_dropout reads p and training) and the scaling."""

    __slots__ = ("plan", "bias16", "wa", "wb", "dropout", "scaling")

    def __init__(self, plan, bias16, wa, wb, dropout, scaling):
        self.plan, self.bias16, self.wa, self.wb, self.dropout, self.scaling = plan, bias16, wa, wb, dropout, scaling


class LayerPlan:
    """What the node needs of one decoder layer and that does not change between steps: the LinearPlans of q,
    k, v, o, gate, up, down, k's fp16 bias, the norms' weights and eps, attention's shapes and scale, the MLP's
    memory policy. Made by the planner (patches/qwen2_layer_node.py); ``valid``: its per-step check."""

    __slots__ = ("q", "v", "k", "k_bias16", "o", "mlp", "policy", "norm1_w", "norm2_w", "eps1", "eps2",
                 "n_heads", "n_kv", "head_dim", "scale", "valid")

    def __init__(self, *, q: LoraPlan, v: LoraPlan, k, k_bias16, o, mlp, policy, norm1_w, norm2_w, eps1, eps2,
                 n_heads, n_kv, head_dim, scale, valid):
        self.q, self.v, self.k, self.k_bias16, self.o, self.mlp = q, v, k, k_bias16, o, tuple(mlp)
        self.policy, self.norm1_w, self.norm2_w, self.eps1, self.eps2 = policy, norm1_w, norm2_w, eps1, eps2
        self.n_heads, self.n_kv, self.head_dim, self.scale = n_heads, n_kv, head_dim, scale
        self.valid = valid


# The planner (patches/qwen2_layer_node.py installs it, revert() removes it; None: the node and the packed
# step are off). It answers what needs the libraries' modules:
#   build(layer, x) -> LayerPlan | str
#   step_ok(x) -> bool             fp16 autocast as peft and SDPA read it, for x's device
PLANNER = None


def _transient(x) -> tuple:
    """What a refusal may depend on besides the layer itself: x's dtype and the autocast state."""
    dev = x.device.type
    return (x.dtype, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))


def plan_for(layer, x) -> LayerPlan | None:
    """The layer's plan when the node can run it on x this step, else None (said once). A refusal is kept
    with its ``_transient`` state and asked again when that changes."""
    entry = _PLANS.get(layer)
    if isinstance(entry, LayerPlan):
        if entry.valid():
            return entry
        entry = None
    elif entry is not None and entry[1] != _transient(x):
        entry = None
    if entry is None:
        built = PLANNER.build(layer, x)
        entry = _PLANS[layer] = built if isinstance(built, LayerPlan) else (built, _transient(x))
    if not isinstance(entry, LayerPlan):
        say_once(f"the packed step runs stock's forward: a decoder layer the node does not take ({entry[0]})")
        return None
    return entry


def forget(layer=None) -> None:
    """Drop the cached plan of ``layer`` (all plans when None)."""
    if layer is None:
        _PLANS.clear()
    else:
        _PLANS.pop(layer, None)


# -- one step's context ---------------------------------------------------------------------------

class StepContext:
    """What every layer of one packed forward shares: RoPE's cos / sin [1, N, D] (contiguous: the kernels read
    both with cos's strides), the packed batch, the attention dtype, the mask source (graph slots; None: draw)."""

    __slots__ = ("cos", "sin", "info", "mask_source", "attn_dtype", "n", "native", "rope_takes")

    def __init__(self, cos, sin, info, mask_source=None):
        self.cos = cos if cos.is_contiguous() else cos.contiguous()
        self.sin = sin if sin.is_contiguous() else sin.contiguous()
        self.info, self.mask_source = info, mask_source
        self.attn_dtype = torch.get_autocast_dtype(cos.device.type)
        self.n = info.n_tokens
        self.native = cos.device.type == "cuda"
        self.rope_takes: dict = {}  # head_dim -> kernels/qkv_rope.py takes it with these tables

    def ok(self, x) -> bool:
        """The step's conditions the plans do not cover: fp16 autocast, packed rows with row offsets, RoPE
        tables the kernel takes, no global hooks, ``attention.varlen_works`` (the node has no fallback)."""
        cos = self.cos
        return (PLANNER.step_ok(x) and self.attn_dtype == torch.float16
                and self.info.cu_seqlens is not None and not global_hooks() and x.shape[1] == self.n
                and cos.dtype in (torch.float16, torch.float32) and cos.dim() == 3 and cos.shape[0] == 1
                and cos.shape[1] == self.n and self.sin.shape == cos.shape and self.sin.dtype == cos.dtype
                and attention.varlen_works(x.device, self.attn_dtype, cos.shape[-1]))


def takes(layer, h, ctx: StepContext) -> LayerPlan | None:
    """The layer's plan when the node runs it this step (the caller checked ``ctx.ok(h)``), else None (said
    once): also where kernels/qkv_rope.py does not take the step (``qkv_rope.supported``, fp32 h)."""
    plan = plan_for(layer, h)
    if plan is None:
        return None
    rope_ok = ctx.rope_takes.get(plan.head_dim)
    if rope_ok is None:
        rope_ok = ctx.rope_takes[plan.head_dim] = qkv_rope.supported(plan.head_dim, ctx.cos)
    if not rope_ok or h.dtype != torch.float32:
        say_once(f"the packed step runs stock's forward: kernels/qkv_rope.py does not take this step "
                 f"(head_dim {plan.head_dim}, RoPE tables {tuple(ctx.cos.shape)} {ctx.cos.dtype}, "
                 f"hidden states {h.dtype})")
        return None
    if ctx.n * plan.mlp[0].n_out >= MAX_CAST_ELEMENTS:  # the widest activation, int32-indexed by the casts
        say_once(f"the packed step runs stock's forward: {ctx.n} tokens exceed the casts' int32 indexing")
        return None
    return plan


def apply_node(plan: LayerPlan, h, ctx: StepContext):
    """The layer's output [1, N, H] through the node (``plan`` from ``takes``)."""
    return _LayerNode.apply(h, plan.q.wa, plan.q.wb, plan.v.wa, plan.v.wb, plan, ctx)


def checkpointed(layer) -> bool:
    """The layer recomputes its forward in backward (transformers' gradient checkpointing)."""
    return bool(getattr(layer, "gradient_checkpointing", False)) and layer.training


def plans(layers, h, ctx: StepContext | None) -> list[LayerPlan] | None:
    """Every layer's plan when the node takes them all this step, else None (also for ``ctx`` None)."""
    if ctx is None:
        return None
    out = []
    for layer in layers:
        plan = takes(layer, h, ctx)
        if plan is None:
            return None
        if checkpointed(layer) and not callable(getattr(layer, "_gradient_checkpointing_func", None)):
            return None
        out.append(plan)
    return out


def run_layer(layer, plan: LayerPlan, h, ctx: StepContext, other_checkpoint=None):
    """``apply_node``; checkpointed: ``apply_checkpointed`` if ``own_checkpoint``, else ``other_checkpoint(plan)``."""
    if not checkpointed(layer):
        return apply_node(plan, h, ctx)
    if own_checkpoint(getattr(layer, "_gradient_checkpointing_func", None)):
        return apply_checkpointed(plan, h, ctx)
    return other_checkpoint(plan)


def step_context(cos, sin, info, h, mask_source=None) -> StepContext | None:
    """The step's context when the node may run this forward (planner installed, ``ok``), else None."""
    if PLANNER is None:
        return None
    ctx = StepContext(cos, sin, info, mask_source)
    return ctx if ctx.ok(h) else None


# -- the node -------------------------------------------------------------------------------------

def _lora_forward16(side: LoraPlan, x3, ctx: StepContext, source, ab16, x16=None):
    """q_proj / v_proj on x3 ([1, N, H] fp32) up to its GEMMs: (base16, lora16, x16, saved, mask, mode,
    drop_scale); the mask drawn as peft's call draws it (padded shape) or taken from ``source`` when not None.
    kernels/qkv_rope.py sums base16 and lora16. ``ab16``: fp16 A and B; ``x16``: fp16(x) if already made."""
    xd, mask, mode, drop_scale = lora_dropout(side.dropout, x3, defer=True, packed=ctx.info, mask_source=source)
    base16, lora16, x16, saved = lora_forward_gemms(side.plan, x3, xd, mask, side.wa, side.wb, side.bias16, x16,
                                                    ab16)
    return base16, lora16, x16, saved, mask, mode, drop_scale


def _lora_grads(grads16, dtypes):
    """The four LoRA fp16 gradients (None where not asked for) cast to the weights' dtypes, in one or two launches."""
    if all(g is not None for g in grads16):
        return cast_four(grads16, dtypes)
    return [*cast_grads(grads16[0], grads16[1], dtypes[0], dtypes[1]),
            *cast_grads(grads16[2], grads16[3], dtypes[2], dtypes[3])]


def _projections16(plan: LayerPlan, x3, ctx: StepContext, source):
    """q's, k's and v's fp16 GEMM outputs for kernels/qkv_rope.py in stock's order (q's dropout drawn before
    v's; x cast to fp16 once): (qb16, ql16, kb16, vb16, vl16, q_saved, v_saved, q_mask, v_mask, mode, drop_scale)."""
    weights = (plan.q.wa, plan.q.wb, plan.v.wa, plan.v.wb)
    qa16, qb16_w, va16, vb16_w = cast_four(weights, (torch.float16,) * 4)
    qb16, ql16, x16, q_saved, q_mask, mode, drop_scale = _lora_forward16(plan.q, x3, ctx, source, (qa16, qb16_w))
    wk = plan.k.weight16()  # k_proj: its weight dequantized into the scratch buffer, x16 as it is
    plan.k.dq.launch(wk)
    kb16 = F.linear(x16, wk, plan.k_bias16)
    vb16, vl16, _, v_saved, v_mask, _, _ = _lora_forward16(plan.v, x3, ctx, source, (va16, vb16_w), x16)
    return qb16, ql16, kb16, vb16, vl16, q_saved, v_saved, q_mask, v_mask, mode, drop_scale


def _attention(plan: LayerPlan, qp, kp, vp, ctx: StepContext):
    """Variable-length attention on fp16 inputs [1, N, heads, D]: (out [1, N, Hq * D], saved)."""
    if ctx.native:
        out, lse, seed, offset = attn_varlen.varlen_forward(qp, kp, vp, ctx.info.cu_seqlens, ctx.info.max_len, plan.scale)
        saved = (qp, kp, vp, out, lse, seed, offset)
    else:  # the CPU interpreter: the row-by-row reference (its backward recomputes it with autograd)
        out = attn_varlen.rows_reference(qp, kp, vp, list(ctx.info.lengths), plan.scale)
        saved = (qp, kp, vp)
    return out.reshape(1, ctx.n, -1), saved


def _attention_grads(plan: LayerPlan, d_out16, saved, ctx: StepContext):
    """(dq, dk, dv) [1, N, heads, D] fp16: attention's backward from its output's gradient."""
    n, d = ctx.n, plan.head_dim
    dout = d_out16.view(1, n, plan.n_heads, d)
    if ctx.native:
        qp, kp, vp, out, lse, seed, offset = saved
        return attn_varlen.varlen_backward(dout, qp, kp, vp, out, lse, ctx.info.cu_seqlens, seed, offset,
                                           ctx.info.max_len, plan.scale)
    qp, kp, vp = (t.detach().requires_grad_(True) for t in saved)
    with torch.enable_grad():
        out = attn_varlen.rows_reference(qp, kp, vp, list(ctx.info.lengths), plan.scale)
    return torch.autograd.grad(out, (qp, kp, vp), dout)


def _node_forward(h, plan: LayerPlan, sc: StepContext, masks=None):
    """The layer's forward kernels: (out [1, N, H] fp32, kept, meta): the tensors and plain values
    ``_node_backward`` needs. ``masks``: a mask source instead of ``sc.mask_source`` (checkpointed node), or None."""
    source = sc.mask_source if masks is None else masks
    record(NODE_COUNT, ours=False)  # one per layer forward through the node (tests and reports)
    n, hid = sc.n, h.shape[-1]
    h2d = h.view(n, hid) if h.is_contiguous() else h.reshape(n, hid).contiguous()
    hn, rstd1 = rmsnorm._launch_forward(h2d, plan.norm1_w, plan.eps1)
    # q, k, v's GEMMs; their sums, RoPE and attention's layout in one launch (kernels/qkv_rope.py)
    (qb16, ql16, kb16, vb16, vl16, q_saved, v_saved, q_mask, v_mask, mode,
     drop_scale) = _projections16(plan, hn.view(1, n, hid), sc, source)
    qp, kp, vp = qkv_rope.forward(qb16, ql16, plan.q.scaling, kb16, vb16, vl16, plan.v.scaling, sc.cos, sc.sin,
                                  plan.n_heads, plan.n_kv, plan.head_dim)
    del qb16, ql16, kb16, vb16, vl16
    attn16, att_saved = _attention(plan, qp, kp, vp, sc)
    del qp, kp, vp
    wo, _ = plan.o.dequant_and_cast(attn16)
    o16 = F.linear(attn16, wo)
    h2, y2, rstd2 = add_rmsnorm._launch_forward(h2d, o16.view(n, hid), plan.norm2_w, plan.eps2, (n, hid))
    y16, g16, u16, m16 = nf4_mlp.mlp_forward(y2, *plan.mlp)
    out = fp32_add.add_as_fp32(h2, y16)
    mlp_saved = nf4_mlp.mlp_saved(plan.policy, m16, g16, u16)
    masks = (q_mask, v_mask) if q_mask is not None else ()
    kept = (h2d, rstd1, *q_saved, *v_saved, *masks, *att_saved, h2, rstd2, *mlp_saved)
    meta = (len(q_saved), len(v_saved), len(att_saved), len(mlp_saved), q_mask is not None, mode, drop_scale)
    return out.view(h.shape), kept, meta


def _node_backward(plan: LayerPlan, sc: StepContext, kept, meta, grad_out, needs, dtypes):
    """The backward kernels from ``_node_forward``'s ``kept`` (a list, emptied: each activation is freed once
    used) and ``meta``. ``needs``: which of (h, qa, qb, va, vb) need a gradient; ``dtypes``: the LoRA weights'.
    Returns (grad_h, grad_qa, grad_qb, grad_va, grad_vb)."""
    n_q, n_v, n_att, n_mlp, has_masks, mode, drop_scale = meta
    t = kept
    h2d, rstd1 = t[0], t[1]
    i = 2
    q_saved, v_saved = tuple(t[i:i + n_q]), tuple(t[i + n_q:i + n_q + n_v])
    i += n_q + n_v
    q_mask = v_mask = None
    if has_masks:
        q_mask, v_mask = t[i], t[i + 1]
        i += 2
    att_saved = tuple(t[i:i + n_att])
    i += n_att
    h2, rstd2 = t[i], t[i + 1]
    mlp_saved = tuple(t[i + 2:i + 2 + n_mlp])
    t.clear()
    need_h, need_qa, need_qb, need_va, need_vb = needs
    n, hid = h2d.shape
    g2 = grad_out.reshape(n, hid)
    if not g2.is_contiguous():
        g2 = g2.contiguous()
    # the residual add hands g to h2 and fp16(g) to the MLP (cast in the down weight's dequantization launch)
    dy = nf4_mlp.mlp_backward(plan.mlp, plan.policy, mlp_saved, g2)
    del mlp_saved
    d_res, d_o16 = add_rmsnorm._launch_backward(h2, plan.norm2_w, dy, g2, rstd2)
    del dy
    d_attn16 = plan.o.input_grad16(d_o16)
    # attention's gradients to the projections' fp16 GEMM inputs; k's input gradient only when x needs one
    dq, dk, dv = _attention_grads(plan, d_attn16, att_saved, sc)
    del att_saved, d_attn16
    gq16, gsq16, gk16, gv16, gsv16 = qkv_rope.backward(dq, dk, dv, sc.cos, sc.sin, plan.q.scaling,
                                                       plan.v.scaling, plan.n_kv, need_h)
    del dq, dk, dv
    # autograd ran v_proj's backward first, then k_proj's, then q_proj's
    av, bv, grad_va, grad_vb = lora_backward_gemms(plan.v.plan, gv16, gsv16, v_saved, need_h, need_va, need_vb)
    ak = plan.k.input_grad16(gk16) if need_h else None
    aq, bq, grad_qa, grad_qb = lora_backward_gemms(plan.q.plan, gq16, gsq16, q_saved, need_h, need_qa, need_qb)
    grad_qa, grad_qb, grad_va, grad_vb = _lora_grads((grad_qa, grad_qb, grad_va, grad_vb), dtypes)
    grad_h = None
    if need_h:
        d_hn = qkv_grad_sum(aq, bq, q_mask, ak, av, bv, v_mask, mode, drop_scale)
        grad_h = rmsnorm._launch_backward_dx(h2d, plan.norm1_w, d_hn.view(n, hid), rstd1)
        grad_h += d_res  # autograd's sum of h's two gradients (residual and norm; commutative)
        grad_h = grad_h.view(grad_out.shape)
    return grad_h, grad_qa, grad_qb, grad_va, grad_vb


def _keep_plain(ctx, plan, sc, *loras) -> None:
    """What both nodes keep besides tensors: the plan, the step's context, the LoRA weights' dtypes."""
    ctx.plan, ctx.sc = plan, sc
    ctx.dtypes = tuple(w.dtype for w in loras)
    ctx.consumed = False


def _consume(ctx) -> None:
    """One backward per forward: the first one reuses the saved activations' memory."""
    if ctx.consumed:
        raise RuntimeError("decoder-layer node: a second backward through the same graph is not supported "
                           "(the first one reused the saved activations' memory)")
    ctx.consumed = True


class _LayerNode(torch.autograd.Function):
    """out = Qwen2DecoderLayer(h) on packed rows [1, N, H] fp32; gradients for h and q's and v's A and B."""

    @staticmethod
    def forward(ctx, h, qa, qb, va, vb, plan: LayerPlan, sc: StepContext):
        out, kept, ctx.meta = _node_forward(h, plan, sc)
        ctx.save_for_backward(*kept)
        _keep_plain(ctx, plan, sc, qa, qb, va, vb)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        _consume(ctx)
        grads = _node_backward(ctx.plan, ctx.sc, list(ctx.saved_tensors), ctx.meta, grad_out,
                               ctx.needs_input_grad[:5], ctx.dtypes)
        return (*grads, None, None)


# -- gradient checkpointing inside the node -------------------------------------------------------

def _rng_state(device: torch.device):
    """The state of the generator the layer's dropout draws from (the device's; the CPU's on the CPU)."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


@contextlib.contextmanager
def _generator_at(state, device: torch.device):
    """Within this block ``device``'s dropout generator is at ``state``; after it, where it was (``fork_rng``)."""
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else []):  # the CPU's state is always forked
        if cuda:
            torch.cuda.set_rng_state(state, device)
        else:
            torch.set_rng_state(state)
        yield


class _RecordedMasks:
    """A mask source that hands out ``source``'s masks and keeps them (the checkpointed node in a CUDA graph)."""

    def __init__(self, source):
        self.source, self.masks = source, []

    def take(self, p: float, x: torch.Tensor) -> torch.Tensor:
        mask = self.source.take(p, x)
        self.masks.append((float(p), mask))
        return mask


class _ReplayedMasks:
    """A mask source that hands out the masks a ``_RecordedMasks`` kept, in order: the recompute takes the
    very masks its forward took (the values stock's recompute redraws from the restored generator)."""

    def __init__(self, masks):
        self.masks, self.i = masks, 0

    def take(self, p: float, x: torch.Tensor) -> torch.Tensor:
        kept_p, mask = self.masks[self.i]
        self.i += 1
        if kept_p != float(p) or mask.shape != x.shape:
            raise RuntimeError(f"checkpointed decoder-layer node: the recompute's dropout call {self.i - 1} "
                               f"(p={p}, {tuple(x.shape)}) is not the forward's (p={kept_p}, {tuple(mask.shape)})")
        return mask


class _CheckpointedLayerNode(torch.autograd.Function):
    """The node under gradient checkpointing: the forward keeps only the layer's input and where its masks
    came from; the backward recomputes the forward's kernels with the same masks, then runs the node's
    backward. Masks drawn eagerly: the generator's state is kept and set again in ``_generator_at`` (it ends
    where the forward left it, as torch's checkpoint leaves it). Masks from ``sc.mask_source`` (a CUDA
    graph's slots): the masks are kept and taken again, no generator touched (so it can be captured)."""

    @staticmethod
    def forward(ctx, h, qa, qb, va, vb, plan: LayerPlan, sc: StepContext):
        record(CHECKPOINT_COUNT, ours=False)
        dev = h.device.type
        ctx.autocast = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev), torch.is_autocast_cache_enabled())
        if sc.mask_source is None:
            ctx.rng, ctx.masks = _rng_state(h.device), None
            out, _, _ = _node_forward(h, plan, sc)
        else:
            recorded = _RecordedMasks(sc.mask_source)
            out, _, _ = _node_forward(h, plan, sc, recorded)
            ctx.rng, ctx.masks = None, recorded.masks
        ctx.save_for_backward(h)
        _keep_plain(ctx, plan, sc, qa, qb, va, vb)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        _consume(ctx)
        (h,) = ctx.saved_tensors
        dev = h.device
        enabled, dtype, cache = ctx.autocast  # the forward's autocast state, as torch's checkpoint restores it
        masks = None if ctx.masks is None else _ReplayedMasks(ctx.masks)
        draws = contextlib.nullcontext() if masks is not None else _generator_at(ctx.rng, dev)
        with draws, torch.no_grad(), torch.autocast(dev.type, dtype=dtype, enabled=enabled, cache_enabled=cache):
            _, kept, meta = _node_forward(h, ctx.plan, ctx.sc, masks)
        ctx.masks = None
        del h
        kept = list(kept)  # _node_backward empties it: each activation is freed once used
        grads = _node_backward(ctx.plan, ctx.sc, kept, meta, grad_out, ctx.needs_input_grad[:5], ctx.dtypes)
        return (*grads, None, None)


def apply_checkpointed(plan: LayerPlan, h, ctx: StepContext):
    """The layer's output through the node's own checkpointing (the caller checked ``own_checkpoint``)."""
    return _CheckpointedLayerNode.apply(h, plan.q.wa, plan.q.wb, plan.v.wa, plan.v.wb, plan, ctx)


# checkpoint's keywords the node reproduces (debug, determinism_check only report a recompute that differs)
_OWN_CHECKPOINT_OPTIONS = frozenset({"use_reentrant", "preserve_rng_state", "debug", "determinism_check"})


def own_checkpoint(checkpoint_fn) -> bool:
    """``checkpoint_fn`` (a layer's ``_gradient_checkpointing_func``) is torch's plain checkpoint with options
    the node reproduces: use_reentrant either way, preserve_rng_state on, no context_fn. Attribute reads only."""
    if (not isinstance(checkpoint_fn, functools.partial) or checkpoint_fn.func is not torch_checkpoint.checkpoint
            or checkpoint_fn.args):
        return False
    kw = checkpoint_fn.keywords
    return kw.get("preserve_rng_state", True) is True and kw.keys() <= _OWN_CHECKPOINT_OPTIONS
