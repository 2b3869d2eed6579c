"""The fused NF4 MLP block (solution/kernels/nf4_mlp.py): its launchers, as the decoder-layer node
calls them, in a test-only autograd Function (``nf4_mlp_autograd``) with the layers' plans.

Oracles:
* stock: transformers' Qwen2MLP whose three projections are real bitsandbytes NF4 Linear4bit
  layers (double quant, fp16 compute, no bias), run on fp32 inputs as in the workload (bnb hands
  back fp32 copies of its fp16 GEMM outputs, SwiGLU runs in fp32). Ours keeps the gate / up
  outputs in fp16 and does stock's roundings: on the GPU (same GEMM kernels, rows past bnb's
  fused small-M GEMM) the output and the input gradient are stock's bits (torch.equal). On the
  CPU the interpreter's exp (numpy) may differ from torch's by one fp32 ulp before an fp16
  rounding, so there ours must be no less accurate than stock against fp64 (below).
* fp64: down(silu(gate x) * up x) with the weights dequantized by bitsandbytes itself
  (dequantize_4bit), in float64, and its input gradient by autograd; compared at odd row counts
  in the "no worse than stock" form: ours_err <= K_STOCK * stock_err + FLOOR * ||ref||, both
  errors relative (norm) against fp64 on the same inputs.
"""

import pytest
import torch

import solution
from solution.kernels import _launches, nf4_mlp
from solution.patches._bnb import linear_plan
from solution.settings import Settings
from tests.conftest import HAS_CUDA, rel_err
from torch.autograd.function import once_differentiable


# The launchers (mlp_forward / mlp_saved / mlp_backward) in a test-only autograd Function, as the
# decoder-layer node calls them in its forward and backward.
class NF4MLPFunction(torch.autograd.Function):
    """x [..., H] fp32 -> y [..., H] fp16 = down(swiglu(gate(x), up(x))), the values stock computes
    (see the module doc); gradient for x only (the three weights are frozen)."""

    @staticmethod
    def forward(ctx, x, gate, up, down, policy):
        y, g16, u16, x16 = nf4_mlp.mlp_forward(x, gate, up, down)
        ctx.plans = (gate, up, down)
        ctx.policy = policy
        ctx.x_shape = x.shape
        ctx.consumed = False
        ctx.save_for_backward(*nf4_mlp.mlp_saved(policy, x16, g16, u16))
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        if ctx.consumed:
            raise RuntimeError("NF4 MLP: a second backward through the same graph is not supported "
                               "(the first one reused the saved activations' memory)")
        saved = ctx.saved_tensors
        ctx.consumed = True
        dx = nf4_mlp.mlp_backward(ctx.plans, ctx.policy, saved, dy.reshape(-1, dy.shape[-1]))
        return dx.view(ctx.x_shape), None, None, None, None


def nf4_mlp_autograd(x: torch.Tensor, gate, up, down, policy: str = "speed") -> torch.Tensor:
    """The launchers in autograd, as the decoder-layer node runs them by hand; returns fp16."""
    if policy not in ("speed", "balanced", "memory"):
        raise ValueError(f"nf4_mlp: unknown memory policy {policy!r}")
    if torch.is_grad_enabled() and x.requires_grad:
        return NF4MLPFunction.apply(x, gate, up, down, policy)
    return nf4_mlp.mlp_forward(x, gate, up, down)[0]


H, I = 64, 192  # hidden / intermediate sizes (multiples of bnb's blocksize 64)
# Ours and stock make the same fp16 roundings (x, g, u, h, y, and dh, dg, du in backward); they may
# differ only where one fp32 ulp (the interpreter's exp) flips an fp16 rounding, one fp16 ulp of a
# few elements, which moves the normwise error by a small fraction of itself: 1.25 x stock's error
# is a margin of a quarter for that. FLOOR: 2^-24 (one fp32 rounding, relative), for the case where
# stock's error is ~0.
K_STOCK, FLOOR = 1.25, 2.0 ** -24


def make_linear4bit(in_f, out_f, device, seed, bias=False):
    """A bnb Linear4bit like the workload's MLP layers: NF4, double quant, fp16 compute."""
    import bitsandbytes as bnb

    g = torch.Generator().manual_seed(seed)
    lin = bnb.nn.Linear4bit(in_f, out_f, bias=bias, compute_dtype=torch.float16,
                            compress_statistics=True, quant_type="nf4")
    w = (torch.randn(out_f, in_f, generator=g) * 0.05).to(torch.float16)
    lin.weight = bnb.nn.Params4bit(w, requires_grad=False, compress_statistics=True, quant_type="nf4")
    if bias:
        lin.bias = torch.nn.Parameter(torch.randn(out_f, generator=g) * 0.1, requires_grad=False)
    return lin.to(device).train()


def bnb_dequant_rows(device) -> int:
    """Fewest rows for which bitsandbytes' gemm_4bit surely runs dequant + F.linear (the GEMM ours
    runs): any on the CPU; on CUDA more than bnb's ``_gemm_4bit_custom_max_m`` (below it bnb may
    pick its fused small-M kernel, which rounds otherwise)."""
    if device != "cuda":
        return 1
    from bitsandbytes.backends.cuda import ops as cuda_ops

    return cuda_ops._gemm_4bit_custom_max_m + 1


