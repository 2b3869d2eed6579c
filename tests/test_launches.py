"""solution/kernels/_launches.py: the launch wrapper, its counter and cdiv."""
import pytest
import torch
import triton
import triton.language as tl

from solution.kernels import _launches


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr, ADD: tl.constexpr = True):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=m, other=0.0).to(tl.float32)
    r = x * alpha + y if ADD else x * alpha - y
    tl.store(out_ptr + offs, r.to(out_ptr.dtype.element_ty), mask=m)


def test_counter_and_cdiv():
    _launches.reset()
    _launches.record("k")
    _launches.record("k")
    assert _launches.LAUNCHES["k"] == 2
    assert [_launches.cdiv(a, 16) for a in (0, 1, 16, 17)] == [0, 1, 1, 2]


def test_launch_runs_and_counts(device):
    _launches.reset()
    x = torch.randn(1000, device=device)
    y = torch.randn(1000, device=device)
    out = torch.empty_like(x)
    _launches.launch(_axpy_kernel, (_launches.cdiv(1000, 256),), "axpy", x, y, out, 1000, 2.0, BLOCK=256)
    torch.testing.assert_close(out, x * 2.0 + y)
    assert _launches.LAUNCHES["axpy"] == 1


def test_records_of_other_kernels_are_marked_not_ours():
    _launches.reset()
    _launches.record("torch_kernel_counted_for_a_test", ours=False)
    _launches.record("ours")
    assert _launches.LAUNCHES["torch_kernel_counted_for_a_test"] == 1
    assert "torch_kernel_counted_for_a_test" in _launches.NOT_OURS and "ours" not in _launches.NOT_OURS


# -- the direct launch (kernels/_launches.py, module docstring) ----------------------------------

class _FakeCompiled:
    function, packed_metadata = "fn-handle", "meta"

    def __init__(self, runs):
        self.runs = runs

    def run(self, *a):
        self.runs.append(a)


class _FakeKernel:
    """Stands for a JITFunction: Triton's binder (bound args, specialization, options) and
    ``kernel[grid]`` (the slow path, which returns the compiled kernel it launched)."""

    def __init__(self):
        self.pre_run_hooks, self.slow, self.runs = [], [], []
        self.device_caches = {0: ({}, {}, None, None, self._binder)}

    @staticmethod
    def _binder(x, n, BLOCK=8, **options):
        spec = [("*fp32", "D"), ("i32", "D" if n % 16 == 0 else None), ("constexpr", BLOCK)]
        return {"x": x, "n": n, "BLOCK": BLOCK}, spec, options

    def __getitem__(self, grid):
        def runner(*args, **kwargs):
            self.slow.append((grid, args, kwargs))
            return _FakeCompiled(self.runs)
        return runner


class _Hooks:
    def __init__(self):
        self.calls = []


class _Knobs:
    class runtime:
        launch_enter_hook, launch_exit_hook = _Hooks(), _Hooks()


def _fake_direct(monkeypatch):
    d = _launches._Direct(_FakeKernel, _Knobs)
    d.device, d.stream = (lambda: 0), (lambda dev: 1234)
    monkeypatch.setitem(_launches._state, "direct", d)
    monkeypatch.setattr(_launches, "_COMPILED", {})
    _launches.reset()
    return d


