"""Background precompile (solution/precompile.py): the manifest, the retargeting of an entry
recorded on another GPU, the settings, and (GPU) that recorded entries compile for this GPU."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from solution import compile_manifest, precompile
from solution.settings import Settings


def _spec(key: str, arch: str = "sm90") -> str:
    return json.dumps({"name": "k", "key": key, "options": {
        "num_warps": 8, "num_stages": 3, "arch": arch, "extern_libs": [["libdevice", "/elsewhere/libdevice.bc"]],
        "supported_fp8_dtypes": ["fp8e4nv"], "debug": False, "enable_fp_fusion": True}})


def test_manifest_round_trip_and_background_preload(tmp_path, monkeypatch):
    """A compile log's entries of our kernels go into the manifest (tagged, deduplicated, other
    packages dropped); entries_for takes this Triton's, from any architecture, once per kernel
    and JIT key; the background run preloads each retargeted, counting failures without raising."""
    log = tmp_path / "compiles.json"
    log.write_text(json.dumps({"summary": {"arch": "sm_90", "triton": "3.6.0"}, "compiles": [
        {"kernel": "solution.kernels.rmsnorm._rmsnorm_fwd_kernel", "specialization_data": _spec("a")},
        {"kernel": "solution.kernels.rmsnorm._rmsnorm_fwd_kernel", "specialization_data": _spec("a")},
        {"kernel": "solution.kernels.swiglu._swiglu_fwd_kernel", "specialization_data": "B"},
        {"kernel": "torch._inductor.something.kernel", "specialization_data": "C"},
    ]}), encoding="utf-8")
    manifest = tmp_path / "manifest.json"
    assert precompile.main(["add", str(log), "--manifest", str(manifest)]) == 0
    assert precompile.add_to_manifest(log, "sm_75", "3.6.0", manifest) == 2
    assert precompile.add_to_manifest(log, "sm_75", "3.2.0", manifest) == 2
    entries = precompile.load_manifest(manifest)
    assert len(entries) == 6 and {e["arch"] for e in entries} == {"sm_90", "sm_75"}
    here = precompile.entries_for(entries, "3.6.0")  # the sm_75 copies of the same keys are dropped
    assert [e["specialization_data"] for e in here] == [_spec("a"), "B"]
    assert [e["arch"] for e in here] == ["sm_90", "sm_90"]
    assert len(precompile.entries_for(entries, "3.2.0")) == 2
    # no record of 3.9.0 or 3.4.0: those of 3.6.0, the same record format; none for 3.3.1 (another one)
    assert precompile.entries_for(entries, "3.9.0") == here == precompile.entries_for(entries, "3.4.0")
    assert precompile.entries_for(entries, "3.3.1") == [] and precompile.entries_for(entries, "4.0.0") == []
    # --replace: a complete run's record replaces its architecture and version; the others stay
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"compiles": [{"kernel": "solution.kernels.swiglu._swiglu_fwd_kernel",
                                               "specialization_data": "B"}]}), encoding="utf-8")
    assert precompile.main(["add", str(short), "--arch", "sm_75", "--triton", "3.6.0", "--replace",
                            "--manifest", str(manifest)]) == 0
    after = precompile.load_manifest(manifest)
    assert [e["specialization_data"] for e in after if (e["arch"], e["triton"]) == ("sm_75", "3.6.0")] == ["B"]
    assert len(after) == 5  # sm_90 3.6.0's two and sm_75 3.2.0's two untouched

    assert precompile.resolve_kernel("torch.nn.functional.linear") is None
    assert precompile.resolve_kernel("solution.kernels.rmsnorm.no_such_kernel") is None
    calls = []

    class FakeKernel:
        def preload(self, data):
            calls.append(data)
            if data == "B":
                raise RuntimeError("recorded for another machine")

    monkeypatch.setattr(precompile, "resolve_kernel", lambda path: FakeKernel())
    monkeypatch.setattr(precompile, "_running_target", lambda: None)  # no GPU: no target to set
    monkeypatch.setattr(precompile, "STATE", {"started": True, "entries": 2, "done": 0, "failed": 0,
                                              "seconds": None, "errors": []})
    precompile.run(here)
    assert calls == [precompile.retarget(_spec("a")), "B"]
    assert precompile.STATE["done"] == 1 and precompile.STATE["failed"] == 1
    assert "another machine" in precompile.STATE["errors"][0]

    (tmp_path / "bad.json").write_text("{}", encoding="utf-8")
    with pytest.raises(ValueError, match="not a compile manifest"):
        precompile.load_manifest(tmp_path / "bad.json")


def test_retarget_keeps_only_the_launch_options():
    """The recording machine's architecture, fp8 types and libdevice path go; what a launch sets
    stays; the key (device-independent) and everything else of the record are unchanged."""
    out = json.loads(precompile.retarget(_spec("the-key")))
    assert out["options"] == {"num_warps": 8, "num_stages": 3, "debug": False, "enable_fp_fusion": True}
    assert out["key"] == "the-key" and out["name"] == "k"
    assert precompile.retarget("not json") == "not json"
    target = {"backend": "cuda", "arch": 75, "warp_size": 32}  # Triton >= 3.7's preload checks it
    assert json.loads(precompile.retarget(_spec("k"), target))["target"] == target
    # every entry of the shipped manifest retargets to launch options only
    for e in precompile.load_manifest(precompile.MANIFEST):
        opts = json.loads(precompile.retarget(e["specialization_data"]))["options"]
        assert set(opts) <= set(precompile.LAUNCH_OPTIONS) and "num_warps" in opts


def test_version_order_and_record_format():
    assert compile_manifest._version_tuple("3.9.0") == (3, 9, 0) and compile_manifest._version_tuple("3.10.1+git") == (3, 10, 1)
    assert compile_manifest._version_tuple("nightly") == () and compile_manifest._version_tuple("3.9.0rc1") == (3, 9, 0)
    assert precompile.same_record_format("3.6.0", "3.9.0") and precompile.same_record_format("3.4.0", "3.8.0")
    assert not precompile.same_record_format("3.6.0", "3.3.1") and not precompile.same_record_format("3.6.0", "3.10.0")


def test_on_by_default_on_cuda_only_and_settings_checked(monkeypatch):
    said = []
    monkeypatch.delenv(precompile.ENV, raising=False)
    assert precompile.requested()
    assert Settings.from_env().precompile
    assert precompile.start("interpreter", say=said.append) is None and said == []  # no GPU: nothing to say
    monkeypatch.setenv(precompile.ENV, "0")
    assert not precompile.requested()
    assert precompile.start("cuda", say=said.append) is None and said == []
    monkeypatch.setenv(precompile.ENV, "sometimes")
    with pytest.raises(ValueError, match="SOLUTION_PRECOMPILE"):
        Settings.from_env()


def test_apply_refuses_a_bad_precompile_setting_before_installing(monkeypatch):
    import solution

    solution.revert()
    monkeypatch.setenv(precompile.ENV, "maybe")
    with pytest.raises(ValueError, match="SOLUTION_PRECOMPILE"):
        solution.apply(verbose=False)
    assert solution.installed() == {}


@pytest.mark.gpu
def test_recorded_entries_compile_for_this_gpu(device):
    """Every entry recorded with this Triton (on whatever GPU) compiles here once retargeted, and
    lands in the JIT's cache under its recorded key: a launch with that specialization compiles
    nothing more."""
    if device != "cuda":
        pytest.skip("needs a CUDA GPU")
    import triton

    entries = precompile.entries_for(precompile.load_manifest(precompile.MANIFEST), triton.__version__)
    if not entries:
        pytest.skip(f"no recorded entries for Triton {triton.__version__}")
    import os
    import tempfile

    import torch

    major, minor = torch.cuda.get_device_capability()
    with tempfile.TemporaryDirectory() as cache:
        old = os.environ.get("TRITON_CACHE_DIR")
        os.environ["TRITON_CACHE_DIR"] = cache
        try:
            # the child processes compile for this GPU into the disk cache ...
            assert precompile._wait_workers(*precompile._start_workers(entries, ("cuda", major * 10 + minor, 32), workers=2)) == len(entries)
            # kernel binaries and their IR (not the C launchers and driver module, built at first launch)
            before = sorted(p.name for p in Path(cache).rglob("*") if p.is_file() and p.suffix != ".so")
            for e in entries:  # ... and the JIT's own preload here finds every binary there (no new file)
                fn = precompile.resolve_kernel(e["kernel"])
                assert fn is not None, e["kernel"]
                fn.preload(precompile.retarget(e["specialization_data"]))
                key = json.loads(e["specialization_data"])["key"]
                caches = getattr(fn, "device_caches", None)
                if caches is not None:  # Triton >= 3.3: {device: (kernel_cache, ...)}
                    assert any(key in c[0] for c in caches.values()), e["kernel"]
            after = sorted(p.name for p in Path(cache).rglob("*") if p.is_file() and p.suffix != ".so")
            assert after == before, "the JIT compiled something the child processes had not"
        finally:
            if old is None:
                os.environ.pop("TRITON_CACHE_DIR")
            else:
                os.environ["TRITON_CACHE_DIR"] = old


def test_compile_processes_fill_the_disk_cache_without_a_gpu(tmp_path, monkeypatch):
    """The background precompile's child processes compile recorded entries (here: two of the
    shipped manifest's sm_90 records) for another GPU (a T4, sm_75) into Triton's disk cache with
    no GPU at all, as ``python -m solution.precompile compile`` does."""
    entries = precompile.load_manifest(precompile.MANIFEST)[:2]
    if not entries:
        pytest.skip("the shipped manifest is empty")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    # a stale record too, one of a kernel that has since lost a constexpr: not compiled, not raised
    # (the kernel then compiles at its first launch)
    stale = json.loads(entries[0]["specialization_data"])
    stale["signature"]["REMOVED_FLAG"] = "constexpr"
    stale["constant_keys"].append([len(stale["signature"]) - 1])
    stale["constant_vals"].append(True)
    entries.append({**entries[0], "specialization_data": json.dumps(stale)})
    assert precompile._wait_workers(*precompile._start_workers(entries, ("cuda", 75, 32), workers=2)) == 2
    cubins = list((tmp_path / "cache").rglob("*.cubin"))
    assert len(cubins) == 2


# Run without the interpreter (where resolve_kernel finds no JIT function): for each shipped
# record of this Triton version, the JIT cache key a launch of the kernel as it is now computes
# (Triton's own binder, for the CUDA backend, on arguments of the recorded kinds) next to the
# recorded key. A record whose kernel changed its parameters since it was recorded differs.
_KEY_CHECK = r"""
import ast, json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import compute_cache_key, create_function_from_signature
from solution import precompile

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "u8": torch.uint8,
          "i8": torch.int8, "i32": torch.int32, "i64": torch.int64, "u1": torch.bool, "i1": torch.bool}
