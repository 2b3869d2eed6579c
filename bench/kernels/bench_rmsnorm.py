"""GPU benchmark: stock Qwen2RMSNorm vs solution's fused Triton RMSNorm (kernels/rmsnorm.py's two
launchers, as the decoder-layer node calls them for each layer's input norm) at the workload's shapes,
and the decoder layer's residual add + post-attention RMSNorm, stock vs fused (add_rmsnorm).

    python bench/kernels/bench_rmsnorm.py --out rmsnorm.json

Shapes: hidden 1536; tokens 4 x 512 = 2048 (a full batch) and 4 x 375 = 1500 (~ a real batch).
Dtypes: x fp32 / weight fp32 (the workload: fp32 residual stream, weight cast to fp32 by peft's
prepare_model_for_kbit_training) and x fp16 / weight fp32. The weight is frozen as in the workload
(no weight gradient). Stock runs under autograd; ours is ``_launch_forward`` (-> y, rstd), then
``_launch_backward_dx`` (no autograd): its "saved for backward" is the per-row rstd (x is the caller's).
Reports median times (triton.testing.do_bench) for forward and forward + backward, the memory the
forward keeps alive for backward, and the peak memory of fwd + bwd.
Rates (bench/kernels/_common.py, rates): bytes that must move = every input read once + every
output written once, forward: x, weight -> y; backward: dy, x, weight -> dx (frozen weight; the
saved per-row rstd is left out, it can be recomputed); forward + backward (timed together): the
sum; GB/s = bytes / median time and % of a same-size copy (a uint8 copy moving those bytes,
timed here once per byte count).

Residual add + RMSNorm: ``h = residual + x; y = norm(h)`` with residual fp32 and x fp16 (the
attention output under fp16 autocast), 2048 x 1536, weight fp32 frozen; forward + backward takes
upstream gradients for both h (the later ``residual + mlp_out``) and y (the MLP), as in the layer.
Three implementations, printed as two stock-vs-ours pairs: the stock ops vs ``add_rmsnorm``, and
torch's add followed by our RMSNorm launchers (unfused; h's two gradients summed by torch) vs ``add_rmsnorm``.
``add_rmsnorm`` is solution/kernels/add_rmsnorm.py's two launchers as the decoder-layer node calls
them (``_launch_forward``, then ``_launch_backward`` with both upstream gradients; no autograd):
its "saved for backward" is the per-row rstd, and its gradients are returned, not accumulated.
Bytes: forward residual, x, weight -> h, y; backward dh, dy, h, weight -> d residual, dx.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from bench.kernels._common import bench_args, fwd_and_fwd_bwd_rates, nbytes, print_stock_vs_ours  # noqa: E402
import triton  # noqa: E402

from solution.kernels import add_rmsnorm, rmsnorm  # noqa: E402

HIDDEN = 1536
EPS = 1e-6
CASES = [((4, 512), torch.float32, torch.float32), ((4, 375), torch.float32, torch.float32),
         ((4, 512), torch.float16, torch.float32)]


def _stock_module(w_dtype):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    m = Qwen2RMSNorm(HIDDEN, eps=EPS).to(device="cuda", dtype=w_dtype)
    with torch.no_grad():
        m.weight.copy_(1.0 + 0.1 * torch.randn(HIDDEN, device="cuda"))
    m.weight.requires_grad_(False)  # frozen, as in the workload
    return m


def _memory(fwd, bwd):
    """For a forward ``fwd() -> (*outputs, state)`` and its backward ``bwd(*outputs, state)``: (bytes
    the forward keeps alive for backward besides its outputs, peak bytes above baseline of fwd+bwd)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    res = fwd()
    kept = torch.cuda.memory_allocated() - base - nbytes(*res[:-1])
    grads = bwd(*res)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del res, grads
    return kept, peak


