"""Triton RoPE (solution/kernels/rope.py) against an fp64 reference and against stock
transformers' apply_rotary_pos_emb: forward, grad q, grad k; Qwen2's real layouts (view + transpose
of the projections: non-contiguous), odd sizes, both dtypes and mixed q/cos dtypes, broadcast
cos/sin batch, torch.utils.checkpoint, the patch's install / fallback / revert, and a tiny Qwen2
model whose loss and every gradient must match with and without solution.apply() (this exercises
both this op and the RMSNorm kernel inside a real model).

Exactness: the kernel rounds every product and sum to the result dtype where stock does, with
fused multiply-add disabled, so it must equal stock BIT FOR BIT (torch.equal) in fp32, fp16 and
mixed dtypes, forward and backward. Against the exact fp64 math (relative L2 error, rel_err):
  * fp32 results: 1e-6 (two products and one add, each rounded at 6e-8).
  * fp16 results: 2e-3 (three fp16 roundings of 2^-11 ~ 4.9e-4 relative each, like stock).
Tiny model with RMSNorm + RoPE: see _combined_tolerances (fp32: loss 1e-6, grads 1e-5, measured
~7e-7; fp16 autocast: 1e-5 / 1e-4 on the CPU, 5e-4 / 2e-3 on CUDA where fp16 rounding flips of
single elements are expected).
"""
import contextlib

import pytest
import torch
import torch.utils.checkpoint as cp
import triton

from solution.kernels import _launches
from solution.kernels import rope as rope_mod
from solution.kernels.rope import rope, rope_supported
from tests.conftest import rel_err, tiny_padded_batch

modeling_qwen2 = pytest.importorskip("transformers.models.qwen2.modeling_qwen2")
STOCK_ROPE = modeling_qwen2.apply_rotary_pos_emb

F16, F32 = torch.float16, torch.float32


def tol(dtype) -> float:
    """For a result stored in `dtype` (see the module docstring)."""
    return 2e-3 if dtype == F16 else 1e-6


def projection_layout(batch, heads, seq, dim, dtype, device):
    """q/k exactly as Qwen2Attention makes them: proj(x).view(B, L, H, D).transpose(1, 2)."""
    flat = torch.randn(batch, seq, heads * dim, device=device).to(dtype)
    return flat.view(batch, seq, heads, dim).transpose(1, 2)