def test_direct_launch_takes_kernel_grid_once_per_specialization_then_the_launcher(monkeypatch):
    _fake_direct(monkeypatch)
    k = _FakeKernel()
    _launches.launch(k, (5,), "fake", "X", 32, BLOCK=8, num_warps=4)
    assert len(k.slow) == 1 and k.runs == [] and _launches.DIRECT["fake"] == 0
    _launches.launch(k, (5,), "fake", "X2", 48, BLOCK=8, num_warps=4)  # same specialization
    assert len(k.slow) == 1 and _launches.DIRECT["fake"] == 1
    # the very call JITFunction.run makes: grid padded to 3, the current stream, no hooks, every
    # bound argument (constexprs included) in the kernel's order
    assert k.runs == [(5, 1, 1, 1234, "fn-handle", "meta", None, None, None, "X2", 48, 8)]
    _launches.launch(k, (5, 2), "fake", "X", 33, BLOCK=8, num_warps=4)  # n % 16 != 0: new key
    assert len(k.slow) == 2 and len(k.runs) == 1
    _launches.launch(k, (5,), "fake", "X", 32, BLOCK=16, num_warps=4)  # another constexpr
    _launches.launch(k, (5,), "fake", "X", 32, BLOCK=8, num_warps=8)  # another option
    assert len(k.slow) == 4 and _launches.LAUNCHES["fake"] == 5 and _launches.DIRECT["fake"] == 1


def test_direct_launch_steps_aside_for_hooks_callable_grids_and_other_kernels(monkeypatch):
    d = _fake_direct(monkeypatch)
    k = _FakeKernel()
    for _ in range(2):
        _launches.launch(k, (5,), "fake", "X", 32)
    assert _launches.DIRECT["fake"] == 1
    monkeypatch.setattr(d.knobs.runtime.launch_enter_hook, "calls", [print])  # a profiler's hook
    _launches.launch(k, (5,), "fake", "X", 32)
    monkeypatch.setattr(d.knobs.runtime.launch_enter_hook, "calls", [])
    monkeypatch.setattr(d.knobs.runtime, "add_stages_inspection_hook", lambda: ("k", "h"), raising=False)
    _launches.launch(k, (5,), "fake", "X", 32)  # Triton >= 3.7 would add to the specialization
    monkeypatch.setattr(d.knobs.runtime, "add_stages_inspection_hook", None)
    k.pre_run_hooks.append(print)
    _launches.launch(k, (5,), "fake", "X", 32)
    k.pre_run_hooks.clear()
    _launches.launch(k, lambda meta: (5,), "fake", "X", 32)  # a callable grid
    assert _launches.DIRECT["fake"] == 1 and len(k.slow) == 5

    class Other(_FakeKernel):  # not the JIT class (the interpreter's kernels)
        pass
    o = Other()
    for _ in range(2):
        _launches.launch(o, (5,), "other", "X", 32)
    assert len(o.slow) == 2 and _launches.DIRECT["other"] == 0


def test_direct_launch_only_on_the_reviewed_triton(monkeypatch):
    import triton

    digest = _launches.triton_launch_digest()
    assert digest is not None  # every Triton we support has these functions
    if triton.__version__ in set(_launches.ACCEPTED_TRITON.values()):  # a reviewed version: its digest
        assert _launches.ACCEPTED_TRITON.get(digest) == triton.__version__
    monkeypatch.setattr(_launches, "ACCEPTED_TRITON", {})
    assert "not the reviewed one" in _launches.direct_reason()
    monkeypatch.setitem(_launches._state, "enabled", False)
    assert _launches.direct_reason() == "turned off"


@pytest.mark.gpu
def test_direct_launch_gives_the_same_bits_and_is_taken():
    _launches.set_direct(True)
    if _launches.direct_reason() is not None:
        pytest.skip(_launches.direct_reason())
    _launches.reset()
    for n in (1000, 1024, 1, 1000, 4099, 1024):  # specializations change (n % 16, n == 1) and return
        x = torch.randn(n, device="cuda", dtype=torch.float16)
        y = torch.randn(n, device="cuda", dtype=torch.float16)
        ref = torch.empty_like(x)
        _axpy_kernel[(_launches.cdiv(n, 256),)](x, y, ref, n, 1.5, BLOCK=256)
        for _ in range(3):
            out = torch.full_like(x, float("nan"))
            _launches.launch(_axpy_kernel, (_launches.cdiv(n, 256),), "axpy", x, y, out, n, 1.5, BLOCK=256)
            assert torch.equal(out, ref)
        out = torch.full_like(x, float("nan"))
        _launches.launch(_axpy_kernel, (_launches.cdiv(n, 256), 1, 1), "axpy", x, y, out, n, 1.5, BLOCK=256,
                         ADD=False)
        torch.testing.assert_close(out, (x.float() * 1.5 - y.float()).half())
    torch.cuda.synchronize()
    assert _launches.DIRECT["axpy"] >= 10  # all but the first launch of each specialization
    _launches.set_direct(False)
    _launches.reset()
    _launches.launch(_axpy_kernel, (4,), "axpy", x, y, out, 1024, 1.5, BLOCK=256)
    assert _launches.DIRECT["axpy"] == 0
    _launches.set_direct(True)


