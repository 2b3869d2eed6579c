"""Plain PyTorch references of what solution/kernels compute, for the self-check: each kernel's formula in
float64 (inputs widened first), differentiable (the reference gradients come from autograd), the kernels'
output shapes (``nf4_dequant``: float32, the exact product bitsandbytes rounds once to fp16). Torch only.
"""
from __future__ import annotations

import math

import torch


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64)


def as_fp16(x: torch.Tensor) -> torch.Tensor:
    """float64 holding fp16(x), the gradient passing straight through (as autograd's cast backward does)."""
    x = _f64(x)
    return x + (_f64(x.detach().to(torch.float16)) - x.detach())


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen2RMSNorm: weight * x / sqrt(mean(x^2 over the last dim) + eps)."""
    x = _f64(x)
    return _f64(weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def add_rmsnorm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float):
    """(h, y): h = residual + x, y = rmsnorm(h)."""
    h = _f64(residual) + _f64(x)
    return h, rmsnorm(h, weight, eps)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1): x * cos + rotate_half(x) * sin, with
    q [B, Hq, L, D], k [B, Hk, L, D], cos / sin [B or 1, L, D] broadcast over the heads."""
    c, s = _f64(cos)[:, None], _f64(sin)[:, None]

    def rotate(x):
        x = _f64(x)
        half = x.shape[-1] // 2
        return x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s

    return rotate(q), rotate(k)


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u = g * sigmoid(g) * u."""
    g = _f64(g)
    return g * torch.sigmoid(g) * _f64(u)


def residual_add(residual: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """residual + y."""
    return _f64(residual) + _f64(y)


def qkv_grad_sum(aq, bq, mq, ak, av, bv, mv, keep_scale: float) -> torch.Tensor:
    """x's gradient from q's, k's and v's: q and v each ``a + keep * b * keep_scale`` (base part plus
    the LoRA part through dropout's backward; masks bool), k's ``a``; summed ((v + k) + q)."""
    q = _f64(aq) + _f64(mq) * _f64(bq) * keep_scale
    v = _f64(av) + _f64(mv) * _f64(bv) * keep_scale
    return (v + _f64(ak)) + q


def qkv_rope_forward(bq, lq, q_scaling, bk, bv, lv, v_scaling, cos, sin, n_heads, n_kv, head_dim):
    """Attention's inputs [1, N, heads, D] from the projections' outputs [1, N, heads * D]:
    q = rope(bq + lq * q_scaling), k = rope(bk), v = bv + lv * v_scaling, k's and v's heads
    repeated n_heads / n_kv times (repeat_kv: head h from head h // rep)."""
    n, rep = cos.shape[1], n_heads // n_kv
    q = (_f64(bq) + _f64(lq) * q_scaling).view(1, n, n_heads, head_dim).transpose(1, 2)
    k = _f64(bk).view(1, n, n_kv, head_dim).transpose(1, 2)
    v = (_f64(bv) + _f64(lv) * v_scaling).view(1, n, n_kv, head_dim)
    q, k = rope(q, k, cos, sin)
    return (q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2))


def qkv_rope_backward(dq, dk, dv, cos, sin, q_scaling, v_scaling, n_kv):
    """The gradients qkv_rope's backward hands the projections ([1, N, heads * D] each): q's
    g = rope^T(dq) and g * q_scaling, k's rope^T(sum of dk over each head's repeats), v's
    g = that sum of dv and g * v_scaling. rope^T is RoPE's transposed map: rope by -angle."""
    _, n, n_heads, d = dq.shape
    rep = n_heads // n_kv
    dk_sum = _f64(dk).view(1, n, n_kv, rep, d).sum(3)
    dv_sum = _f64(dv).view(1, n, n_kv, rep, d).sum(3)
    gq, gk = rope(_f64(dq).transpose(1, 2), dk_sum.transpose(1, 2), cos, -_f64(sin))
    gq, gk, gv = (t.reshape(1, n, -1) for t in (gq.transpose(1, 2), gk.transpose(1, 2), dv_sum))
    return gq, gq * q_scaling, gk, gv, gv * v_scaling


def nf4_dequant(packed: torch.Tensor, quant_state) -> torch.Tensor:
    """bitsandbytes' NF4 storage decoded: element 2i is byte i's high nibble, 2i+1 its low one, each an index
    into the state's 16 levels; a block's scale with double quantization is fp32(code2[q] * absmax2[block //
    blocksize2]) + offset (two fp32 roundings, as bnb); value = fp32(NF4[code] * scale), shaped as the state."""
    qs = quant_state
    n = math.prod(qs.shape)
    flat = packed.reshape(-1).view(torch.uint8).to(torch.int64)
    codes = torch.stack([flat >> 4, flat & 15], 1).reshape(-1)[:n]
    if qs.nested:
        q = qs.absmax.to(torch.int64)
        absmax2 = qs.state2.absmax.float().repeat_interleave(qs.state2.blocksize)[: q.numel()]
        scale = (qs.state2.code.float()[q] * absmax2) + qs.offset.float()
    else:
        scale = qs.absmax.float()
    levels = qs.code.float()  # the 16 NF4 levels, bitsandbytes' own table in the quant state
    return (levels[codes] * scale.repeat_interleave(qs.blocksize)[:n]).reshape(qs.shape)


def nf4_linear(x: torch.Tensor, weight16: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """bnb Linear4bit under fp16 compute: fp16(x) @ W^T + fp16(bias), W the dequantized fp16 weight."""
    out = as_fp16(x) @ _f64(weight16).t()
    return out if bias is None else out + _f64(bias.detach().to(torch.float16))


def nf4_mlp(x, gate16, up16, down16) -> torch.Tensor:
    """Qwen2MLP over three NF4 layers: down(silu(gate(x)) * up(x)), fp16 weights, no biases."""
    return swiglu(nf4_linear(x, gate16, None), nf4_linear(x, up16, None)) @ _f64(down16).t()


def causal_attention_rows(q, k, v, lengths: list[int], scale: float) -> torch.Tensor:
    """Causal attention of each packed row on its own: q, k, v [1, N, H, D] -> [1, N, H, D]."""
    outs = []
    for qi, ki, vi in zip(_f64(q).split(lengths, 1), _f64(k).split(lengths, 1), _f64(v).split(lengths, 1)):
        qi, ki, vi = (t[0].transpose(0, 1) for t in (qi, ki, vi))  # [H, L, D]
        scores = qi @ ki.transpose(-1, -2) * scale
        length = scores.shape[-1]
        mask = torch.ones(length, length, dtype=torch.bool, device=scores.device).tril()
        outs.append((scores.masked_fill(~mask, float("-inf")).softmax(-1) @ vi).transpose(0, 1)[None])
    return torch.cat(outs, dim=1)


def lm_head_loss(hidden: torch.Tensor, weight: torch.Tensor, shift_labels: torch.Tensor,
                 ignore_index: int = -100):
    """(loss, token_entropy, logits) for hidden [..., H], weight [V, H], shift_labels [...]: mean cross-entropy
    over labels not ignore_index; -sum p log p of softmax(hidden @ W^T) at every token."""
    logits = _f64(hidden).reshape(-1, hidden.shape[-1]) @ _f64(weight).t()
    labels = shift_labels.reshape(-1)
    logp = logits.log_softmax(-1)
    valid = labels != ignore_index
    picked = logp[valid].gather(1, labels[valid][:, None])[:, 0]
    loss = -picked.sum() / valid.sum()
    entropy = -(logp.exp() * logp).sum(-1)
    return loss, entropy.view(shift_labels.shape), logits
