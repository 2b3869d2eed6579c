"""Self-check: does this environment accept our kernels, do they run here and compute the right
numbers, and do the patches install and come out again?

    python -m solution.selfcheck

Run it where the training will run (the official repository's environment, on its GPU). It prints
one line per check, in Russian and English:

    OK   Triton 3.6.0: принят / accepted (>= 3.2)
    OK   kernel rmsnorm (cuda): работает, совпадает с эталоном / runs, matches its reference: forward 4.9e-08, ...
    FAIL trl 0.30.0: не принят, эти патчи не встанут (сток останется) / not accepted, these patches ...

then a summary whose first lines are the failed checks. Exit status: 0 every check OK (SKIP lines
are not failures), 1 a check failed, 2 a bad command line (one ``error:`` line, nothing run).

On a machine without a CUDA GPU it sets TRITON_INTERPRET=1 for itself (before any kernel module is
imported) and checks the kernels in Triton's CPU interpreter: a SKIP line for the GPU says why the
GPU checks were skipped and which ones (the kernels compiled and run on the GPU, the CUDA-only
attention kernel, the CUDA memory allocator setting), and the summary says it again; the exit
status is 0 when everything that can run on the CPU passed. The CPU run takes seconds (small shapes).

The checks, in order:
1. versions: Python, torch, Triton, transformers, peft, bitsandbytes, trl; the libraries through
   the same ``check()`` each patch runs in ``apply()`` (for transformers and trl: the sha256 of the
   stock sources the patches mirror, solution/patches/_sources.py), so "accepted" means the patch
   installs here; each patch is named as $SOLUTION_SKIP_PATCHES names it (``_apply.patch_names()``);
2. the device: a CUDA GPU of sm_75 or newer (solution/env.py's ``check_support``), or Triton's CPU
   interpreter when TRITON_INTERPRET=1 (set by the self-check itself where there is no CUDA GPU);
3. every module of solution/kernels: launched on that device at small odd shapes (its launch
   counter must move), forward and backward compared with a float64 PyTorch reference
   (solution/_references.py) as a norm-wise relative error ||ours - ref|| / ||ref||, which must
   not exceed TOLERANCE (2e-3, printed on the line); NF4 dequantization must be bit-exact;
4. the patches: ``solution.apply()`` installs every patch, ``solution.revert()`` puts every
   replaced object back (checked by identity).
Nothing here trains, writes files or changes a setting that outlives the process; the background
precompile is not started (``precompile=False``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.metadata as md
import io
import sys
from collections.abc import Callable

PYTHON_RANGE = ((3, 11), (3, 14))  # Soup 0.77.0 needs < 3.14; the CPU suite passed on 3.11 and 3.13
OLDEST_TORCH = (2, 6)  # the torch that brings Triton 3.2 (solution/env.py's OLDEST_TRITON)
EPS = 1e-6

# The largest norm-wise relative error accepted, forward and backward: about four fp16 roundings
# (fp16 keeps 11 significant bits: one rounding errs by at most 2^-11 = 4.9e-4 relative). Measured
# on the CPU interpreter: 4.4e-4 at most (the NF4 GEMM chains), ~1e-7 for kernels that compute in
# fp32; a wrong kernel errs by 1e-1 or more.
TOLERANCE = 2e-3

# (distribution, module that gives __version__, modules of solution/patches whose check() decides
# acceptance); every module of solution.patches.PATCHES is under one library
LIBRARIES = (
    ("transformers", "transformers", ("qwen2_rmsnorm", "qwen2_decoder_layer", "qwen2_rope", "qwen2_mlp",
                                      "qwen2_layer_node", "qwen2_unpad", "trainer_lengths", "trainer_flops",
                                      "trainer_clip")),
    ("peft", "peft", ("peft_lora_bnb", "peft_model_walks")),
    ("bitsandbytes", "bitsandbytes", ("bnb_linear4bit",)),
    ("trl", "trl", ("qwen2_lm_head_loss",)),
)


@dataclasses.dataclass
class Line:
    status: str  # "OK", "FAIL" or "SKIP"
    subject: str
    ru: str
    en: str
    figures: str = ""  # measured values, language-neutral, after both texts
    detail: str = ""  # what the check printed, shown under a failed line

    def text(self) -> str:
        return f"{self.status:<4} {self.subject}: {self.ru} / {self.en}" + (f": {self.figures}" if self.figures else "")


def _version(dist: str, module: str | None = None) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        pass
    try:
        return getattr(importlib.import_module(module or dist), "__version__", None)
    except Exception:  # noqa: BLE001 - not installed or broken: the caller says so
        return None


def _numbers(version: str) -> tuple[int, ...]:
    out = []
    for part in version.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


# --------------------------------------------------------------------------------------------------
# 1. versions
# --------------------------------------------------------------------------------------------------
def _accepted(subject: str, limit: str, reason: str | None) -> Line:
    """OK when ``reason`` is None, else FAIL saying what is needed and why."""
    if reason is None:
        return Line("OK", subject, "принят", f"accepted ({limit})")
    return Line("FAIL", subject, f"нужен {limit}", reason)


def check_python() -> Line:
    (lo, hi), version = PYTHON_RANGE, ".".join(map(str, sys.version_info[:3]))
    limit = f"{lo[0]}.{lo[1]} <= Python < {hi[0]}.{hi[1]}"
    return _accepted(f"Python {version}", limit,
                     None if lo <= sys.version_info[:2] < hi else f"needs {limit} (Soup 0.77.0's range)")


def check_torch() -> Line:
    version = _version("torch")
    if version is None:
        return Line("FAIL", "torch", "не установлен", "not installed")
    limit = f">= {OLDEST_TORCH[0]}.{OLDEST_TORCH[1]}"
    return _accepted(f"torch {version}", limit, None if _numbers(version) >= OLDEST_TORCH else f"needs {limit}")


def check_triton() -> Line:
    from solution.env import OLDEST_TRITON, triton_too_old

    version = _version("triton")
    if version is None:
        return Line("FAIL", "Triton", "не установлен: ядра не запустятся", "not installed: no kernel can run")
    return _accepted(f"Triton {version}", f">= {OLDEST_TRITON[0]}.{OLDEST_TRITON[1]}", triton_too_old(version))


def check_library(dist: str, module: str, patches: tuple[str, ...]) -> Line:
    """The installed ``dist`` through the check() of every patch that depends on it (``patches``:
    modules of solution/patches); the patches are named by their NAME, the name
    $SOLUTION_SKIP_PATCHES takes."""
    version = _version(dist, module)
    subject = f"{dist} {version}" if version else dist
    reasons, names = [], []
    for module_name in patches:
        patch = importlib.import_module(f"solution.patches.{module_name}")
        names.append(patch.NAME)
        reason = patch.check()
        if reason is not None:
            reasons.append(f"{patch.NAME}: {reason}")
    if version is None:
        return Line("FAIL", subject, "не установлен", "not installed")
    if reasons:
        return Line("FAIL", subject, "не принят, эти патчи не встанут (сток останется)",
                    "not accepted, these patches would be skipped: " + "; ".join(reasons))
    return Line("OK", subject, "принят патчами", f"accepted by the patches {', '.join(names)}")


# --------------------------------------------------------------------------------------------------
# 2. the device
# --------------------------------------------------------------------------------------------------
# What a run without the GPU leaves unchecked (the GPU line and the summary say it).
GPU_CHECKS_RU = ("ядра, собранные и запущенные на GPU, ядро внимания только для CUDA, "
                 "настройка памяти CUDA (cuda_allocator)")
GPU_CHECKS_EN = ("the kernels compiled and run on the GPU, the CUDA-only attention kernel, "
                 "the CUDA memory allocator setting (cuda_allocator)")


def interpret_without_gpu() -> bool:
    """On a machine without a CUDA GPU, let this process run our kernels in Triton's CPU
    interpreter ($TRITON_INTERPRET=1 through settings.use_interpreter, as tests/conftest.py does
    for the tests), before any kernel module is imported. True when it set it; False when there is
    a CUDA GPU, when the interpreter is already on, when PyTorch is missing (check_torch says so),
    or when a kernel module is already imported (too late: check_device then says why nothing runs)."""
    from solution.settings import interpreter_enabled, use_interpreter

    try:
        import torch
    except ImportError:
        return False
    if torch.cuda.is_available() or interpreter_enabled():
        return False
    if any(name.startswith("solution.kernels.") and not name.rsplit(".", 1)[1].startswith("_")
           for name in sys.modules):
        return False
    use_interpreter()
    return True


def no_gpu_reason() -> tuple[str, str]:
    """(Russian, English) why the kernels do not run on a GPU here, for a machine where they run
    in Triton's CPU interpreter."""
    import torch

    if torch.cuda.is_available():
        return ("задан TRITON_INTERPRET=1: ядра идут в интерпретаторе Triton на CPU, не на GPU",
                "TRITON_INTERPRET=1 is set: the kernels run in Triton's CPU interpreter, not on the GPU")
    if torch.version.cuda is None:
        return (f"на этой машине нет CUDA GPU (PyTorch {torch.__version__} собран без CUDA)",
                f"no CUDA GPU on this machine (PyTorch {torch.__version__} is built without CUDA)")
    return ("на этой машине нет CUDA GPU (PyTorch не видит GPU или его драйвер)",
            "no CUDA GPU on this machine (PyTorch sees no GPU or no GPU driver)")