def test_spec_key_reads_dtype_alignment_and_the_integers_specialization(device):
    """spec_key: a tensor's dtype and pointer mod 16, an integer's == 1, % 16 == 0 and int64 range:
    what changes Triton's specialization of an argument."""
    x = torch.zeros(64, device=device)
    k = _launches.spec_key((x, x[1:]), (1, 32, 7, 2**31))
    assert k[0] == k[2] == torch.float32
    assert k[1] == x.data_ptr() & 15 and k[3] == (x.data_ptr() + 4) & 15 and k[1] != k[3]
    assert k[4:] == ((True, False, False), (False, True, False), (False, False, False), (False, True, True))
    assert _launches.spec_key((x.half(),), ()) != _launches.spec_key((x,), ())  # the dtype counts


def test_prepared_launch_runs_and_counts(device):
    """launch_prepared on the CPU interpreter (no direct path): kernel[grid] with every parameter
    positional, counted, nothing kept; the same values as launch()."""
    x = torch.randn(37, device=device)
    y = torch.randn(37, device=device)
    out = torch.empty_like(x)
    site = {}
    before = _launches.LAUNCHES["axpy-prepared"]
    _launches.launch_prepared(site, ("k",), _axpy_kernel, (1,), "axpy-prepared", (x, y, out, 37, 2.0, 64, True), {})
    assert _launches.LAUNCHES["axpy-prepared"] == before + 1
    torch.testing.assert_close(out, x * 2.0 + y)
    if device == "cpu":
        assert site == {}  # the interpreter: no compiled kernel to keep


@pytest.mark.gpu
def test_prepared_launch_gives_the_same_bits_keeps_one_kernel_per_key_and_steps_aside():
    """On the GPU: the first call of a key goes through launch() and keeps the compiled kernel,
    later calls of the key call its launcher with the caller's arguments (the same bits as
    kernel[grid]); a new key (another specialization) goes through launch() again; with the direct
    path off, or prepared launches off, every call goes through launch()."""
    _launches.set_direct(True)
    if _launches.direct_reason() is not None:
        pytest.skip(_launches.direct_reason())
    _launches.reset()
    site = {}
    for n in (1000, 1024, 1000, 1, 1024):
        x = torch.randn(n, device="cuda", dtype=torch.float16)
        y = torch.randn(n, device="cuda", dtype=torch.float16)
        ref = torch.empty_like(x)
        grid = (_launches.cdiv(n, 256),)
        _axpy_kernel[grid](x, y, ref, n, 1.5, BLOCK=256)
        key = (n % 16 == 0, n == 1)  # what decides this kernel's specialization here (n is specialized)
        for _ in range(3):
            out = torch.full_like(x, float("nan"))
            _launches.launch_prepared(site, key, _axpy_kernel, grid, "axpy-prepared", (x, y, out, n, 1.5, 256, True), {})
            assert torch.equal(out, ref)
    torch.cuda.synchronize()
    assert len(site) == 3
    assert _launches.DIRECT["axpy-prepared"] >= 12
    _launches.reset()
    _launches._state["prepared"] = False
    try:
        _launches.launch_prepared(site, (True, False), _axpy_kernel, (4,), "axpy-prepared",
                                  (x, y, out, 1024, 1.5, 256, True), {})
    finally:
        _launches._state["prepared"] = True
    assert _launches.DIRECT["axpy-prepared"] == 1  # through launch()'s own direct path
    _launches.set_direct(False)
    _launches.reset()
    _launches.launch_prepared(site, (True, False), _axpy_kernel, (4,), "axpy-prepared",
                              (x, y, out, 1024, 1.5, 256, True), {})
    assert _launches.DIRECT["axpy-prepared"] == 0
    _launches.set_direct(True)