def qwen2_cos_sin(batch, seq, dim, dtype, device, cos_batch=None):
    """cos/sin as Qwen2RotaryEmbedding makes them (halves equal), for positions 0..seq-1."""
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    pos = torch.arange(seq, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    n = batch if cos_batch is None else cos_batch
    cos = emb.cos()[None].expand(n, -1, -1).contiguous().to(device=device, dtype=dtype)
    sin = emb.sin()[None].expand(n, -1, -1).contiguous().to(device=device, dtype=dtype)
    return cos, sin


def ref_fp64(x, cos, sin):
    """x * cos + rotate_half(x) * sin in fp64, cos/sin [B, L, D] broadcast over heads."""
    x64, c64, s64 = x.detach().double(), cos.detach().double()[:, None], sin.detach().double()[:, None]
    half = x.shape[-1] // 2
    rot = torch.cat((-x64[..., half:], x64[..., :half]), dim=-1)
    return x64 * c64 + rot * s64


def fwd_bwd(fn, q, k, cos, sin, gq, gk):
    q = q.detach().requires_grad_(True)
    k = k.detach().requires_grad_(True)
    qo, ko = fn(q, k, cos, sin)
    dq, dk = torch.autograd.grad((qo, ko), (q, k), (gq, gk))
    return qo, ko, dq, dk


def check(q, k, cos, sin):
    """Our kernel vs stock vs fp64 (forward and both grads)."""
    out_dtype = torch.promote_types(q.dtype, cos.dtype)
    gq = torch.randn(q.shape, device=q.device).to(out_dtype)
    gk = torch.randn(k.shape, device=k.device).to(out_dtype)
    ours = fwd_bwd(rope, q, k, cos, sin, gq, gk)
    stock = fwd_bwd(STOCK_ROPE, q, k, cos, sin, gq, gk)
    t = tol(out_dtype)
    for a, b, x in zip(ours[:2], stock[:2], (q, k)):
        assert a.dtype == b.dtype == out_dtype and a.shape == b.shape == x.shape
        assert rel_err(a, ref_fp64(x, cos, sin)) < t
        assert torch.equal(a, b)  # bit for bit like stock
    # grads vs fp64 autograd of the reference and vs stock
    q64 = q.detach().double().requires_grad_(True)
    k64 = k.detach().double().requires_grad_(True)
    dq64, dk64 = torch.autograd.grad((ref_fp64_graph(q64, cos, sin), ref_fp64_graph(k64, cos, sin)),
                                     (q64, k64), (gq.double(), gk.double()))
    for a, b, r, x in zip(ours[2:], stock[2:], (dq64, dk64), (q, k)):
        assert a.dtype == b.dtype == x.dtype and a.shape == x.shape
        assert rel_err(a, r) < tol(x.dtype)
        assert torch.equal(a, b)
    return ours


def ref_fp64_graph(x64, cos, sin):
    c64, s64 = cos.double()[:, None], sin.double()[:, None]
    half = x64.shape[-1] // 2
    return x64 * c64 + torch.cat((-x64[..., half:], x64[..., :half]), dim=-1) * s64


@pytest.mark.parametrize("qk_dtype,cs_dtype", [(F32, F32), (F16, F16), (F16, F32), (F32, F16)])
def test_qwen2_layout_matches_stock(device, qk_dtype, cs_dtype):
    """The workload's head counts and head_dim (12 q heads, 2 kv heads, 128) at a small length."""
    torch.manual_seed(0)
    B, L = 2, 5
    q = projection_layout(B, 12, L, 128, qk_dtype, device)
    k = projection_layout(B, 2, L, 128, qk_dtype, device)
    cos, sin = qwen2_cos_sin(B, L, 128, cs_dtype, device)
    assert not q.is_contiguous() and not k.is_contiguous()
    ours = check(q, k, cos, sin)
    # Same memory layout as the input (and as stock's output): [B, L, H, D] physically.
    assert ours[0].stride() == q.stride() and ours[1].stride() == k.stride()
    assert ours[2].stride() == q.stride() and ours[3].stride() == k.stride()


@pytest.mark.parametrize("B,Hq,Hk,L,D,cos_batch", [
    (1, 4, 2, 37, 16, 1),    # cos/sin batch 1 broadcast (position_ids of shape [1, L])
    (3, 3, 1, 1, 6, None),   # half = 3: not a power of two; one token; MQA
    (2, 5, 5, 7, 64, None),  # no GQA
    (1, 40, 8, 3, 256, 1),   # more heads than one tile holds (MAX_TILE 4096 / 128 = 32): 2 head tiles
])
def test_odd_sizes_random_cos_sin(device, B, Hq, Hk, L, D, cos_batch):
    """Random cos/sin (halves differ) check the general formula, not just Qwen2's special case."""
    torch.manual_seed(B * 1000 + L)
    q = projection_layout(B, Hq, L, D, F32, device)
    k = torch.randn(B, Hk, L, D, device=device)  # contiguous [B, H, L, D]
    n = B if cos_batch is None else cos_batch
    cos, sin = torch.randn(n, L, D, device=device), torch.randn(n, L, D, device=device)
    check(q, k, cos, sin)


@pytest.fixture(params=["one_token", "small_tiles"])
def tiling(request, monkeypatch):
    """Force a token tiling on whatever runs the test: 'one_token' is the GPU's launch config (one
    token per program), 'small_tiles' packs a few tokens per program (tiles of 512 elements) so
    tiles span two sequences of the batch and the last one is partial. (The interpreter's own
    default, one big tile, is what every other test runs on the CPU.)"""
    elems = {"one_token": 0, "small_tiles": 512}[request.param]
    monkeypatch.setattr(rope_mod, "GPU_TILE_ELEMS", elems)
    monkeypatch.setattr(rope_mod, "INTERP_TILE_ELEMS", elems)
    return request.param


@pytest.mark.parametrize("B,Hq,Hk,L,D,cos_batch,qk_dtype", [
    (3, 4, 2, 7, 16, None, F32),  # small_tiles: 16 tokens per program, 21 tokens -> 2 programs
    (2, 3, 1, 5, 6, 1, F16),      # half = 3, MQA, broadcast cos, fp16 (mixed with fp32 cos)
    (1, 40, 8, 3, 256, 1, F32),   # 2 head tiles per token
])
def test_token_tilings(device, tiling, B, Hq, Hk, L, D, cos_batch, qk_dtype):
    torch.manual_seed(B * 100 + L)
    q = projection_layout(B, Hq, L, D, qk_dtype, device)
    k = projection_layout(B, Hk, L, D, qk_dtype, device)
    n = B if cos_batch is None else cos_batch
    cos, sin = torch.randn(n, L, D, device=device), torch.randn(n, L, D, device=device)
    check(q, k, cos, sin)


def test_launch_configs(monkeypatch):
    """GPU: one token per program for the workload (the config sm75_specs lists). Interpreter:
    the tiny CI model's 4 x 512 tokens (4 q / 2 kv heads of 16) in one program."""
    monkeypatch.setattr(rope_mod, "interpreter_enabled", lambda: False)
    cfg = rope_mod._launch_config(2048, 12, 2, 128)
    assert cfg["BLOCK_T"] == 1 and cfg["Q_TILES"] == cfg["K_TILES"] == 1
    monkeypatch.setattr(rope_mod, "interpreter_enabled", lambda: True)
    cfg = rope_mod._launch_config(2048, 4, 2, 16)
    assert triton.cdiv(2048, cfg["BLOCK_T"]) == 1
    assert rope_mod._launch_config(5, 12, 2, 128)["BLOCK_T"] == 8  # never more than the input has (pow2)


def test_non_unit_last_stride_and_strided_cos(device):
    torch.manual_seed(1)
    B, L, D = 2, 6, 32
    q = torch.randn(B, 3, D, L, device=device).transpose(2, 3)  # last dim stride L: copied first
    k = torch.randn(B, 2, L, 2 * D, device=device)[..., ::2]     # last dim stride 2
    cos = torch.randn(B, L, 2 * D, device=device)[..., :D]       # row stride 2D, unit last stride
    sin = torch.randn(B, L, 2 * D, device=device)[..., D:]
    assert rope_supported(q, k, cos, sin)
    check(q, k, cos, sin)


def test_only_q_requires_grad_and_one_output_used(device):
    torch.manual_seed(2)
    q = projection_layout(2, 4, 5, 16, F32, device).requires_grad_(True)
    k = projection_layout(2, 2, 5, 16, F32, device)  # frozen
    cos, sin = qwen2_cos_sin(2, 5, 16, F32, device)
    qo, ko = rope(q, k, cos, sin)
    assert not ko.requires_grad  # like stock: k does not require grad, so neither does its output
    dq = torch.autograd.grad(qo.sum(), q)[0]  # ko unused: its grad is None inside backward
    qs, _ = STOCK_ROPE(q, k, cos, sin)
    dqs = torch.autograd.grad(qs.sum(), q)[0]
    assert torch.equal(dq, dqs)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_under_checkpoint(device, use_reentrant):
    torch.manual_seed(3)
    B, L = 2, 5
    base_q = torch.randn(B, L, 4 * 16, device=device, requires_grad=True)
    base_k = torch.randn(B, L, 2 * 16, device=device, requires_grad=True)
    cos, sin = qwen2_cos_sin(B, L, 16, F32, device)

    def block(fn, bq, bk):
        q = (bq * 2).view(B, L, 4, 16).transpose(1, 2)
        k = (bk * 2).view(B, L, 2, 16).transpose(1, 2)
        qo, ko = fn(q, k, cos, sin)
        return (qo * ko.repeat_interleave(2, dim=1)).sum(-1)

    out = cp.checkpoint(lambda a, b: block(rope, a, b), base_q, base_k, use_reentrant=use_reentrant)
    out.backward(torch.ones_like(out))  # reentrant checkpoint does not support autograd.grad()
    grads = base_q.grad.clone(), base_k.grad.clone()
    base_q.grad = base_k.grad = None
    out_s = block(STOCK_ROPE, base_q, base_k)
    out_s.backward(torch.ones_like(out_s))
    assert torch.equal(out, out_s)
    assert torch.equal(grads[0], base_q.grad) and torch.equal(grads[1], base_k.grad)


# ------------------------------------------------------------------------------------------------
# The patch
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def patched(monkeypatch):
    """solution.apply() with only this op's patch, reverted afterwards."""
    import solution
    import solution._apply as apply_mod

    solution.revert()
    monkeypatch.setattr(apply_mod, "PATCHES", ["solution.patches.qwen2_rope"])
    assert "qwen2_rope" in solution.apply(verbose=False)
    yield
    solution.revert()


def test_patch_check_accepts_installed_transformers():
    from solution.patches import qwen2_rope

    assert qwen2_rope.check() is None


def test_apply_installs_and_revert_restores(monkeypatch):
    import solution
    import solution._apply as apply_mod

    original = modeling_qwen2.apply_rotary_pos_emb
    solution.revert()
    monkeypatch.setattr(apply_mod, "PATCHES", ["solution.patches.qwen2_rope"])
    try:
        assert "qwen2_rope" in solution.apply(verbose=False)
        assert modeling_qwen2.apply_rotary_pos_emb is not original
        assert modeling_qwen2.apply_rotary_pos_emb._solution_stock is original
    finally:
        solution.revert()
    assert modeling_qwen2.apply_rotary_pos_emb is original


def test_patched_function_uses_kernel(device, patched):
    torch.manual_seed(4)
    q = projection_layout(2, 4, 5, 16, F32, device)
    k = projection_layout(2, 2, 5, 16, F32, device)
    cos, sin = qwen2_cos_sin(2, 5, 16, F32, device)
    for call in (lambda: modeling_qwen2.apply_rotary_pos_emb(q, k, cos, sin),
                 lambda: modeling_qwen2.apply_rotary_pos_emb(q, k, cos, sin, 1),
                 lambda: modeling_qwen2.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)):
        _launches.reset()
        qo, ko = call()
        assert _launches.LAUNCHES["_rope_qk_kernel"] == 1
        qs, ks = STOCK_ROPE(q, k, cos, sin)
        assert torch.equal(qo, qs) and torch.equal(ko, ks)