backend = make_backend(GPUTarget("cuda", 90, 32))
out = []
for e in precompile.load_manifest(precompile.MANIFEST):
    if e["triton"] != triton.__version__:
        continue
    d = json.loads(e["specialization_data"])
    fn = precompile.resolve_kernel(e["kernel"])
    if fn is None or list(d["signature"]) != fn.arg_names:
        out.append((e["kernel"], "parameters differ"))
        continue
    cut = d["key"].index("]{")
    kinds, launch_opts = ast.literal_eval(d["key"][:cut + 1]), ast.literal_eval(d["key"][cut + 1:])
    args = []
    for ty, spec in kinds:
        if ty == "constexpr":
            args.append(spec)
        elif ty.startswith("*"):  # a 16-byte aligned tensor of that dtype
            args.append(torch.empty(64, dtype=DTYPES[ty[1:]]))
        else:  # an int divisible by 16 ("D"), another int, or a float / unspecialized value
            args.append(1024 if spec == "D" else 1001 if ty.startswith("i") else 1.5)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    _, specialization, options = binder(*args, **launch_opts)
    key = compute_cache_key({}, specialization, options)
    if key != d["key"]:
        out.append((e["kernel"], key))
print(json.dumps(out))
"""


def test_shipped_records_match_the_kernels_as_they_are():
    """A record keeps the parameters its kernel had when it was recorded: when a kernel loses or
    gains one, its records must be re-recorded or edited (the JIT key of a record is Triton's
    launch key, recomputed here without a GPU), else the background precompile compiles something
    no launch asks for."""
    import os
    import subprocess
    import sys

    import triton

    if not any(e["triton"] == triton.__version__ for e in precompile.load_manifest(precompile.MANIFEST)):
        pytest.skip(f"no shipped record of Triton {triton.__version__}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _KEY_CHECK], env=env, capture_output=True, text=True,
                          timeout=300, cwd=str(Path(__file__).resolve().parent.parent))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


# Prints {kernel: JITFunction.cache_key} for every shipped record's kernel, and whether torch was a stand-in. The
# disk cache's key of a compile is that cache_key with the record's own data (signature, constexprs, options) and
# Triton's and the backend's keys: equal cache_keys mean the compile process's entries are the ones training
# looks up.
_CACHE_KEYS = r"""
import json, sys
from solution import precompile
if sys.argv[1] == "stand-in":
    assert precompile.install_torch_stand_in()