def _rows(impls, label: dict, grad_to_none, in_bytes, out_bytes) -> dict:
    """{name: row} for ``impls`` ((name, fwd, bwd) as ``_memory`` takes them): median fwd and fwd+bwd
    times, memory, and the rates of ``in_bytes(*outputs)`` / ``out_bytes(*outputs)``."""
    timed = {}
    for name, fwd, bwd in impls:
        with torch.no_grad():
            t_fwd = triton.testing.do_bench(fwd, warmup=10, rep=50, return_mode="median")

        def fwd_bwd(fwd=fwd, bwd=bwd):
            bwd(*fwd())

        t_fb = triton.testing.do_bench(fwd_bwd, warmup=10, rep=50, grad_to_none=grad_to_none, return_mode="median")
        kept, peak = _memory(fwd, bwd)
        for t in grad_to_none:
            t.grad = None
        with torch.no_grad():
            outs = fwd()[:-1]
        row = {"impl": name, **label, "fwd_ms": t_fwd, "fwd_bwd_ms": t_fb, "saved_for_bwd_MiB": kept / 2**20,
               "peak_fwd_bwd_MiB": peak / 2**20}
        timed[name] = fwd_and_fwd_bwd_rates(row, in_bytes(*outs), out_bytes(*outs))
        del outs
    return timed


def bench_case(shape, x_dtype, w_dtype):
    torch.manual_seed(0)
    m = _stock_module(w_dtype)
    w = m.weight
    stock_forward = type(m).forward  # the class's own forward (this script never calls apply())
    x = torch.randn(*shape, HIDDEN, device="cuda", dtype=x_dtype, requires_grad=True)
    g = torch.randn(*shape, HIDDEN, device="cuda", dtype=torch.promote_types(x_dtype, w_dtype))
    x2, g2 = x.detach().view(-1, HIDDEN), g.view(-1, HIDDEN)

    def stock_fwd():
        return stock_forward(m, x), None

    def stock_bwd(y, _):
        y.backward(g)

    def ours_fwd():  # (y, rstd)
        return rmsnorm._launch_forward(x2, w, EPS)

    def ours_bwd(y, rstd):
        return rmsnorm._launch_backward_dx(x2, w, g2, rstd)

    label = {"tokens": shape[0] * shape[1], "x_dtype": str(x_dtype).split(".")[-1],
             "w_dtype": str(w_dtype).split(".")[-1]}
    # fwd: x, w -> y; bwd: dy, x, w -> dx (x's shape and dtype)
    timed = _rows((("stock", stock_fwd, stock_bwd), ("ours", ours_fwd, ours_bwd)), label, [x],
                  lambda y: nbytes(x, w, y), lambda y: nbytes(g, x, w, x))
    # correctness guard: the benchmark must compare equal work
    y_o, rstd = ours_fwd()
    y_s = stock_forward(m, x)
    dx_s = torch.autograd.grad(y_s, x, g)[0]
    timed["ours"]["max_abs_diff_vs_stock"] = (y_o.float() - y_s.view_as(y_o).float()).abs().max().item()
    dx_o = ours_bwd(y_o, rstd)
    timed["ours"]["dx_max_abs_diff_vs_stock"] = (dx_o.float() - dx_s.view_as(dx_o).float()).abs().max().item()
    return [timed["stock"], timed["ours"]]


ADD_CASE = ((4, 512), torch.float32, torch.float16, torch.float32)  # shape, residual, x, weight


