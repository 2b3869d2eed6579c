"""Every launch of our Triton kernels goes through ``launch()``: one place that starts a kernel and
counts it, so the rule 'at least one solution/ kernel ran during training' can be checked even on
the CPU interpreter, where no GPU profiler sees kernels (counting is one Counter increment).

The direct launch (the eager step's host time, docs/kernels/direct_launch.md):
1. What it replaces. ``kernel[grid](*args)``, i.e. Triton's ``JITFunction.run``, at every launch:
   it binds the arguments and computes their specialization (Triton's generated binder, native
   code per argument), turns the compile options into a string for its cache key, looks the key
   up, checks the kernel's global values, builds the launch metadata for its launch hooks, and
   only then calls the compiled kernel's launcher.
2. Why that was slow. Measured in the decoder-layer node (bench/kernels/bench_node_sections.py,
   H200, Triton 3.6): 37 launches a layer cost 1.68 ms of host time, ~45 us each, a third of the
   layer's 5 ms; one of them timed alone: 25.6 us through ``kernel[grid]``, 8.8 us through the
   launcher called directly.
3. What it does instead. The same binder (so the same specialization: argument types, 16-byte
   alignment of pointers, integers equal to 1 or divisible by 16, constexpr values) gives the
   key; the first launch of each key goes through ``kernel[grid]`` (Triton compiles or finds the
   kernel, checks everything, launches) and its compiled kernel is kept; later launches of that
   key call the compiled kernel's launcher directly, on the current device's current stream, with
   the very arguments ``JITFunction.run`` passes it. The kernel that runs and its arguments are
   the same; the values are the same bits.
4. Correctness risks. (a) Triton's internals: the direct path is taken only when the sources of
   ``JITFunction.run``, of its binder, of ``CompiledKernel.launch_metadata`` / ``run`` and of the
   launch hooks' ``HookChain`` are the ones reviewed (sha256 in ``ACCEPTED_TRITON``: 3.6.0 run on a
   GPU, 3.7.0-3.9.0 read); any other Triton, the interpreter, a launch hook (a profiler such as
   proton), a stage-inspection hook, a pre-run hook or a callable grid: ``kernel[grid]`` as before.
   (b) What a later launch no longer re-checks: the kernel's global values (ours are module
   constants) and Triton's debug / instrumentation knobs (read by the first launch of a key only).
   (c) Tests: tests/test_launches.py (the plumbing on the CPU; on a GPU the same bits through both
   paths, a specialization change taking ``kernel[grid]`` again, the direct path really taken).
5. How it was measured: docs/kernels/direct_launch.md.
"""
from __future__ import annotations

import hashlib
from collections import Counter

LAUNCHES: Counter = Counter()
# Names counted in LAUNCHES that are not our Triton kernels (PyTorch's own kernels or reference
# code run by our wiring): counted for the tests, never reported as our kernels.
NOT_OURS: set = set()
# Launches (by name) that took the direct path; the rest of LAUNCHES went through kernel[grid].
DIRECT: Counter = Counter()

# sha256 of the reviewed sources of Triton's launch path (``_triton_launch_source``) -> version.
# Reviewed by reading the sources; run on a GPU: 3.6.0 (the H200's and Kaggle's Triton). 3.7.0 to 3.9.0
# differ from 3.6.0 only where the direct path does not go or steps aside: a stage-inspection hook
# that adds to the specialization (``add_stages_inspection_hook``: set, the launch takes
# kernel[grid]), an fpsan option (like debug: part of Triton's key only), the binder's handling of
# *args / keyword-only parameters (none in our kernels), no async-compile ``result()`` any more.
ACCEPTED_TRITON = {
    "879d3f2d1472d12c61d004f98beafe512ece99c5ffff9bc8aa08dffb532649ba": "3.6.0",
    "9c9031cd09d45bbfcd4f8ffaa3db89ea479137230d3f35032ed9cc38c2752faf": "3.7.0",
    "17f6fcbc5e88eb9839904f54c9f8807efa8df1a260d73917709bf1e24b776000": "3.8.0",
    "65985677219584f3fdfdc6c1850237803ede8396e5b7b8ada5696e0337f306cc": "3.9.0",
}


class _Direct:
    """What the direct path needs from Triton: the JIT class and the runtime knobs (launch hooks),
    read once; the current device and stream getters of Triton's driver, read at the first direct
    launch (the driver exists only with a GPU: the interpreter never gets there)."""

    __slots__ = ("jit_cls", "knobs", "device", "stream")

    def __init__(self, jit_cls, knobs):
        self.jit_cls, self.knobs, self.device, self.stream = jit_cls, knobs, None, None

    def bind_driver(self) -> None:
        from triton.runtime import driver

        active = driver.active
        self.device, self.stream = active.get_current_device, active.get_current_stream


