"""The element-wise kernels with whole blocks unmasked and the last one masked
(solution/kernels/_blocks.py): both branches, against torch, on sizes that are and are not a
multiple of the block; and the unmasked branch compiles to 128-bit accesses (PTX, no GPU needed).

The training launches use blocks of 2048 elements on the GPU and 65536 in the interpreter, so the
other kernel tests mostly run one of the two branches; here the blocks are small (64)."""
from __future__ import annotations

import re

import pytest
import torch

from solution.kernels import fp32_add, lora_nf4, nf4_dequant
from solution.kernels._launches import cdiv

BLOCK = 64
SIZES = [64 * 3, 64 * 3 + 17, 5]  # whole blocks only; whole blocks and a tail; a tail only
# every training launch of the kernels that multiply passes enable_fp_fusion=False (the roundings are stock's:
# no fused multiply-add); launched without it, the GPU compile fuses `a + keep * g * scale` into an
# FMA and the results move in the last bit (seen on the H200: this file's tests fail without it)
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
def test_lora_combine_and_grad_sum_both_branches(device, n):
    base, lora = (torch.randn(n, device=device).to(torch.float16) for _ in range(2))
    out = torch.full((n,), float("nan"), device=device)
    lora_nf4.lora_combine_kernel[_grid(n)](base, lora, out, n, 2.0, BLOCK=BLOCK, **NO_FMA)
    assert torch.equal(out, base.float() + (lora.float() * 2.0).half().float())

    a16, b16 = (torch.randn(n, device=device).to(torch.float16) for _ in range(2))
    keep = torch.rand(n, device=device) > 0.3
    for drop, m in ((0, a16), (1, keep), (2, keep.float() / 0.7)):
        got = torch.full((n,), float("nan"), device=device)
        lora_nf4.lora_grad_sum_kernel[_grid(n)](a16, b16, m, got, n, 1 / 0.7, DROP=drop, BLOCK=BLOCK,
                                                     **NO_FMA)
        g = b16.float()
        if drop == 1:
            g = (keep.float() * g) * torch.tensor(1 / 0.7, dtype=torch.float32)
        if drop == 2:
            g = g * m
        assert torch.equal(got, a16.float() + g), drop


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("cast_b", [0, 1, 2, 3])
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
    if cast_b == 2:
        assert torch.equal(b16, (a.half().float() * 1.5).half())
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
VECTOR_KERNELS = {"fp32_add_kernel": 1, "lora_combine_kernel": 1, "lora_grad_sum_kernel": 1, "nf4_dequant_cast_kernel": 6}


def test_unmasked_blocks_compile_to_vector_accesses():
    """Every recorded specialization of the four kernels, compiled for sm_90 like the precompile
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