def test_patched_function_falls_back(device, patched):
    torch.manual_seed(5)
    B, L, D = 2, 5, 16
    cases = []
    # unsqueeze_dim=2: q/k as [B, L, H, D]
    q = torch.randn(B, L, 4, D, device=device)
    k = torch.randn(B, L, 2, D, device=device)
    cos, sin = qwen2_cos_sin(B, L, D, F32, device)
    cases.append(((q, k, cos, sin), {"unsqueeze_dim": 2}))
    # bf16 and fp64
    for dt in (torch.bfloat16, torch.float64):
        qq = projection_layout(B, 4, L, D, dt, device)
        kk = projection_layout(B, 2, L, D, dt, device)
        c, s = qwen2_cos_sin(B, L, D, dt, device)
        cases.append(((qq, kk, c, s), {}))
    # cos/sin requiring grad (stock computes their grads; the kernel does not)
    qq = projection_layout(B, 4, L, D, F32, device)
    kk = projection_layout(B, 2, L, D, F32, device)
    c, s = qwen2_cos_sin(B, L, D, F32, device)
    cases.append(((qq, kk, c.requires_grad_(), s.requires_grad_()), {}))
    # odd head_dim
    qq, kk = torch.randn(B, 4, L, 7, device=device), torch.randn(B, 2, L, 7, device=device)
    c, s = torch.randn(B, L, 7, device=device), torch.randn(B, L, 7, device=device)
    cases.append(((qq, kk, c, s), {}))
    for args, kwargs in cases:
        _launches.reset()
        out = modeling_qwen2.apply_rotary_pos_emb(*args, **kwargs)
        assert sum(_launches.LAUNCHES.values()) == 0, kwargs
        ref = STOCK_ROPE(*args, **kwargs)
        assert all(torch.equal(a, b) for a, b in zip(out, ref))