# sha256 of the reviewed source of the compiled kernel's launcher call (``CudaLauncher.__call__`` in
# triton/backends/nvidia/driver.py) -> version: where it is this one, a prepared launch calls the
# launcher's native ``launch`` with the arguments that __call__ gives it (``raw_launcher``).
ACCEPTED_LAUNCHER = {
    "9412a64d532d5b5ce67ef236d2f377fe728f58c346b5ef399c4836793b79f436": "3.6.0",
}

# direct: None (not decided) | False | _Direct; prepared: launch_prepared may skip the binder (benchmarks
# turn it off to compare); raw: launch_prepared may call the native launch (``raw_launcher``; benchmarks
# turn it off to compare); launcher_cls: None (not decided) | False | Triton's CudaLauncher
_state: dict = {"direct": None, "enabled": True, "prepared": True, "raw": True, "launcher_cls": None}
_COMPILED: dict = {}  # (id(kernel), device, specialization, options) -> Triton's compiled kernel


def _triton_launch_source() -> str:
    """The sources of the functions whose behaviour the direct path reproduces or relies on."""
    import inspect

    from triton import knobs
    from triton.compiler import compiler
    from triton.runtime import jit

    parts = (jit.JITFunction.run, jit.JITFunction.create_binder, jit.create_function_from_signature,
             compiler.CompiledKernel.launch_metadata, compiler.CompiledKernel.run.fget, knobs.HookChain)
    return "".join(inspect.getsource(f) for f in parts)


def _source_digest(source: str) -> str:
    """sha256 (hex) of reviewed source text: what ``ACCEPTED_TRITON`` and ``ACCEPTED_LAUNCHER`` hold."""
    return hashlib.sha256(source.encode()).hexdigest()


def triton_launch_digest() -> str | None:
    """sha256 of ``_triton_launch_source`` (None when Triton lacks one of those functions); read
    once per process (reading the sources takes milliseconds)."""
    if "digest" not in _state:
        try:
            _state["digest"] = _source_digest(_triton_launch_source())
        except (ImportError, AttributeError, OSError, TypeError):
            _state["digest"] = None
    return _state["digest"]


def direct_reason() -> str | None:
    """Why launches cannot take the direct path here (None: they can, on a compiled GPU kernel)."""
    if not _state["enabled"]:
        return "turned off"
    digest = triton_launch_digest()
    if digest is None:
        return "this Triton has no JITFunction.run / CompiledKernel of the reviewed shape"
    if digest not in ACCEPTED_TRITON:
        import triton

        return f"Triton {triton.__version__}'s launch path is not the reviewed one ({', '.join(sorted(set(ACCEPTED_TRITON.values())))})"
    return None


def _decide():
    direct = False
    if direct_reason() is None:
        from triton import knobs
        from triton.runtime import jit

        direct = _Direct(jit.JITFunction, knobs)
    _state["direct"] = direct
    return direct


def set_direct(enabled: bool) -> None:
    """Turn the direct path on (the default, where ``direct_reason`` allows it) or off (the kept
    compiled kernels stay valid: they are what Triton itself launches for those keys)."""
    _state["enabled"] = bool(enabled)
    _state["direct"] = None


def record(kernel_name: str, ours: bool = True) -> None:
    LAUNCHES[kernel_name] += 1
    if not ours:
        NOT_OURS.add(kernel_name)


def reset() -> None:
    LAUNCHES.clear()
    DIRECT.clear()


def _direct_ready(kernel, grid):
    """The direct path's state when ``kernel`` may take it now, else None (``kernel[grid]`` then)."""
    d = _state["direct"]
    if d is None:
        d = _decide()
    if d is False or type(kernel) is not d.jit_cls or type(grid) is not tuple or kernel.pre_run_hooks:
        return None
    rt = d.knobs.runtime
    if rt.launch_enter_hook.calls or rt.launch_exit_hook.calls or getattr(rt, "add_stages_inspection_hook", None):
        return None
    if d.device is None:
        d.bind_driver()
    return d


def _launch(kernel, grid, name: str, args: tuple, kwargs: dict, keep: bool = False):
    """``launch``'s work. ``keep`` (``launch_prepared``'s first call of a key): return the compiled
    kernel when the direct path launched it (or kept it at its first launch) and Triton's binder
    handed its launcher exactly ``args`` (the caller's positional arguments, in order, nothing
    added); otherwise None."""
    LAUNCHES[name] += 1
    d = _direct_ready(kernel, grid)
    if d is None:
        kernel[grid](*args, **kwargs)
        return None
    device = d.device()
    bound, spec, options = kernel.device_caches[device][4](*args, **kwargs)  # Triton's binder
    key = (id(kernel), device, tuple(spec), tuple(options.items()))
    compiled = _COMPILED.get(key)
    if compiled is None:  # Triton binds, compiles or finds, checks and launches; keep what ran
        compiled = kernel[grid](*args, **kwargs)
        if hasattr(compiled, "result"):
            compiled = compiled.result()
        if compiled is not None:
            _COMPILED[key] = compiled
    else:
        DIRECT[name] += 1
        n = len(grid)
        compiled.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, d.stream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *bound.values())
    if not keep or compiled is None:
        return None
    values = list(bound.values())
    if len(values) != len(args) or any(v is not a for v, a in zip(values, args)):
        return None
    return compiled


