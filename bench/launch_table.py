"""Launch configurations on both machines, by a stated model (a model, not a measurement: no T4
has run it).

    python -m bench.launch_table        # a Markdown table, one row per launch configuration

For every spec yielded by a kernel module's ``sm75_specs()`` (solution/sm75_check.py collects and
compiles them the same way): num_warps, the static shared memory of its sm_75 compile, the
resident blocks per SM that the per-SM limits below allow on a T4 and on an H200, the programs one
launch gets at the workload's shapes (read off the launchers in solution/kernels/*.py) and the
waves that makes. Compiling needs no GPU but must run WITHOUT TRITON_INTERPRET=1. No tensors.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

from solution.kernels._launches import cdiv  # ceil(a / b), as the launchers compute their grids


@dataclass(frozen=True)
class Device:
    """One GPU's per-SM limits: shared memory in bytes, resident warps (max threads / 32) and blocks."""
    name: str
    cc: str
    sms: int
    shared_per_sm: int
    max_warps: int
    max_blocks: int
    regs_per_sm: int


# Per-SM limits: NVIDIA CUDA C Programming Guide, "Technical Specifications per Compute
# Capability" (7.5 and 9.0). SM counts: the products' specifications (T4 40, H200 132).
T4 = Device("T4", "sm_75", 40, 64 * 1024, 32, 16, 65536)
H200 = Device("H200", "sm_90", 132, 228 * 1024, 64, 32, 65536)
DEVICES = (T4, H200)

# The workload's typical step: the layers run on N tokens (T4: eager, the R = 1003 real tokens;
# H200: the CUDA-graph bucket, T = 1135); the LM head runs on the R real rows on both.
TOKENS = {"T4": 1003, "H200": 1135}
LM_ROWS = 1003
H, I, HQ, HKV, D, V, LAYERS, LORA_R = 1536, 8960, 12, 2, 128, 151936, 28, 16
KV = HKV * D  # k_proj / v_proj outputs: 256
W_Q, W_KV, W_MLP = H * H, KV * H, H * I  # NF4 weights: q/o_proj, k/v_proj, gate/up/down_proj
NF4_BLOCKSIZE = 64