def bench_add_case(shape, r_dtype, x_dtype, w_dtype):
    """Residual add + RMSNorm, forward and forward + backward: rows for the two pairs. r_dtype fp32 and
    x_dtype fp16: the fused backward's gradients are in those dtypes (the node's)."""
    torch.manual_seed(0)
    m = _stock_module(w_dtype)
    stock_forward = type(m).forward

    def stock(r, x):
        h = r + x
        return h, stock_forward(m, h)

    r = (torch.randn(*shape, HIDDEN, device="cuda") * 4).to(r_dtype).requires_grad_(True)
    x = torch.randn(*shape, HIDDEN, device="cuda", dtype=x_dtype, requires_grad=True)
    h_dtype = torch.promote_types(r_dtype, x_dtype)
    gh = torch.randn(*shape, HIDDEN, device="cuda", dtype=h_dtype)
    gy = torch.randn(*shape, HIDDEN, device="cuda", dtype=torch.promote_types(h_dtype, w_dtype))
    r2, x2 = r.detach().view(-1, HIDDEN), x.detach().view(-1, HIDDEN)
    gh2, gy2 = gh.view(-1, HIDDEN), gy.view(-1, HIDDEN)

    def stock_fwd():
        return (*stock(r, x), None)

    def stock_bwd(h, y, _):
        torch.autograd.backward((h, y), (gh, gy))

    def unfused_fwd():  # torch's add, then our RMSNorm's forward launcher: (h, y, rstd)
        h = r2 + x2
        return (h, *rmsnorm._launch_forward(h, m.weight, EPS))

    def unfused_bwd(h, y, rstd):  # the norm's dx launcher; h's two gradients summed by torch, then cast
        dh = gh2 + rmsnorm._launch_backward_dx(h, m.weight, gy2, rstd)
        return dh.to(r_dtype), dh.to(x_dtype)

    def fused_fwd():  # (h, y, rstd)
        return add_rmsnorm._launch_forward(r2, x2, m.weight, EPS, tuple(x.shape))

    def fused_bwd(h, y, rstd):
        return add_rmsnorm._launch_backward(h.view(-1, HIDDEN), m.weight, gy2, gh2, rstd)

    impls = (("stock ops", stock_fwd, stock_bwd), ("add + our rmsnorm", unfused_fwd, unfused_bwd),
             ("add_rmsnorm", fused_fwd, fused_bwd))
    label = {"tokens": shape[0] * shape[1], "res_dtype": str(r_dtype).split(".")[-1],
             "x_dtype": str(x_dtype).split(".")[-1], "w_dtype": str(w_dtype).split(".")[-1]}
    # fwd: residual, x, w -> h, y; bwd: dh, dy, h, w -> d residual, dx (their shapes and dtypes)
    timed = _rows(impls, label, [r, x], lambda h, y: nbytes(r, x, m.weight, h, y),
                  lambda h, y: nbytes(gh, gy, h, m.weight, r, x))
    # correctness guard: the benchmark must compare equal work (h is exact, y within rounding)
    with torch.no_grad():
        (h_o, y_o, _), (h_s, y_s) = fused_fwd(), stock(r, x)
        timed["add_rmsnorm"]["h_bit_equal_to_stock"] = bool(torch.equal(h_o, h_s))
        timed["add_rmsnorm"]["max_abs_diff_vs_stock"] = (y_o.float() - y_s.float()).abs().max().item()
    return [timed["stock ops"], timed["add_rmsnorm"], timed["add + our rmsnorm"], dict(timed["add_rmsnorm"])]


def main() -> int:
    args = bench_args(__doc__)
    if args is None:
        return 1
    results = []
    for shape, x_dtype, w_dtype in CASES:
        results += bench_case(shape, x_dtype, w_dtype)
    print(f"GPU: {torch.cuda.get_device_name()}\n")
    print_stock_vs_ours(results, [("impl", "impl"), ("tokens", "tokens"), ("x", "x_dtype"), ("w", "w_dtype")])
    add_results = bench_add_case(*ADD_CASE)
    print("\nresidual add + RMSNorm fwd+bwd (h = residual + x, y = norm(h); grads of h and y)\n")
    print_stock_vs_ours(add_results, [("impl", "impl"), ("tokens", "tokens"), ("residual", "res_dtype"),
                                      ("x", "x_dtype"), ("w", "w_dtype")])
    with open(args.out, "w") as f:
        json.dump({"op": "rmsnorm", "gpu": torch.cuda.get_device_name(), "hidden": HIDDEN, "results": results,
                   "add_rmsnorm_results": add_results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