def launch(kernel, grid, name: str, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, counted under ``name``; where this Triton's launch path
    is the reviewed one, a repeated launch (same specialization) calls the compiled kernel's
    launcher directly (module docstring)."""
    _launch(kernel, grid, name, args, kwargs)


def launch_prepared(site: dict, key, kernel, grid: tuple, name: str, args: tuple, options: dict) -> None:
    """``launch(kernel, grid, name, *args, **options)`` for a call site that knows what decides
    Triton's specialization of its calls. ``args``: every parameter of the kernel, constexprs
    included, positionally in signature order; ``options``: launch options only (num_warps,
    enable_fp_fusion). ``key``: the caller's hashable summary that determines every argument's
    specialization at this site (the dtype and the 16-byte alignment of each pointer that can
    change, the specialized integers that can change, the constexprs that can change); ``site``:
    the caller's dict, key -> compiled kernel. The first call of a key goes through ``launch``,
    whose binder checks that it passes exactly ``args`` to the launcher; after that a call of the
    key skips the binder and its key and calls the kept compiled kernel's launcher with ``args``
    (docs/kernels/direct_launch.md, "Prepared launches"). Only while the direct path is allowed
    (``direct_reason``, no launch hooks); otherwise ``launch``."""
    kept = site.get(key)
    if kept is not None and _state["prepared"]:
        d = _direct_ready(kernel, grid)
        if d is not None:
            device = d.device()
            if kept[0] == device:
                compiled, raw = kept[1], kept[2]
                LAUNCHES[name] += 1
                DIRECT[name] += 1
                n = len(grid)
                gx, gy, gz, stream = grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, d.stream(device)
                if raw is not None and _state["raw"]:  # CudaLauncher.__call__'s own call of launch
                    raw[0](gx, gy, gz, stream, compiled.function, raw[1], raw[2], None, None,
                           compiled.packed_metadata, None, None, None, *args)
                else:
                    compiled.run(gx, gy, gz, stream, compiled.function, compiled.packed_metadata, None, None, None,
                                 *args)
                return
    compiled = _launch(kernel, grid, name, args, options, keep=True)
    if compiled is not None:
        site[key] = (_state["direct"].device(), compiled, raw_launcher(compiled))


def _launcher_cls():
    """Triton's CudaLauncher when its ``__call__`` is the reviewed one (``ACCEPTED_LAUNCHER``), else
    False; decided once."""
    cls = _state["launcher_cls"]
    if cls is None:
        cls = False
        try:
            import inspect

            from triton.backends.nvidia.driver import CudaLauncher

            if _source_digest(inspect.getsource(CudaLauncher.__call__)) in ACCEPTED_LAUNCHER:
                cls = CudaLauncher
        except (ImportError, AttributeError, OSError, TypeError):
            pass
        _state["launcher_cls"] = cls
    return cls


def raw_launcher(compiled):
    """(launch, cooperative, pdl) of ``compiled``'s launcher when a prepared launch may call its
    native ``launch`` directly: the launcher is Triton's reviewed ``CudaLauncher`` and the kernel
    needs no global or profile scratch memory. ``CudaLauncher.__call__`` (reviewed, Triton 3.6.0)
    then does nothing but pass ``launch`` its grid, stream and function, its two flags, None for
    the two scratch buffers and the remaining arguments unchanged; calling ``launch`` so skips a
    Python frame, a closure and two calls a launch. None otherwise (the caller calls
    ``compiled.run``, as before)."""
    cls = _launcher_cls()
    launcher = getattr(compiled, "_run", None)
    if (not cls or type(launcher) is not cls or launcher.global_scratch_size or launcher.profile_scratch_size):
        return None
    return launcher.launch, launcher.launch_cooperative_grid, launcher.launch_pdl


def spec_key(tensors: tuple, ints: tuple) -> tuple:
    """What Triton's specialization reads from these arguments, for a ``launch_prepared`` key: each
    tensor's dtype and its pointer modulo 16 (16-byte alignment), each specialized integer's
    ``== 1``, ``% 16 == 0`` and ``>= 2**31`` (int64) (the call site leaves out integers it declared
    do_not_specialize). The one key helper of the call sites that vary only in these."""
    out = []
    for t in tensors:  # a plain loop: ~25% cheaper on the host than generator expressions
        out.append(t.dtype)
        out.append(t.data_ptr() & 15)
    for v in ints:
        out.append((v == 1, v % 16 == 0, v >= 2147483648))
    return tuple(out)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids (triton.cdiv is a constexpr_function, with Python overhead per
    call: docs/PERFORMANCE.md, "Host time per operation")."""
    return -(-a // b)


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= n (1 for n < 1), as triton.next_power_of_2 gives it for launch
    configurations, without the constexpr_function wrapper's per-call overhead (see ``cdiv``)."""
    return 1 if n < 1 else 1 << (n - 1).bit_length()