def blocks_per_sm(dev: Device, num_warps: int, shared: int, regs_per_thread: int | None = None) -> int:
    """Resident blocks per SM: the smallest of the block, warp, shared-memory (and, when known,
    register) limits. 0: the block does not fit the SM at all."""
    limits = [dev.max_blocks, dev.max_warps // num_warps]
    if shared > 0:
        limits.append(dev.shared_per_sm // shared)
    if regs_per_thread:
        limits.append(dev.regs_per_sm // (regs_per_thread * 32 * num_warps))
    return max(0, min(limits))


def waves(grid: int, dev: Device, blocks: int) -> float:
    """Programs over what the whole GPU holds at once (SMs x resident blocks per SM)."""
    return float("inf") if blocks == 0 else grid / (dev.sms * blocks)


def _nf4_programs(weight_elems: int, nb: int) -> int:
    """nf4_dequant's programs for one weight: NB quantization blocks (of 64) per program."""
    return cdiv(cdiv(weight_elems, NF4_BLOCKSIZE), nb)


def grids(module: str, spec: dict, n: int) -> tuple[list[int] | None, str]:
    """(programs of each distinct launch of this config in a step at n layer tokens, a note);
    (None, why) where the grid is not modelled. Formulas: the launchers in solution/kernels/."""
    c, name = spec.get("constexprs", {}), spec["name"]
    if module in ("rmsnorm", "add_rmsnorm") and "BLOCK_M" not in c:
        if c["BLOCK"] != 1 << (H - 1).bit_length():  # BLOCK 128 / 8192: the specs' hidden 100 / 8192
            return None, "edge config (hidden != 1536): not a workload launch"
        return [cdiv(n, c["BLOCK_ROWS"])], ""  # one program per BLOCK_ROWS rows
    if module == "rmsnorm":  # weight gradient: [cols / BLOCK_N, rows / BLOCK_M] partial sums
        return [cdiv(H, c["BLOCK_N"]) * cdiv(n, c["BLOCK_M"])], "only if the norm weight trains (frozen here)"
    if module == "fp32_add":  # residual adds, [N, H] elementwise
        return [cdiv(n * H, c["BLOCK"])], ""
    if module == "lm_head_loss":  # one program per BLOCK_ROWS rows of each logits chunk
        from solution.kernels.lm_head_loss import plan_chunk_rows
        chunk = plan_chunk_rows(LM_ROWS, V, 2 if "fp16" in name else 4)
        sizes = [min(chunk, LM_ROWS - r0) for r0 in range(0, LM_ROWS, chunk)]
        return sorted({cdiv(s, c["BLOCK_ROWS"]) for s in sizes}), f"{len(sizes)} chunks of <= {chunk} rows"
    if module == "lora_nf4":
        a = cdiv(LORA_R * H, c["BLOCK"])  # A [16, 1536]; B [1536, 16] (q) or [256, 16] (v)
        bq, bv = cdiv(H * LORA_R, c["BLOCK"]), cdiv(KV * LORA_R, c["BLOCK"])
        if name.startswith("quad_cast"):  # the node: q's and v's A and B in one launch
            return [2 * a + bq + bv], "tiny: 4 casts a launch"
        if name.startswith("pair_cast"):
            return sorted({a + bq, a + bv}), "tiny: 2 casts a launch"
        return None, "not modelled"
    if module == "nf4_dequant":
        nb = c["NB"]
        note = " + ".join(x for x, on in (("bf16 state", c["ROUND_BF16"]), ("no double quant", not c["NESTED"])) if on)
        note = note and f"{note}: not this workload's"
        if "CAST_B" not in c:  # plain dequant: o_proj forward and backward (fp16 input and gradient),
            # up/down forward, gate/up/down backward
            return sorted({_nf4_programs(W_Q, nb), _nf4_programs(W_MLP, nb)}), note
        # dequant programs + cdiv(cast elements, CAST_BLOCK), per (weight, cast elements) launch
        jobs = {0: [(W_KV, n * H), (W_KV, n * KV), (W_MLP, n * H)],  # k fwd/bwd, gate fwd (x cast)
                1: [(W_Q, n * H), (W_KV, n * H)], 3: [(W_Q, n * H), (W_KV, n * H)],  # LoRA q, v fwd
                2: [(W_Q, n * H), (W_KV, n * KV)]}[c["CAST_B"]]                      # LoRA q, v bwd
        return sorted({_nf4_programs(w, nb) + cdiv(e, c["CAST_BLOCK"]) for w, e in jobs}), note
    if module == "swiglu":  # [N / BLOCK_R, I / BLOCK_C] tiles
        return [cdiv(n, c["BLOCK_R"]) * cdiv(I, c["BLOCK_C"])], ""
    return None, "not modelled"


def _fmt_range(xs: list, fmt) -> str:
    lo, hi = fmt(min(xs)), fmt(max(xs))
    return lo if lo == hi else f"{lo}-{hi}"


def _fmt_waves(w: float) -> str:
    return f"{w:.1f}" if w >= 1 else f"{w:.2f}"


def verdict(warps: int, shared: int, blocks: dict, low_waves: dict | None) -> str:
    """Plain words: does the config fit and fill both devices? (the smallest launch decides)."""
    no_fit = [d.name for d in DEVICES if blocks[d.name] == 0]
    if no_fit:
        return f"does not fit {' / '.join(no_fit)} shared memory ({shared} B)"
    # shared memory is the binding limit where it allows fewer blocks than blocks / warps do
    bound = [d.name for d in DEVICES if shared > 0 and d.shared_per_sm // shared < min(d.max_blocks, d.max_warps // warps)]
    tail = f"; shared-memory bound on {' / '.join(bound)}" if bound else ""
    if low_waves is None:
        return "grid not modelled" + tail
    under = [f"{d.name} ({_fmt_waves(low_waves[d.name])} wave)" for d in DEVICES if low_waves[d.name] < 1]
    return ("fills both" if not under else "under-fills " + ", ".join(under)) + tail


def rows() -> list[dict]:
    from solution.sm75_check import _kernel_modules, compile_spec

    out = []
    for mod_name, mod in _kernel_modules():
        for spec in mod.sm75_specs():
            row = {"module": mod_name, "name": spec["name"], "warps": spec.get("num_warps", 4)}
            try:
                k = compile_spec(spec)
                row["shared"] = int(k.metadata.shared)
                # registers: only if the compiled object tells (Triton fills n_regs when it loads
                # the kernel on a GPU, which this tool never does)
                row["regs"] = getattr(k.metadata, "n_regs", None) or getattr(k, "n_regs", None)
            except Exception as exc:  # report, keep going
                row["error"] = f"compile failed: {type(exc).__name__}"
                out.append(row)
                continue
            row["blocks"] = {d.name: blocks_per_sm(d, row["warps"], row["shared"], row["regs"]) for d in DEVICES}
            row["grids"], row["note"], row["waves"] = {}, "", {}
            for d in DEVICES:
                g, row["note"] = grids(mod_name, spec, TOKENS[d.name])
                row["grids"][d.name] = g
                row["waves"][d.name] = None if g is None else [waves(x, d, row["blocks"][d.name]) for x in g]
            low = None if row["grids"]["T4"] is None else {n: min(w) for n, w in row["waves"].items()}
            row["verdict"] = verdict(row["warps"], row["shared"], row["blocks"], low)
            out.append(row)
    return out


def markdown(table: list[dict]) -> str:
    regs = any(r.get("regs") for r in table)
    lines = [
        "Launch configurations on a T4 and an H200, by a stated model (no GPU used).", "",
        "Model: resident blocks per SM = min(blocks limit, warps limit // num_warps, shared per SM // "
        "shared per block); waves = programs / (SMs x resident blocks). Per-SM limits from NVIDIA's "
        "CUDA C Programming Guide, compute-capability table: "
        + "; ".join(f"{d.name} ({d.cc}): {d.sms} SMs, {d.shared_per_sm // 1024} KB shared, {d.max_warps} warps, "
                    f"{d.max_blocks} blocks, {d.regs_per_sm} registers per SM" for d in DEVICES) + " (SM counts: "
        "the products' specifications).",
        "Assumptions: shared memory is each config's static shared memory compiled for sm_75, used for both "
        "devices (an sm_90 compile may differ); the maximum shared-memory carveout and no per-block driver "
        "reservation; " + ("registers from the compiled kernels" if regs else
                           "registers not counted (the compiled kernel reports none without a GPU)") + ".",
        f"Grids: one launch's programs at the workload's shapes (hidden {H}, intermediate {I}, {HQ}/{HKV} heads "
        f"of {D}, vocab {V}, {LAYERS} layers, LoRA r={LORA_R} on q/v): layer tokens N = {TOKENS['T4']} on the T4 "
        f"(eager, real tokens) and {TOKENS['H200']} on the H200 (CUDA-graph bucket); the LM head on the "
        f"{LM_ROWS} real rows on both. A range: the config's distinct launches in a step; the smallest "
        "decides the verdict (fills = at least one full wave).", "",
        "| module | launch config | warps | shared B | blocks/SM T4 | blocks/SM H200 | grid T4 | grid H200 | "
        "waves T4 | waves H200 | verdict | note |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in table:
        if "error" in r:
            lines.append(f"| {r['module']} | {r['name']} | {r['warps']} | - | | | | | | | {r['error']} | |")
            continue
        g, w = r["grids"], r["waves"]
        cells = [_fmt_range(g[d.name], str) if g[d.name] else "not modelled" for d in DEVICES]
        cells += [_fmt_range(w[d.name], _fmt_waves) if w[d.name] else "-" for d in DEVICES]
        lines.append(f"| {r['module']} | {r['name']} | {r['warps']} | {r['shared']} | {r['blocks']['T4']} | "
                     f"{r['blocks']['H200']} | {' | '.join(cells)} | {r['verdict']} | {r['note']} |")
    ok = sum("error" not in r for r in table)
    lines += ["", f"{ok} of {len(table)} launch configurations compiled for sm_75"]
    return "\n".join(lines)


def main() -> int:
    from solution.env import interpreter_enabled

    if interpreter_enabled():
        print("error: run bench.launch_table without TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    table = rows()
    print(markdown(table))
    return 0 if table and all("error" not in r for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())