# ------------------------------------------------------------------------------------------------
# A tiny Qwen2 model: loss and every gradient, stock vs solution.apply() (RMSNorm + RoPE)
# ------------------------------------------------------------------------------------------------
def _tiny_model(device):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(6)
    cfg = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
                      attn_implementation="sdpa")
    model = Qwen2ForCausalLM(cfg).float().to(device).train()
    with torch.no_grad():  # non-trivial norm weights so the weight path matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return model


def _loss_and_grads(model, input_ids, labels, attention_mask, autocast: bool):
    device = input_ids.device.type
    model.zero_grad(set_to_none=True)
    # On CUDA, SDPA's default backends (memory-efficient / flash) may use a non-deterministic
    # backward; the math backend is deterministic, so run-to-run bit equality is meaningful. Its
    # backward (and checkpointing's recompute) runs inside the same context.
    attention = contextlib.nullcontext()
    if device == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        attention = sdpa_kernel([SDPBackend.MATH])
    with attention:
        with torch.autocast(device, dtype=torch.float16, enabled=autocast):
            out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        out.loss.backward()
    return out.loss.detach().clone(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                       if p.grad is not None}


# Tolerances of the RMSNorm + RoPE run against stock (relative; loss, every gradient). The fp32
# differences come only from RMSNorm's summation order (~1e-7 per element).
#  * no autocast: 1e-6 / 1e-5: the ~1e-7 differences pass linearly through two layers (measured on
#    the CPU: loss identical, largest gradient error 6.6e-7).
#  * fp16 autocast on the CPU: 1e-5 / 1e-4 (measured: loss identical, gradients 1.2e-7).
#  * fp16 autocast on CUDA: every Linear casts RMSNorm's fp32 output to fp16; where an fp32
#    difference of ~1e-7 straddles an fp16 rounding boundary, that element differs by one fp16 step
#    (2^-11 = 4.9e-4 relative), and cuBLAS' fp16 GEMMs carry it on. With only 18 tokens, a
#    gradient summed over tokens (biases, norm weights) can then differ by about one fp16 rounding:
#    gradients 2e-3 (four fp16 roundings, the fp16 tolerance used throughout). The loss is a mean
#    of log-softmax terms whose fp16 logits move by at most about one fp16 step each: 5e-4.
def _combined_tolerances(device: str, autocast: bool) -> tuple[float, float]:
    if not autocast:
        return 1e-6, 1e-5
    return (5e-4, 2e-3) if device == "cuda" else (1e-5, 1e-4)