def test_apply_sets_the_direct_launch_from_the_settings():
    import solution
    from solution.settings import Settings

    solution.revert()
    try:
        solution.apply(verbose=False, settings=Settings(direct_launch=False))
        assert _launches.direct_reason() == "turned off"
        solution.revert()
        assert _launches._state["enabled"] is True
        solution.apply(verbose=False, settings=Settings())
        assert _launches._state["enabled"] is True
    finally:
        solution.revert()


@pytest.mark.gpu
def test_prepared_launchers_of_the_node_give_the_same_bits_gpu():
    """Every launcher the decoder-layer node calls through launch_prepared, called three times on the
    same shapes (the first call through launch(), the others through the kept launcher) and once
    with prepared launches off: the same bits each time, and the prepared path taken."""
    _launches.set_direct(True)
    if _launches.direct_reason() is not None:
        pytest.skip(_launches.direct_reason())
    from solution.kernels import add_rmsnorm, fp32_add, qkv_grad, qkv_rope, rmsnorm, swiglu

    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g, device="cuda").to(dtype)

    n, h, f = 37, 256, 640
    x, r, w = rnd(n, h), rnd(n, h), rnd(h)
    y16, gy = rnd(n, h, dtype=torch.float16), rnd(n, h)
    g16, u16 = rnd(n, f, dtype=torch.float16), rnd(n, f, dtype=torch.float16)
    parts = [rnd(n, h, dtype=torch.float16) for _ in range(5)]
    masks = [rnd(n, h) > 0 for _ in range(2)]
    cos, sin = rnd(1, n, 16), rnd(1, n, 16)
    bq, lq = rnd(1, n, 4 * 16, dtype=torch.float16), rnd(1, n, 4 * 16, dtype=torch.float16)
    bk, bv, lv = (rnd(1, n, 2 * 16, dtype=torch.float16) for _ in range(3))
    dq, dk, dv = (rnd(1, n, 4, 16, dtype=torch.float16) for _ in range(3))

    def run():
        out = []
        out += rmsnorm._launch_forward(x, w, 1e-6)
        out.append(rmsnorm._launch_backward_dx(x, w, gy, out[1]))
        hh, yy, rstd = add_rmsnorm._launch_forward(r, x, w, 1e-6, (n, h))
        out += [hh, yy, rstd, *add_rmsnorm._launch_backward(hh, w, gy, gy, rstd, [torch.float32])]
        hs = swiglu.swiglu_fp16_of_fp32(g16, u16)
        dg, du = torch.empty_like(g16), torch.empty_like(u16)
        swiglu.swiglu_backward_fp16_of_fp32(hs, g16, u16, dg, du)
        out += [hs, dg, du, fp32_add.add_as_fp32(y16, x)]
        out.append(qkv_grad.qkv_grad_sum(*parts[:2], masks[0], *parts[2:], masks[1], 1, 1.25))
        out += qkv_rope.forward(bq, lq, 2.0, bk, bv, lv, 2.0, cos, sin, 4, 2, 16)
        out += [t for t in qkv_rope.backward(dq, dk, dv, cos, sin, 2.0, 0.5, 2, True) if t is not None]
        return out

    _launches._state["prepared"] = False
    try:
        ref = run()
    finally:
        _launches._state["prepared"] = True
    _launches.reset()
    for _ in range(3):
        for a, b in zip(run(), ref):
            assert torch.equal(a, b) or (a.isnan() == b.isnan()).all() and torch.equal(a[~a.isnan()], b[~b.isnan()])
    torch.cuda.synchronize()
    for name in ("_rmsnorm_fwd_kernel", "_rmsnorm_bwd_dx_kernel", "_add_rmsnorm_fwd_kernel", "_add_rmsnorm_bwd_kernel",
                 "swiglu_fwd", "swiglu_bwd", "fp32_add_kernel", "qkv_grad_sum", "qkv_rope_pad", "qkv_rope_unpad"):
        assert _launches.DIRECT[name] >= 2, (name, dict(_launches.DIRECT))


