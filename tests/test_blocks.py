"""The element-wise kernels with whole blocks unmasked and the last one masked
(solution/kernels/_blocks.py: fp32_add_kernel, qkv_grad_sum_kernel and the casts of
nf4_dequant_cast_kernel): both branches, bit for bit against torch's operations (the fp32 formula
each kernel reproduces), on sizes that are and are not a multiple of the block; and the unmasked
branch compiles to 128-bit accesses (sm_90 PTX of the recorded specializations, no GPU needed).

The training launches use blocks of 2048 elements on the GPU and 65536 in the interpreter, so the
other kernel tests mostly run one of the two branches; here the blocks are small (64)."""
from __future__ import annotations

import re

import pytest
import torch

from solution.kernels import fp32_add, nf4_dequant, qkv_grad
from solution.kernels._launches import cdiv

BLOCK = 64
SIZES = [64 * 3, 64 * 3 + 17, 5]  # whole blocks only; whole blocks and a tail; a tail only
# every training launch of the kernels that multiply passes enable_fp_fusion=False (the roundings are stock's:
# no fused multiply-add); launched without it, the GPU compile may fuse a product and a sum such as
# `a + (keep * g) * scale` into an FMA and the results move in the last bit (seen on the H200 with the
# former LoRA grad-sum kernel, whose formula qkv_grad_sum_kernel now holds)
NO_FMA = {"enable_fp_fusion": False}


def _grid(n):
    return (cdiv(n, BLOCK),)


@pytest.mark.parametrize("n", SIZES)
def test_fp32_add_both_branches(device, n):
    a = torch.randn(n, device=device).to(torch.float16)
    b = torch.randn(n, device=device)
    out = torch.full((n,), float("nan"), device=device)
    fp32_add.fp32_add_kernel[_grid(n)](a, b, out, n, BLOCK=BLOCK)  # one add: nothing to fuse
    assert torch.equal(out, a.float() + b)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("drop", [0, 1, 2])
def test_qkv_grad_sum_both_branches(device, n, drop):
    """qkv_grad_sum_kernel (the q / k / v input-gradient sum) against the fp32 formula in autograd's
    order, bit for bit: per LoRA projection fp32(a) + dropout's backward of fp32(b) (DROP 0: none,
    1: bool mask, (keep * g) * scale, 2: noise, g * noise), then ((v + k) + q)."""
    scale = 1 / 0.7
    aq, bq, ak, av, bv = (torch.randn(n, device=device).to(torch.float16) for _ in range(5))
    keep = [torch.rand(n, device=device) > 0.3 for _ in range(2)]
    masks = {0: (aq, av), 1: tuple(keep), 2: tuple(k.float() / 0.7 for k in keep)}[drop]

    def projection(a, b, m):
        g = b.float()
        if drop == 1:
            g = (m.float() * g) * torch.tensor(scale, dtype=torch.float32, device=device)
        if drop == 2:
            g = g * m
        return a.float() + g

    out = torch.full((n,), float("nan"), device=device)
    qkv_grad.qkv_grad_sum_kernel[_grid(n)](aq, bq, masks[0], ak, av, bv, masks[1], out, n, scale,
                                           DROP=drop, BLOCK=BLOCK, **NO_FMA)
    ref = (projection(av, bv, masks[1]) + ak.float()) + projection(aq, bq, masks[0])
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("cast_b", [0, 1, 3])
def test_dequant_launch_casts_both_branches(device, n, cast_b):
    """nf4_dequant_cast_kernel with no dequantization programs (n_deq_programs = 0): the casts of
    _cast_block alone, each CAST_B mode."""
    a = torch.randn(n, device=device) * 3
    a16 = torch.full((n,), float("nan"), device=device).half()
    b = (torch.rand(n, device=device) > 0.4) if cast_b == 3 else torch.randn(n, device=device)
    b16 = torch.full((n,), float("nan"), device=device).half()
    dummy_u8 = torch.zeros(64, dtype=torch.uint8, device=device)
    dummy_f = torch.zeros(256, dtype=torch.float32, device=device)
    nf4_dequant.nf4_dequant_cast_kernel[_grid(n)](
        dummy_u8, dummy_u8, dummy_f, dummy_f, dummy_f, dummy_f, b16, 0, 0, 0,
        0, a, a16, b, b16, n, 1.5,
        BLOCKSIZE=64, NESTED=True, NESTED_BS=256, NB=1, ROUND_BF16=False,
        CAST_A=True, CAST_B=cast_b, CAST_BLOCK=BLOCK, **NO_FMA)
    assert torch.equal(a16, a.half())
    if cast_b == 1:
        assert torch.equal(b16, b.half())
    if cast_b == 3:
        assert torch.equal(b16, ((a * b.float()) * 1.5).half())


def _vector_ptx_kernels() -> set[str]:
    """The kernels of the recorded specializations whose sm_90 PTX holds 128-bit global loads and
    stores (compiled as the precompile compiles them; needs a process without the interpreter)."""
    import json

    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile, make_backend
    from triton.runtime.jit import convert_to_tuple_if_list

    from solution import precompile

    target = GPUTarget("cuda", 90, 32)
    found, missing = set(), set()
    for e in precompile.load_manifest():
        name = e["kernel"].rsplit(".", 1)[1]
        if name not in VECTOR_KERNELS:
            continue
        obj = json.loads(precompile.retarget(e["specialization_data"], {"backend": "cuda", "arch": 90, "warp_size": 32}))
        consts = {tuple(k): (tl.dtype(v) if tl.dtype.is_dtype(v) else tl.constexpr(v["constexpr"])
                             if isinstance(v, dict) and "constexpr" in v else v)
                  for k, v in zip(obj["constant_keys"], obj["constant_vals"])}
        attrs = dict(zip(map(tuple, obj["attrs_keys"]), obj["attrs_vals"]))
        sig = {k: convert_to_tuple_if_list(v) for k, v in obj["signature"].items()}
        opts = make_backend(target).parse_options({k: tuple(v) if isinstance(v, list) else v
                                                   for k, v in obj["options"].items()})
        ptx = triton_compile(ASTSource(precompile.resolve_kernel(e["kernel"]), sig, consts, attrs),
                             target=target, options=opts.__dict__).asm["ptx"]
        stores = len(re.findall(r"st\.global\.v4", ptx))
        ok = stores >= VECTOR_KERNELS[name] and re.search(r"ld\.global\.v4", ptx)
        (found if ok else missing).add(name)
    return found - missing


# kernel -> the fewest 128-bit stores its PTX must hold: the dequantization's own 4 in the
# dequant + cast launch, and at least 2 more for one fp16 cast output (with every access masked: those 4 only)
VECTOR_KERNELS = {"fp32_add_kernel": 1, "qkv_grad_sum_kernel": 1, "nf4_dequant_cast_kernel": 6}


def test_unmasked_blocks_compile_to_vector_accesses():
    """Every recorded specialization of these kernels, compiled for sm_90 like the precompile
    compiles it, holds 128-bit global loads and stores (with every access masked, the casts had
    none, with Triton 3.6). Runs in a child process without the interpreter."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import tests.test_blocks as t; print(sorted(t._vector_ptx_kernels()))"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == str(sorted(VECTOR_KERNELS)), proc.stdout