@pytest.mark.parametrize("checkpointing,autocast", [(False, False), (True, False), (True, True)])
def test_tiny_qwen2_model_matches_stock(device, monkeypatch, checkpointing, autocast):
    """Loss and all grads (incl. the RMSNorm weights) with and without apply(); with gradient
    checkpointing (as in the workload) and with fp16 autocast (q/k fp16, cos/sin fp32 here, i.e.
    the mixed-dtype RoPE path). Model and inputs live on `device` (the patches route CPU tensors
    to stock on a CUDA machine).
    RoPE alone must leave loss and every grad bit-identical; RMSNorm + RoPE within tolerance."""
    import solution
    import solution._apply as apply_mod

    model = _tiny_model(device)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    input_ids, attention_mask, labels = tiny_padded_batch(7, device)

    solution.revert()
    loss_s, grads_s = _loss_and_grads(model, input_ids, labels, attention_mask, autocast)
    results = {}
    for patches in (("qwen2_rope",), ("qwen2_rmsnorm", "qwen2_rope")):
        monkeypatch.setattr(apply_mod, "PATCHES", [f"solution.patches.{p}" for p in patches])
        try:
            # on CUDA apply() also sets the allocator's expandable segments (not a patch of the list)
            assert set(solution.apply(verbose=False)) - {"cuda_allocator"} == set(patches)
            _launches.reset()
            loss_o, grads_o = _loss_and_grads(model, input_ids, labels, attention_mask, autocast)
            results[patches] = loss_o, grads_o, dict(_launches.LAUNCHES)
        finally:
            solution.revert()

    # RoPE alone: bit for bit.
    loss_o, grads_o, launches = results[("qwen2_rope",)]
    assert launches == {"_rope_qk_kernel": 6 if checkpointing else 4}  # fwd 2 (+ recompute 2) + bwd 2
    assert torch.equal(loss_o, loss_s)
    assert grads_o.keys() == grads_s.keys() and len(grads_s) > 0
    assert all(torch.equal(grads_o[n], grads_s[n]) for n in grads_s)

    # RMSNorm + RoPE: 5 norms per forward (2 per layer + final), the 4 in layers recomputed under
    # checkpointing; weight grads (dw) for all 5 since the tiny model trains every parameter.
    loss_o, grads_o, launches = results[("qwen2_rmsnorm", "qwen2_rope")]
    assert launches["_rmsnorm_fwd_kernel"] == (9 if checkpointing else 5)
    assert launches["_rmsnorm_bwd_dx_kernel"] == 5 and launches["_rmsnorm_bwd_dw_kernel"] == 5
    t_loss, t_grad = _combined_tolerances(device, autocast)
    assert abs(loss_o.item() - loss_s.item()) <= t_loss * abs(loss_s.item())
    assert grads_o.keys() == grads_s.keys()
    for name in grads_s:
        assert rel_err(grads_o[name], grads_s[name]) < t_grad, name