def nf4_mlp_module(device, bias=False):
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

    mlp = Qwen2MLP(Qwen2Config(hidden_size=H, intermediate_size=I, hidden_act="silu"))
    mlp.gate_proj = make_linear4bit(H, I, device=device, seed=1, bias=bias)
    mlp.up_proj = make_linear4bit(H, I, device=device, seed=2, bias=bias)
    mlp.down_proj = make_linear4bit(I, H, device=device, seed=3, bias=bias)
    return mlp


def inputs(device, seed=5, rows=None):
    """(x, dy) [2, rows / 2, H] fp32 (rows rounded up to even); on CUDA past bnb's fused small-M GEMM."""
    rows = rows or max(2 * 7, bnb_dequant_rows(device))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, -(-rows // 2), H, generator=g).to(device)
    dy = torch.randn(2, -(-rows // 2), H, generator=g).to(device)
    return x, dy


def run(mlp, x, dy):
    x = x.detach().clone().requires_grad_()
    y = mlp(x)
    (dx,) = torch.autograd.grad(y, x, dy.to(y.dtype))
    return y.detach(), dx


def run_ours(mlp, x, dy, policy="speed"):
    plans = [linear_plan(m) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
    x = x.detach().clone().requires_grad_()
    y = nf4_mlp_autograd(x, *plans, policy=policy)
    (dx,) = torch.autograd.grad(y, x, dy.to(y.dtype))
    return y.detach(), dx


def fp64_reference(mlp, x, dy):
    """(y, dx) in float64: down(silu(gate x) * up x), the weights dequantized by bitsandbytes."""
    import bitsandbytes.functional as bnbF

    w = [bnbF.dequantize_4bit(m.weight.data, m.weight.quant_state).double().cpu()
         for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
    x64 = x.detach().double().cpu().requires_grad_()
    y = (torch.nn.functional.silu(x64 @ w[0].T) * (x64 @ w[1].T)) @ w[2].T
    (dx,) = torch.autograd.grad(y, x64, dy.double().cpu())
    return y.detach(), dx


def assert_no_worse_than_stock(ours, stock, ref, name):
    err_o, err_s = rel_err(ours, ref), rel_err(stock, ref)
    assert err_o <= K_STOCK * err_s + FLOOR, (name, err_o, err_s)


@pytest.mark.parametrize("policy", ["speed", "balanced", "memory"])
def test_fused_mlp_matches_stock_bnb(policy, device):
    """The block under each policy: stock's bits on the GPU; no less accurate than stock against
    fp64 on the CPU."""
    mlp = nf4_mlp_module(device)
    x, dy = inputs(device)
    y_s, dx_s = run(mlp, x, dy)  # stock: bnb + transformers
    assert y_s.dtype == torch.float32
    before = _launches.LAUNCHES["swiglu_bwd"]
    y, dx = run_ours(mlp, x, dy, policy)
    assert _launches.LAUNCHES["swiglu_bwd"] == before + 1
    assert y.dtype == torch.float16  # kept in fp16: the residual add promotes it
    assert dx.dtype == torch.float32 and dx.shape == x.shape
    if HAS_CUDA:
        assert torch.equal(y.float(), y_s) and torch.equal(dx, dx_s)
    y64, dx64 = fp64_reference(mlp, x, dy)
    assert_no_worse_than_stock(y, y_s, y64, "y")
    assert_no_worse_than_stock(dx, dx_s, dx64, "dx")


@pytest.mark.parametrize("rows", [1, 37])
def test_fp64_at_odd_rows(rows, device):
    """Odd row counts (one token; 37 on the CPU, bnb's fused-GEMM limit + an odd count on CUDA):
    against the fp64 formula, no worse than stock on the same inputs."""
    rows = rows if device != "cuda" else bnb_dequant_rows(device) + 2 * rows - 1
    mlp = nf4_mlp_module(device)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, H, generator=g).to(device)
    dy = torch.randn(rows, H, generator=g).to(device)
    y_s, dx_s = run(mlp, x, dy)
    y, dx = run_ours(mlp, x, dy)
    assert y.shape == (rows, H) and dx.shape == (rows, H)
    y64, dx64 = fp64_reference(mlp, x, dy)
    assert_no_worse_than_stock(y, y_s, y64, "y")
    assert_no_worse_than_stock(dx, dx_s, dx64, "dx")


def _saved_by(plans, x, dy, **kw):
    """((y, dx), [(shape, dtype) of each tensor the block saved for its backward])."""
    sizes = []

    def pack(t):
        sizes.append((tuple(t.shape), t.dtype))
        return t

    xr = x.detach().clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = nf4_mlp_autograd(xr, *plans, **kw)
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
    y = nf4_mlp_autograd(xr, *plans, policy="speed")
    torch.autograd.grad(y, xr, dy.half(), retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        torch.autograd.grad(y, xr, dy.half())


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
