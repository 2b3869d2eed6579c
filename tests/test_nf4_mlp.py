"""The fused NF4 MLP block (solution/kernels/nf4_mlp.py) and its wiring in the Qwen2MLP patch.

Stock reference: transformers' Qwen2MLP whose three projections are real bitsandbytes NF4
Linear4bit layers (double quant, fp16 compute, no bias), run on fp32 inputs as in the workload
(bnb hands back fp32 copies of its fp16 GEMM outputs, SwiGLU runs in fp32). Ours keeps the gate /
up outputs in fp16 and must give the same numbers: on the CPU the GEMMs are the same torch calls
on the same fp16 operands, and the only possible differences come from the interpreter's exp
(numpy) against torch's, one fp32 ulp before an fp16 rounding: so the output and the input
gradient are compared with fp16-level tolerances there and bit for bit on the GPU.
"""
import pytest
import torch

import solution
import solution._apply as apply_mod
from solution.kernels import _launches, nf4_mlp, swiglu
from solution.patches._bnb import linear_plan
from solution.settings import Settings
from tests.conftest import HAS_CUDA
from tests.test_nf4_linear import bnb_dequant_rows, make_linear4bit

H, I = 64, 192  # hidden / intermediate sizes (multiples of bnb's blocksize 64)


def nf4_mlp_module(device, bias=False):
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

    mlp = Qwen2MLP(Qwen2Config(hidden_size=H, intermediate_size=I, hidden_act="silu"))
    mlp.gate_proj = make_linear4bit(H, I, bias=bias, device=device, seed=1)
    mlp.up_proj = make_linear4bit(H, I, bias=bias, device=device, seed=2)
    mlp.down_proj = make_linear4bit(I, H, bias=bias, device=device, seed=3)
    return mlp