def check_device() -> tuple[list[Line], str | None]:
    """(lines, "cuda" / "cpu" where the kernel checks run, or None when they cannot run). On the
    CPU interpreter: a SKIP line for the GPU (why, and which checks that leaves out), then the
    CPU's OK line."""
    from solution.env import check_support

    support = check_support()
    if not support.ok:
        return [Line("FAIL", "GPU", "ядра здесь не запустятся", support.reason)], None
    if support.device == "interpreter":
        ru, en = no_gpu_reason()
        return [Line("SKIP", "GPU", f"{ru}; проверки на GPU пропущены: {GPU_CHECKS_RU}",
                     f"{en}; the GPU checks are skipped: {GPU_CHECKS_EN}"),
                Line("OK", "CPU", "ядра проверяются в интерпретаторе Triton на CPU (числа, не скорость)",
                     "the kernels are checked in Triton's CPU interpreter instead (their numbers, not their "
                     "speed)")], "cpu"
    import torch

    major, minor = torch.cuda.get_device_capability()
    return [Line("OK", f"GPU {torch.cuda.get_device_name()} (sm_{major}{minor})", "принята",
                 "accepted (sm_75 or newer)")], "cuda"


# --------------------------------------------------------------------------------------------------
# 3. the kernels
# --------------------------------------------------------------------------------------------------
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
)