keys = {}
for e in precompile.load_manifest(precompile.MANIFEST):
    fn = precompile.resolve_kernel(e["kernel"])
    keys[e["kernel"]] = None if fn is None else fn.cache_key
print(json.dumps({"stand_in": isinstance(sys.modules["torch"], precompile._StandInModule), "keys": keys}))
"""


def test_a_compile_process_needs_no_torch_and_gets_the_same_cache_keys():
    """A compile process imports a stand-in for torch (``install_torch_stand_in``: its import is ~40% of the
    process's time), so it must see each kernel exactly as the training process does: the same source and
    constexpr globals, hence the same disk-cache entries. A kernel that came to depend on torch at import
    (a constexpr global computed with torch) fails here."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = {}
    for mode in ("stand-in", "torch"):
        proc = subprocess.run([sys.executable, "-c", _CACHE_KEYS, mode], env=env, capture_output=True, text=True,
                              timeout=300, cwd=str(Path(__file__).resolve().parent.parent))
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["stand-in"]["stand_in"] and not out["torch"]["stand_in"]
    keys = out["torch"]["keys"]
    assert keys and None not in keys.values()
    assert out["stand-in"]["keys"] == keys


def test_the_torch_stand_in_stands_for_what_the_kernel_modules_use():
    """Attributes, calls, items, subclasses and submodule imports of the stand-in give stand-ins; dunder
    lookups fail as on an ordinary object; an imported torch is never replaced."""
    import subprocess
    import sys

    code = """
import sys
from solution import precompile
assert precompile.install_torch_stand_in()
import torch, torch.nn.functional as F
from torch.autograd import Function
class Node(torch.autograd.Function):
    pass
@torch.no_grad()
def f():
    pass
assert isinstance(Node(), object) and repr(F.silu) == "<stand-in torch.nn.functional.silu>"
assert repr(torch._C.DisableTorchFunctionSubclass) == "<stand-in torch._C.DisableTorchFunctionSubclass>"
assert not hasattr(torch.float16, "__deepcopy__") and repr(torch.empty(3)[0]).startswith("<stand-in")
assert not precompile.install_torch_stand_in()  # once torch is in sys.modules, never again
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=str(Path(__file__).resolve().parent.parent))
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_worker_count_leaves_a_core_for_soup(monkeypatch):
    """One compile process per core this process may use (its affinity), less one, at most 4."""
    import os

    monkeypatch.setattr(precompile, "cpu_quota", lambda: None)  # this machine's own quota, if any, left out

    def cores(n):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)), raising=False)

    cores(16)
    assert precompile.worker_count(23) == precompile.MAX_WORKERS and precompile.worker_count(2) == 2
    cores(2)
    assert precompile.worker_count(23) == 1
    cores(1)
    assert precompile.worker_count(23) == 0  # one core: the thread compiles in this process


def test_worker_count_keeps_to_a_containers_cpu_quota(monkeypatch, tmp_path):
    """A cgroup CPU quota caps the cores (v2 cpu.max, else v1 cfs quota / period); no quota or an
    unreadable one leaves the affinity's count."""
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    v2, v1 = tmp_path / "cpu.max", tmp_path / "v1"
    monkeypatch.setattr(precompile, "CGROUP_V2_CPU_MAX", str(v2))
    monkeypatch.setattr(precompile, "CGROUP_V1_CPU", str(v1))
    assert precompile.cpu_quota() is None and precompile.worker_count(23) == precompile.MAX_WORKERS
    v2.write_text("250000 100000\n")  # 2.5 CPUs: 3 cores, 2 compile processes
    assert precompile.cpu_quota() == 3 and precompile.worker_count(23) == 2
    v2.write_text("max 100000\n")
    assert precompile.cpu_quota() is None
    v2.unlink()
    v1.mkdir()
    (v1 / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert precompile.cpu_quota() == 2 and precompile.worker_count(23) == 1
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert precompile.cpu_quota() is None
    (v1 / "cpu.cfs_quota_us").write_text("garbage\n")
    assert precompile.cpu_quota() is None


@pytest.mark.parametrize("name", ["SOLUTION_PRECOMPILE"])
def test_on_off_settings_share_one_parser(monkeypatch, name):
    """Every on/off setting reads 1/true/on/yes and 0/false/off/no (any case) the same way, and
    apply() refuses anything else before installing (no spelling of "off" reads as on)."""
    import solution
    from solution.settings import FLAGS

    field, default = FLAGS[name]

    def flag() -> bool:
        return getattr(Settings.from_env(), field)

    monkeypatch.delenv(name, raising=False)
    assert flag() is default is getattr(Settings(), field)
    for value, expected in (("false", False), ("OFF", False), ("no", False), ("0", False),
                            ("True", True), ("on", True), ("yes", True), ("1", True), ("", default)):
        monkeypatch.setenv(name, value)
        assert flag() is expected, value
    monkeypatch.setenv(name, "maybe")
    solution.revert()
    with pytest.raises(ValueError, match=name):
        solution.apply(verbose=False)
    assert solution.installed() == {}


def test_contended_counts_only_the_in_process_preload(monkeypatch):
    """A probe sample is void only if the in-process preload (GIL) ran during it: not while only
    the compile processes (a core each) run, nor after the preload finished before the sample."""
    class Alive:
        def is_alive(self):
            return True

    monkeypatch.setattr(precompile, "_thread", None)
    assert precompile.contended(0.0) is False  # nothing started
    monkeypatch.setattr(precompile, "_thread", Alive())
    monkeypatch.setattr(precompile, "STATE", {"preload_started_t": None, "finished_t": None})
    assert precompile.contended(5.0) is False  # the compile processes only
    precompile.STATE["preload_started_t"] = 10.0
    assert precompile.contended(5.0) is True and precompile.contended(20.0) is True  # preloading now
    precompile.STATE["finished_t"] = 12.0
    assert precompile.contended(11.0) is True  # it ended during the sample
    assert precompile.contended(12.5) is False  # it ended before the sample began


# ---- bounded waits: a hung compile must not hang training ----

@pytest.fixture
def fresh_precompile(monkeypatch):
    """The precompile's module state as start() leaves it, with short limits, the lines it says
    collected in the returned list, and no thread yet."""
    import threading

    said: list[str] = []
    monkeypatch.setattr(precompile, "STATE", {"started": True, "entries": 2, "done": 0, "failed": 0, "seconds": None,
                                              "errors": [], "started_t": None, "finished_t": None, "workers": 0,
                                              "worker_compiled": None, "worker_seconds": None,
                                              "preload_started_t": None, "stopped": None, "stopped_t": None})
    monkeypatch.setattr(precompile, "_stop", threading.Event())
    monkeypatch.setattr(precompile, "_procs", [])
    monkeypatch.setattr(precompile, "_say", said.append)
    monkeypatch.setattr(precompile, "_thread", None)
    monkeypatch.setattr(precompile, "_running_target", lambda: None)
    monkeypatch.setattr(precompile, "LIMIT_S", 1.5)
    monkeypatch.setattr(precompile, "KILL_GRACE_S", 0.5)
    return said


class _PreloadLog:
    """A stand-in JIT kernel: records each preload; ``block`` (a threading.Event) makes every
    preload wait until it is set, like a compile that never returns."""

    def __init__(self, block=None):
        self.calls, self.block = [], block

    def preload(self, data):
        self.calls.append(data)
        if self.block is not None:
            self.block.wait()


_ENTRIES = [{"kernel": f"solution.kernels.fake.k{i}", "specialization_data": f"spec-{i}"} for i in range(2)]


def test_a_compile_process_that_never_returns_is_ended(fresh_precompile, monkeypatch):
    """Compile processes that never exit (one of them ignoring SIGTERM) are ended at LIMIT_S, the
    second after KILL_GRACE_S by SIGKILL; the thread then preloads nothing (the kernels compile at
    first launch), finishes, and one line says why."""
    import signal
    import sys
    import time

    sleepers = [[sys.executable, "-c", "import time; time.sleep(3600)"],
                [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                       "time.sleep(3600)"]]
    monkeypatch.setattr(precompile, "_worker_command", lambda *a: sleepers.pop(0))
    started = []
    real_start = precompile._start_workers
    monkeypatch.setattr(precompile, "_start_workers", lambda *a: started.append(real_start(*a)) or started[-1])
    kernel = _PreloadLog()
    monkeypatch.setattr(precompile, "resolve_kernel", lambda path: kernel)
    t0 = time.perf_counter()
    precompile.run(_ENTRIES, target=("cuda", 75, 32), workers=2)
    elapsed = time.perf_counter() - t0
    assert precompile.LIMIT_S <= elapsed < precompile.LIMIT_S + 3 * precompile.KILL_GRACE_S + 5
    (_, procs), = started
    codes = [proc.returncode for proc, _ in procs]
    assert codes == [-signal.SIGTERM, -signal.SIGKILL]
    assert kernel.calls == [] and precompile.STATE["finished_t"] is not None
    assert "compile processes were still running" in precompile.STATE["stopped"]
    assert len(fresh_precompile) == 1 and fresh_precompile[0].startswith("precompile stopped: ")
    assert "compile at their first launch" in fresh_precompile[0]
    assert precompile._procs == []


def test_a_precompile_that_never_finishes_is_not_waited_out(fresh_precompile, monkeypatch):
    """A preload stuck in a compile: wait() without a timeout returns at LIMIT_S (plus the kill
    grace), gives the precompile up (said once), after which it is no longer ``running`` nor
    ``contended``, and the thread, once its compile returns, starts no other. A wait with a
    timeout only waits."""
    import threading
    import time

    block = threading.Event()
    kernel = _PreloadLog(block)
    monkeypatch.setattr(precompile, "resolve_kernel", lambda path: kernel)
    thread = threading.Thread(target=precompile.run, args=(_ENTRIES,), daemon=True)
    monkeypatch.setattr(precompile, "_thread", thread)
    thread.start()
    try:
        t0 = time.perf_counter()
        st = precompile.wait(timeout=0.1)
        assert st["stopped"] is None and precompile.running() and time.perf_counter() - t0 < 1.0
        st = precompile.wait()
        elapsed = time.perf_counter() - t0
        assert precompile.LIMIT_S - 0.2 <= elapsed < precompile.LIMIT_S + precompile.KILL_GRACE_S + 2
        assert "had not finished" in st["stopped"] and thread.is_alive() and not precompile.running()
        assert not precompile.contended(time.perf_counter())
        assert fresh_precompile == [fresh_precompile[0]] and fresh_precompile[0].startswith("precompile stopped: ")
        precompile.wait()  # given up already: no second line
        assert len(fresh_precompile) == 1
    finally:
        block.set()
    thread.join(5)
    assert not thread.is_alive() and kernel.calls == ["spec-0"]  # the second entry never started


def test_the_first_capture_goes_on_when_the_precompile_hangs(fresh_precompile, monkeypatch):
    """The step's one unbounded-looking wait (the first capture calls ``precompile.wait()``) is
    bounded: with a precompile that never finishes, the graphs' forward still returns, and the
    line says why. The GPU parts (the graph runner) are stand-ins: this is about the wait."""
    import threading
    import time

    import torch

    from solution.step import cuda_graphs, graph_decision

    stuck = threading.Event()
    thread = threading.Thread(target=stuck.wait, daemon=True)  # a preload that never returns
    monkeypatch.setattr(precompile, "_thread", thread)
    precompile.STATE["started_t"] = time.perf_counter()
    thread.start()

    class Runner:
        def __init__(self, device):
            pass

        def forward(self, model, layers, input_ids, info, dropouts):
            return "replayed"

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
            self.config = type("Config", (), {"num_hidden_layers": 1})()

    monkeypatch.setattr(cuda_graphs, "refusal", lambda *a, **k: None)
    monkeypatch.setattr(cuda_graphs, "mode", lambda: "1")
    monkeypatch.setattr(cuda_graphs, "DecoderGraphs", Runner)
    try:
        t0 = time.perf_counter()
        out = cuda_graphs.decoder_forward(Model(), torch.zeros(1, 4, dtype=torch.long), None, {})
        assert out == "replayed" and time.perf_counter() - t0 < precompile.LIMIT_S + precompile.KILL_GRACE_S + 2
        assert len(fresh_precompile) == 1 and "had not finished" in fresh_precompile[0]
        assert graph_decision.settle_precompile(timeout=60.0) == 0.0  # given up: a probe sample does not wait for it
    finally:
        stuck.set()
        thread.join(5)