def inputs(device, seed=5):
    rows = max(2 * 7, bnb_dequant_rows(device))  # on CUDA: past bnb's fused small-M GEMM
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, -(-rows // 2), H, generator=g).to(device)
    dy = torch.randn(2, -(-rows // 2), H, generator=g).to(device)
    return x, dy


def run(mlp, x, dy):
    x = x.detach().clone().requires_grad_()
    y = mlp(x)
    (dx,) = torch.autograd.grad(y, x, dy.to(y.dtype))
    return y.detach(), dx


@pytest.fixture
def mlp_patches(monkeypatch):
    monkeypatch.setattr(apply_mod, "PATCHES", ["solution.patches.bnb_linear4bit", "solution.patches.qwen2_mlp"])
    solution.revert()
    yield solution
    solution.revert()


def _tol():
    return (0.0, 0.0) if HAS_CUDA else (2e-3, 1e-5)


@pytest.mark.parametrize("policy", ["speed", "balanced", "memory"])
def test_fused_mlp_matches_stock_bnb(policy, mlp_patches, device, monkeypatch):
    """The block under each policy: stock's numbers (bits on the GPU)."""
    mlp = nf4_mlp_module(device)
    x, dy = inputs(device)
    y_s, dx_s = run(mlp, x, dy)  # stock: bnb + transformers
    assert y_s.dtype == torch.float32
    monkeypatch.setenv("SOLUTION_MEMORY_POLICY", policy)
    installed = mlp_patches.apply(verbose=False)
    assert f"memory policy {policy!r}" in installed["qwen2_mlp"]
    before = _launches.LAUNCHES["swiglu_bwd"]
    y, dx = run(mlp, x, dy)
    assert _launches.LAUNCHES["swiglu_bwd"] == before + 1
    assert y.dtype == torch.float16  # kept in fp16: the residual add promotes it
    assert dx.dtype == torch.float32 and dx.shape == x.shape
    rtol, atol = _tol()
    torch.testing.assert_close(y.float(), y_s, rtol=rtol, atol=atol)
    torch.testing.assert_close(dx, dx_s, rtol=rtol, atol=atol)


def _saved_by(plans, x, dy, **kw):
    """((y, dx), [(shape, dtype) of each tensor the block saved for its backward])."""
    sizes = []

    def pack(t):
        sizes.append((tuple(t.shape), t.dtype))
        return t

    xr = x.detach().clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = nf4_mlp.nf4_mlp(xr, *plans, **kw)
    (dx,) = torch.autograd.grad(y, xr, dy.half())
    return (y, dx), sizes


def test_memory_policy_saves_input_only_and_gives_the_same_bits(device):
    mlp = nf4_mlp_module(device)
    x, dy = inputs(device)
    plans = [linear_plan(m) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
    results, saved = {}, {}
    for policy in ("speed", "balanced", "memory"):
        results[policy], saved[policy] = _saved_by(plans, x, dy, policy=policy)
    rows = x.numel() // H
    assert saved["speed"] == [((rows, I), torch.float16)] * 2                                # g16, u16
    assert saved["balanced"] == [((rows, H), torch.float16), ((rows, I), torch.float16)]    # x16, g16
    assert saved["memory"] == [((rows, H), torch.float16)]                                  # x16 only
    for policy in ("balanced", "memory"):
        assert torch.equal(results["speed"][0], results[policy][0])
        assert torch.equal(results["speed"][1], results[policy][1])


def test_second_backward_through_the_graph_raises(device):
    mlp = nf4_mlp_module(device)
    x, dy = inputs(device)
    plans = [linear_plan(m) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
    xr = x.detach().clone().requires_grad_()
    y = nf4_mlp.nf4_mlp(xr, *plans, policy="speed")
    torch.autograd.grad(y, xr, dy.half(), retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        torch.autograd.grad(y, xr, dy.half())


def test_fused_path_only_when_every_condition_holds(mlp_patches, device):
    from solution.patches.qwen2_mlp import fused_plans

    x, _ = inputs(device)
    mlp_patches.apply(verbose=False)
    mlp = nf4_mlp_module(device)
    xg = x.clone().requires_grad_()
    assert fused_plans(mlp, xg) is not None
    assert fused_plans(mlp, x) is None                          # no gradient wanted
    assert fused_plans(mlp, xg.half()) is None                  # not the workload's fp32 stream
    handle = mlp.up_proj.register_forward_hook(lambda *a: None)
    assert fused_plans(mlp, xg) is None                         # a hook would be skipped
    handle.remove()
    assert fused_plans(mlp, xg) is not None
    mlp.down_proj.forward = mlp.down_proj.forward  # an instance-level forward, as accelerate's hooks set
    assert fused_plans(mlp, xg) is None
    del mlp.down_proj.forward
    assert fused_plans(mlp, xg) is not None
    assert fused_plans(nf4_mlp_module(device, bias=True), xg) is None
    mlp_patches.revert()
    assert fused_plans(mlp, xg) is None                         # bnb patch not installed


def test_fp16_inputs_keep_the_per_layer_path(mlp_patches, device):
    mlp = nf4_mlp_module(device)
    x, dy = inputs(device)
    x = x.half()
    y_s, dx_s = run(mlp, x, dy)
    mlp_patches.apply(verbose=False)
    y, dx = run(mlp, x, dy)
    assert y.dtype == torch.float16
    rtol, atol = (0.0, 0.0) if HAS_CUDA else (2e-3, 1e-4)
    torch.testing.assert_close(y, y_s, rtol=rtol, atol=atol)
    torch.testing.assert_close(dx, dx_s, rtol=rtol, atol=atol)


def test_memory_policy_setting(monkeypatch):
    def memory_policy() -> str:
        return Settings.from_env().memory_policy

    monkeypatch.delenv("SOLUTION_MEMORY_POLICY", raising=False)
    assert memory_policy() == "speed"
    monkeypatch.setenv("SOLUTION_MEMORY_POLICY", " Memory ")
    assert memory_policy() == "memory"
    monkeypatch.setenv("SOLUTION_MEMORY_POLICY", "balanced")
    assert memory_policy() == "balanced"
    monkeypatch.setenv("SOLUTION_MEMORY_POLICY", "fastest")
    solution.revert()
    with pytest.raises(ValueError, match="SOLUTION_MEMORY_POLICY.*speed, balanced, memory"):
        solution.apply(verbose=False)
    assert solution.installed() == {}  # nothing was installed


@pytest.mark.parametrize("rows", [1, 37, 300])
def test_swiglu_fp32_stock_kernels_match_torch_fp32(rows, device):
    """swiglu FP32_STOCK on fp16 storage = torch's fp32 silu(g) * u rounded once to fp16, and the
    fp32 backward's dg / du rounded once."""
    gen = torch.Generator().manual_seed(rows)
    g16 = (torch.randn(rows, I, generator=gen) * 3).half().to(device)
    u16 = torch.randn(rows, I, generator=gen).half().to(device)
    dh16 = torch.randn(rows, I, generator=gen).half().to(device)
    g32, u32 = g16.float().requires_grad_(), u16.float().requires_grad_()
    h32 = torch.nn.functional.silu(g32) * u32
    dg32, du32 = torch.autograd.grad(h32, (g32, u32), dh16.float())
    h = swiglu.swiglu_fp16_of_fp32(g16, u16)
    dg, du = torch.empty_like(g16), torch.empty_like(u16)
    swiglu.swiglu_backward_fp16_of_fp32(dh16, g16, u16, dg, du)
    rtol, atol = (0.0, 0.0) if HAS_CUDA else (1e-3, 1e-6)
    torch.testing.assert_close(h, h32.half(), rtol=rtol, atol=atol)
    torch.testing.assert_close(du, du32.half(), rtol=rtol, atol=atol)
    # dg: the fma / expf paths may differ by one fp32 ulp from torch's (see swiglu's doc)
    torch.testing.assert_close(dg, dg32.half(), rtol=1e-3, atol=1e-6)