def check_kernel(name: str, fn: Callable, needs_cuda: bool, device: str | None) -> Line:
    subject = f"kernel {name}"
    if device is None:
        return Line("SKIP", subject, "устройство не принято (строка GPU выше)", "no accepted device (GPU line above)")
    if needs_cuda and device != "cuda":
        return Line("SKIP", subject, "проверка на GPU: ядро внимания PyTorch для строк разной длины есть только "
                    "на CUDA", "a GPU check: PyTorch's attention kernel for rows of different lengths exists only "
                    "on CUDA (on the CPU, attention runs row by row through PyTorch's standard attention)")
    from solution.kernels import _launches

    _launches.reset()
    errs, expected = fn(device)
    missing = [k for k in expected if _launches.LAUNCHES[k] == 0]
    exact = "wrong values" in errs
    if exact:
        figures = f"{int(errs['wrong values'])} wrong values (bit-exact required)"
        bad = errs["wrong values"] != 0
    else:
        figures = ", ".join(f"{k} {e:.1e}" for k, e in errs.items()) + f" (limit {TOLERANCE:.0e})"
        bad = not all(e <= TOLERANCE for e in errs.values())
    subject = f"{subject} ({device})"
    if missing:
        return Line("FAIL", subject, "ядро не запускалось", f"did not launch: {', '.join(missing)}")
    if bad:
        return Line("FAIL", subject, "не совпадает с эталоном", "does not match its reference", figures)
    return Line("OK", subject, "работает, совпадает с эталоном", "runs, matches its reference", figures)