# ------------------------------------------------------------------------------------------------
# GPU only: the workload's real shapes, and the downstream SDPA call accepting our outputs
# ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("qk_dtype,cs_dtype", [(F32, F32), (F16, F16), (F16, F32)])
@pytest.mark.parametrize("L", [512, 377])
def test_gpu_workload_shape(qk_dtype, cs_dtype, L):
    torch.manual_seed(8)
    q = projection_layout(4, 12, L, 128, qk_dtype, "cuda")
    k = projection_layout(4, 2, L, 128, qk_dtype, "cuda")
    cos, sin = qwen2_cos_sin(4, L, 128, cs_dtype, "cuda", cos_batch=1)
    check(q, k, cos, sin)


@pytest.mark.gpu
def test_gpu_sdpa_accepts_outputs_under_autocast():
    torch.manual_seed(9)
    B, L = 4, 256
    q = projection_layout(B, 12, L, 128, F32, "cuda").requires_grad_(True)
    k = projection_layout(B, 2, L, 128, F32, "cuda").requires_grad_(True)
    v = projection_layout(B, 2, L, 128, F32, "cuda")
    cos, sin = qwen2_cos_sin(B, L, 128, F32, "cuda", cos_batch=1)
    outs = []
    for fn in (rope, STOCK_ROPE):
        with torch.autocast("cuda", dtype=torch.float16):
            qo, ko = fn(q, k, cos, sin)
            att = torch.nn.functional.scaled_dot_product_attention(qo, ko, v, is_causal=True, enable_gqa=True)
        dq, dk = torch.autograd.grad(att.float().sum(), (q, k))
        outs.append((att, dq, dk))
    for a, b in zip(*outs):
        assert rel_err(a, b) < 2e-3  # SDPA runs in fp16 under autocast
