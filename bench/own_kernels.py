"""Which GPU kernels are ours: every function decorated with @triton.jit under solution/.

Found by reading the source (ast), so a kernel counts as ours only if its code is in solution/.
In a profiler trace a Triton kernel's name is its Python function name.
"""
from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

SOLUTION_DIR = Path(__file__).resolve().parent.parent / "solution"


def _is_triton_jit(dec: ast.expr) -> bool:
    """@triton.jit, @jit or @triton.jit(...)."""
    node = dec.func if isinstance(dec, ast.Call) else dec
    return ast.unparse(node) in ("triton.jit", "jit")


@lru_cache(maxsize=1)
def own_kernel_names(root: str = str(SOLUTION_DIR)) -> frozenset[str]:
    names = set()
    for path in Path(root).rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(_is_triton_jit(d) for d in node.decorator_list):
                names.add(node.name)
    return frozenset(names)


def is_own_kernel(kernel_name: str) -> bool:
    """Triton names kernels after the function (sometimes with a suffix such as '_0d1d')."""
    base = kernel_name.split("(")[0].strip()
    names = own_kernel_names()
    return base in names or any(base.startswith(n + "_") and base[len(n) + 1:].replace("d", "").isdigit() for n in names)


CATEGORIES = [
    ("ours (solution/ Triton)", None),
    # attention before matmul: PyTorch's memory-efficient attention kernels are named
    # fmha_cutlass*, which the matmul keys would claim
    ("attention (SDPA)", ("fmha", "flash", "attention", "sdpa", "efficient_attention", "pytorch_flash")),
    ("matmul (cuBLAS/CUTLASS)", ("gemm", "gemv", "cutlass", "xmma", "cublas", "sm80_", "sm90_", "ampere_", "turing_", "volta_", "splitk", "matmul")),
    ("bitsandbytes dequant", ("dequantize", "kdequant", "kquant", "bnb")),
    ("softmax / loss", ("softmax", "nll_loss", "cross_entropy", "log_softmax", "logsumexp")),
    ("optimizer", ("multi_tensor", "adam", "fused_adam", "foreach")),
    ("reduction", ("reduce", "norm_kernel", "sum_kernel", "max_kernel", "argmax")),
    ("elementwise / copy / cast", ("elementwise", "vectorized", "copy", "cast", "fill", "unrolled", "index", "cat", "where", "mul", "add", "pow")),
]


def categorize(kernel_name: str) -> str:
    if is_own_kernel(kernel_name):
        return CATEGORIES[0][0]
    low = kernel_name.lower()
    for cat, keys in CATEGORIES[1:]:
        if any(k in low for k in keys):
            return cat
    return "other"