# --------------------------------------------------------------------------------------------------
# 4. the patches
# --------------------------------------------------------------------------------------------------
def check_patches(device: str | None) -> Line:
    """apply() installs every patch; revert() puts every replaced object back (by identity)."""
    if device is None:
        return Line("SKIP", "patches", "устройство не принято: apply() ничего не ставит",
                    "no accepted device: apply() installs nothing")
    import solution
    from solution import _apply
    from solution.patches._base import _MISSING, _Item

    settings = dataclasses.replace(_apply.check_settings(), precompile=False)
    installed = solution.apply(settings=settings)
    swapped = list(_apply._swaps._log)
    skipped = [n for n in _apply.patch_names() if n not in installed and n != _apply.ALLOCATOR
               and n not in settings.skip_patches]
    solution.revert()

    def current(owner, name):
        if isinstance(owner, _Item):
            return owner.mapping.get(name, _MISSING)
        return owner.__dict__.get(name, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, name, _MISSING)

    not_back = [f"{getattr(o, '__name__', type(o).__name__)}.{n}" for o, n, orig in swapped if current(o, n) is not orig]
    if not installed or skipped:
        return Line("FAIL", "patches", "не все патчи встали (причины — в строках [solution] ниже)",
                    f"not every patch installed; skipped: {', '.join(skipped) or 'all'}")
    if not_back or solution.installed():
        return Line("FAIL", "patches", "revert() не вернул стоковые объекты",
                    f"revert() left replaced objects: {', '.join(not_back) or 'installed() not empty'}")
    return Line("OK", "patches", f"{len(installed)} установлены и сняты, {len(swapped)} стоковых объектов на месте",
                f"{len(installed)} installed and reverted, all {len(swapped)} replaced objects back in place")


# --------------------------------------------------------------------------------------------------
def _run(subject: str, check: Callable, *args):
    """The result of ``check(*args)`` (a Line, or a tuple whose first item is a Line or a list of
    them) with what it printed on stdout and stderr (a library's log lines and warnings, e.g.
    bitsandbytes' note about an optional CPU kernel) kept in its first line's ``detail``, shown only
    under a failed line; an exception is a FAIL line for ``subject`` naming it."""
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            result = check(*args)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        result = Line("FAIL", subject, "ошибка при проверке", f"{type(exc).__name__}: {first}")
    line = result[0] if isinstance(result, tuple) else result
    line = line[0] if isinstance(line, list) else line
    line.detail = buf.getvalue().strip()
    return result


def run_all(emit: Callable[[str], None] = print) -> list[Line]:
    """Every check in order, each line emitted as soon as it is known; returns the lines."""
    lines = []

    def record(line: Line) -> None:
        lines.append(line)
        emit(line.text())
        if line.status == "FAIL" and line.detail:
            for extra in line.detail.splitlines()[-5:]:
                emit(f"       {extra}")

    for subject, check in (("Python", check_python), ("torch", check_torch), ("Triton", check_triton)):
        record(_run(subject, check))
    for dist, module, patches in LIBRARIES:
        record(_run(dist, check_library, dist, module, patches))
    result = _run("GPU", check_device)
    device_lines, device = result if isinstance(result, tuple) else ([result], None)
    for line in device_lines:
        record(line)
    for name, fn, needs_cuda in KERNELS:
        record(_run(f"kernel {name}", check_kernel, name, fn, needs_cuda, device))
    record(_run("patches", check_patches, device))
    return lines


def summary(lines: list[Line]) -> list[str]:
    """The summary: failed lines first, then (when the GPU checks were skipped) a line saying so
    and where to run them, then the count."""
    failed = [l for l in lines if l.status == "FAIL"]
    ok = sum(l.status == "OK" for l in lines)
    skipped = sum(l.status == "SKIP" for l in lines)
    out = [l.text() for l in failed]
    if any(l.status == "SKIP" and l.subject == "GPU" for l in lines):
        out.append("Проверки на GPU пропущены: ядра проверены только в интерпретаторе Triton на CPU; запустите "
                   "python -m solution.selfcheck на машине с GPU, где пойдёт обучение / The GPU checks were "
                   "skipped: the kernels were checked only in Triton's CPU interpreter; run python -m "
                   "solution.selfcheck on the GPU machine where the training will run")
    if failed:
        out.append(f"ИТОГ / SUMMARY: {len(failed)} из {len(lines)} проверок не прошли / {len(failed)} of "
                   f"{len(lines)} checks failed ({ok} OK, {skipped} SKIP)")
    else:
        out.append(f"ИТОГ / SUMMARY: все проверки пройдены / every check passed ({ok} OK, {skipped} SKIP)")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv:
        print(f"error: python -m solution.selfcheck takes no arguments, got {' '.join(argv)!r}", file=sys.stderr)
        return 2
    interpret_without_gpu()  # no CUDA GPU: the kernels run in Triton's CPU interpreter
    lines = run_all()
    print("-" * 80)
    for text in summary(lines):
        print(text)
    return 1 if any(l.status == "FAIL" for l in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