# -- the native launch of a prepared launch (kernels/_launches.py, ``raw_launcher``) ------------------

def _fake_cuda_launcher(calls, scratch=0):
    """A Triton CudaLauncher without a compiled module: its ``launch`` records what it is given."""
    from triton.backends.nvidia.driver import CudaLauncher

    launcher = object.__new__(CudaLauncher)
    launcher.launch = lambda *a: calls.append(a)
    launcher.num_ctas, launcher.global_scratch_size, launcher.global_scratch_align = 1, scratch, 8
    launcher.profile_scratch_size, launcher.profile_scratch_align = 0, 1
    launcher.launch_cooperative_grid, launcher.launch_pdl = False, True
    return launcher


def _reviewed_launcher():
    if not _launches._launcher_cls():
        import triton

        pytest.skip(f"Triton {triton.__version__}'s CudaLauncher.__call__ is not the reviewed one")


def test_raw_launcher_passes_launch_what_the_launchers_call_passes():
    """``raw_launcher``'s call gives the native launch exactly the arguments that CudaLauncher.__call__
    (this Triton's, the reviewed source) gives it; a kernel with scratch memory, or another launcher
    class, keeps ``compiled.run``."""
    _reviewed_launcher()
    calls = []
    launcher = _fake_cuda_launcher(calls)
    compiled = _FakeCompiled([])
    compiled._run = launcher
    launch, coop, pdl = _launches.raw_launcher(compiled)
    launcher(5, 1, 1, 1234, "fn-handle", "meta", None, None, None, "X", 32, 8)  # Triton's own call
    launch(5, 1, 1, 1234, "fn-handle", coop, pdl, None, None, "meta", None, None, None, "X", 32, 8)
    assert len(calls) == 2 and calls[0] == calls[1]
    assert _launches.raw_launcher(_FakeCompiled([])) is None  # no launcher of that class
    compiled._run = _fake_cuda_launcher(calls, scratch=64)
    assert _launches.raw_launcher(compiled) is None  # scratch memory: allocated by __call__


def test_prepared_launch_calls_the_native_launch_once_kept(monkeypatch):
    """A prepared launch's first call keeps the compiled kernel and its native launch; later calls of
    the key call that launch with CudaLauncher.__call__'s arguments; with ``raw`` off, compiled.run."""
    _reviewed_launcher()
    d = _fake_direct(monkeypatch)
    calls, runs = [], []
    launcher = _fake_cuda_launcher(calls)

    class Kernel(_FakeKernel):
        def __getitem__(self, grid):
            def runner(*args, **kwargs):
                self.slow.append((grid, args, kwargs))
                compiled = _FakeCompiled(runs)
                compiled._run = launcher
                return compiled
            return runner

    d.jit_cls = Kernel
    k, site = Kernel(), {}
    for x in ("X", "X2", "X3"):
        _launches.launch_prepared(site, ("key",), k, (5,), "fake", (x, 32, 8), {})
    assert len(k.slow) == 1 and runs == [] and _launches.DIRECT["fake"] == 2
    assert calls == [(5, 1, 1, 1234, "fn-handle", False, True, None, None, "meta", None, None, None, x, 32, 8)
                     for x in ("X2", "X3")]
    monkeypatch.setitem(_launches._state, "raw", False)
    _launches.launch_prepared(site, ("key",), k, (5,), "fake", ("X4", 32, 8), {})
    assert len(calls) == 2 and runs == [(5, 1, 1, 1234, "fn-handle", "meta", None, None, None, "X4", 32, 8)]
