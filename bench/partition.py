"""A GPU-bound machine on a big GPU: every CUDA stream of this process in one green context of N SMs.

    python -m bench.run_one ... --sms 16        # one run confined to 16 SMs
    python -m bench.compare --runs gpu-bound-sm16   # both variants, each in its own 16-SM partition

A green context (torch.cuda.green_contexts.GreenContext, torch >= 2.11 for its Stream()) owns a
set of the GPU's SMs; work launched on a stream made from it runs on those SMs only. Making it
the thread's current context does not confine a training run (cuBLAS sets the primary context
back; autograd's device thread never had it); streams made from it do. So enter():

1. makes the green context and one stream from it the current stream of this thread (the forward,
   the loss, the optimizer; autograd runs each backward op on its forward's stream);
2. replaces the stream constructor ``torch.cuda.Stream`` (and ``torch.cuda.streams.Stream``)
   with a subclass whose plain construction ``torch.cuda.Stream(device=...)`` hands out a stream
   of the partition: the side streams that code makes for itself (the solution's CUDA-graph
   capture stream, solution/step/cuda_graphs.py) come from the partition while solution/ knows
   nothing of it. A construction that wraps an existing stream (``stream_id=...``, as
   ``torch.cuda.current_stream()`` does) or names another device is passed to the original
   constructor. isinstance checks against ``torch.cuda.Stream`` answer as before. exit() puts
   the original constructor and the default stream back.

Whether it held is measured, not claimed (held_check): a fixed fp16 GEMM timed on every path a
training step uses - the current stream, a fresh ``torch.cuda.Stream()`` as the solution makes
one, a CUDA graph captured on such a stream and replayed on the current stream (as the solution
replays), and inside an autograd backward - against the same GEMM on the whole GPU. A path in the
partition runs near N/SMs of the whole GPU's rate; a path that escaped runs at the whole GPU's.
rates() also measures the partition's and the whole GPU's matmul TFLOP/s and copy GB/s (the
constants of bench/t4_projection.py's prediction for the partition).

Enter it after the model is loaded, not before: a model loaded and quantized (bitsandbytes)
inside the partition came out with NaN on the H200: bitsandbytes' quantize kernels run
on the legacy default stream, which the partition's non-blocking stream does not wait for.
bench/run_one.py enters at the Trainer's construction (docs/named_runs.md, point 4).

On a CPU, or a torch without green contexts or their Stream(), unsupported() says why in one line
and nothing is changed.
"""
from __future__ import annotations

import math

GEMM = 8192  # M = N = K of the check's fp16 GEMM: 1.1 TFLOP, ~1.7 ms on a whole H200
COPY_BYTES = 512 * 2**20  # the copy-rate buffer (read once, written once)
REPS = 10  # timed repetitions of each path (after one warm-up)
PATHS = ("current stream", "torch.cuda.Stream()", "CUDA graph replay", "autograd backward")


def unsupported(num_sms: int | None = None) -> str | None:
    """Why this process cannot run in an ``num_sms``-SM partition, one line without a prefix (None:
    it can). Checks CUDA, torch's green contexts and their Stream(), and 1 <= num_sms < the GPU's
    SM count."""
    import torch

    if not torch.cuda.is_available():
        return "an SM partition needs a CUDA GPU (this machine has none)"
    try:
        from torch.cuda.green_contexts import SUPPORTED, GreenContext
    except ImportError:
        return f"an SM partition needs torch >= 2.11 with green contexts (this is torch {torch.__version__})"
    if not SUPPORTED:
        return f"an SM partition needs green contexts: torch {torch.__version__} was built without them"
    if not hasattr(GreenContext, "Stream"):
        return f"an SM partition needs GreenContext.Stream() (torch >= 2.11; this is torch {torch.__version__})"
    if num_sms is not None:
        total = torch.cuda.get_device_properties(0).multi_processor_count
        if isinstance(num_sms, bool) or not isinstance(num_sms, int) or not 1 <= num_sms < total:
            return f"want a whole number of SMs from 1 to {total - 1} (this GPU has {total})"
    return None


def partition_stream_class(orig: type, make_stream, device_index, partition_device: int, made: list):
    """A subclass of the stream class ``orig`` whose plain construction returns ``make_stream()``
    (a stream of the partition) and records it in ``made``. ``device_index(device)``: the index a
    ``device`` argument names (None: the current device). A construction with keyword arguments
    (wrapping an existing stream: stream_id, device_index, device_type) or for another device is
    the original's. isinstance / issubclass against the subclass answer as against ``orig``."""

    class _Meta(type(orig)):
        def __instancecheck__(cls, obj):
            return isinstance(obj, orig)

        def __subclasscheck__(cls, sub):
            return issubclass(sub, orig)

    def __new__(cls, device=None, priority=0, **kwargs):
        if kwargs or device_index(device) != partition_device:
            return orig(device=device, priority=priority, **kwargs)
        stream = make_stream()  # priority: the partition's streams have their own
        made.append(stream)
        return stream

    return _Meta("PartitionStream", (orig,), {"__new__": __new__, "__module__": __name__,
                                              "__doc__": "torch.cuda.Stream, made in the SM partition"})


def swap_stream_class(modules, orig: type, cls: type):
    """Put ``cls`` in place of ``orig`` as ``Stream`` in each of ``modules`` that holds ``orig``
    there. Returns the function that puts ``orig`` back."""
    swapped = [m for m in modules if getattr(m, "Stream", None) is orig]
    for module in swapped:
        module.Stream = cls

    def restore():
        for module in swapped:
            module.Stream = orig
    return restore


def _nothing():
    return None


class Partition:
    """The process's CUDA streams confined to ``num_sms`` SMs of GPU ``device`` (see the module
    docstring). enter() / exit(); record() for result.json."""

    def __init__(self, num_sms: int, device: int = 0):
        self.num_sms, self.device = num_sms, device
        self.ctx = self.stream = None
        self.made: list = []  # streams handed out by the patched constructor
        self._restore = _nothing  # puts the original stream constructor back
        self._prev_stream = None
        self.figures: dict = {}

    def enter(self) -> Partition:
        import torch
        import torch.cuda.streams as streams
        from torch.cuda._utils import _get_device_index
        from torch.cuda.green_contexts import GreenContext

        torch.cuda.init()  # the primary context first (the driver's advice for green contexts)
        # the partition's stream does not wait for the default stream (a green context's streams are
        # non-blocking): whatever was queued before (the model's load) is finished first
        torch.cuda.synchronize(self.device)
        self._prev_stream = torch.cuda.current_stream(self.device)
        if self.ctx is None:  # entered again after exit(): the same green context, a new stream
            self.ctx = GreenContext.create(num_sms=self.num_sms, device_id=self.device)
        self.stream = self.ctx.Stream()
        orig = torch.cuda.Stream
        cls = partition_stream_class(orig, self.ctx.Stream, lambda d: _get_device_index(d, optional=True),
                                     self.device, self.made)
        self._restore = swap_stream_class((torch.cuda, streams), orig, cls)
        torch.cuda.set_stream(self.stream)
        return self

    @property
    def entered(self) -> bool:
        return self._prev_stream is not None

    def exit(self) -> None:
        import torch

        torch.cuda.synchronize(self.device)  # the partition's work done before the default stream goes on
        self._restore()
        self._restore = _nothing
        if self._prev_stream is not None:
            torch.cuda.set_stream(self._prev_stream)
            self._prev_stream = None

    def record(self) -> dict:
        """The partition as result.json holds it: N, the GPU's SM count, the streams the patched
        constructor handed out outside the check (the run's own side streams), and the measured
        figures (rates, held_check) when measured."""
        import torch

        return {"sms": self.num_sms, "gpu_sms": torch.cuda.get_device_properties(self.device).multi_processor_count,
                "streams_made": len(self.made), **self.figures}

    def measure(self) -> dict:
        """rates() on the whole GPU (the previous current stream) and in the partition, then
        held_check(); the check's memory is given back. Stored in self.figures."""
        import torch

        whole = rates(self._prev_stream)
        part = rates(torch.cuda.current_stream())
        before = len(self.made)
        paths = held_check()
        del self.made[before:]  # the check's own streams; self.made counts the run's
        torch.cuda.synchronize()
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:  # the check's streams' cuBLAS workspaces, never used again
            clear()
        torch.cuda.empty_cache()
        gpu_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.figures = {"rates": {"whole": whole, "partition": part},
                        "held_check": judge(paths, whole["matmul_tflops"], self.num_sms, gpu_sms)}
        return self.figures


def _events_time(stream, fn, reps: int) -> float:
    """Seconds per call of ``fn`` (its GPU work queued on ``stream``), timed by CUDA events on
    ``stream`` over ``reps`` calls after one warm-up."""
    import torch

    with torch.cuda.stream(stream):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(reps):
            fn()
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def _gemm_operands(n: int = GEMM):
    """A, B (random, from a generator of their own: the training's RNG is left alone) and an
    output C, n x n fp16 each."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(n, n, device="cuda", dtype=torch.float16, generator=gen)
    b = torch.randn(n, n, device="cuda", dtype=torch.float16, generator=gen)
    return a, b, torch.empty(n, n, device="cuda", dtype=torch.float16)


def _tflops(seconds: float, n: int = GEMM) -> float:
    return 2 * n ** 3 / seconds / 1e12


def rates(stream) -> dict:
    """fp16 GEMM TFLOP/s and device copy GB/s (bytes read + written) measured on ``stream``."""
    import torch

    a, b, c = _gemm_operands()
    gemm = _events_time(stream, lambda: torch.matmul(a, b, out=c), REPS)
    del a, b, c
    x = torch.empty(COPY_BYTES // 2, device="cuda", dtype=torch.float16)
    y = torch.empty_like(x)
    copy = _events_time(stream, lambda: y.copy_(x), REPS)
    return {"matmul_tflops": _tflops(gemm), "copy_gbs": 2 * COPY_BYTES / copy / 1e9}


def held_check() -> dict:
    """The check's GEMM timed on each of PATHS in this process's present set-up: {path: TFLOP/s}."""
    import torch

    a, b, c = _gemm_operands()
    current = torch.cuda.current_stream()
    out = {PATHS[0]: _tflops(_events_time(current, lambda: torch.matmul(a, b, out=c), REPS))}
    side = torch.cuda.Stream()  # as the solution makes its side stream
    side.wait_stream(current)
    out[PATHS[1]] = _tflops(_events_time(side, lambda: torch.matmul(a, b, out=c), REPS))
    current.wait_stream(side)
    capture = torch.cuda.Stream()
    capture.wait_stream(current)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(capture):
        torch.matmul(a, b, out=c)  # cuBLAS's lazy set-up outside the capture
        graph.capture_begin()
        torch.matmul(a, b, out=c)
        graph.capture_end()
    current.wait_stream(capture)
    out[PATHS[2]] = _tflops(_events_time(current, graph.replay, REPS))  # replayed as the solution replays
    del graph
    leaf = a.detach().requires_grad_(True)
    y = torch.matmul(leaf, b)  # forward on the current stream; its backward's GEMM, grad @ b^T, is the same size
    grad = b.flip(0)  # any n x n fp16 values; no draw from the training's RNG

    def backward():
        leaf.grad = None
        y.backward(grad, retain_graph=True)

    out[PATHS[3]] = _tflops(_events_time(current, backward, REPS))
    return out


def judge(paths: dict, whole_tflops: float, num_sms: int, gpu_sms: int) -> dict:
    """Each path's rate against the whole GPU's: its fraction of it, the fraction N/SMs that a
    partition of N SMs predicts, and held: nearer (on a log scale) to N/SMs than to the whole
    GPU. "held" overall: every path held."""
    expected = num_sms / gpu_sms
    rows = {}
    for path, tflops in paths.items():
        frac = tflops / whole_tflops
        held = abs(math.log(frac / expected)) < abs(math.log(frac))
        rows[path] = {"tflops": tflops, "fraction_of_whole": frac, "held": held}
    return {"gemm": GEMM, "whole_tflops": whole_tflops, "expected_fraction": expected, "paths": rows,
            "held": all(r["held"] for r in rows.values())}


def markdown(part: dict | None) -> list[str]:
    """The report's lines for a partition record (Partition.record() of a child)."""
    if not part or not part.get("rates"):
        return []
    whole, inside = part["rates"]["whole"], part["rates"]["partition"]
    hc = part["held_check"]
    out = [f"{part['sms']} of the GPU's {part['gpu_sms']} SMs (a green context; every CUDA stream of the run "
           f"from it: bench/partition.py; {part.get('streams_made', 0)} side streams handed out).", "",
           "| | whole GPU | partition | partition / whole |", "| --- | ---: | ---: | ---: |",
           f"| fp16 matmul TFLOP/s | {whole['matmul_tflops']:.0f} | {inside['matmul_tflops']:.1f} | "
           f"{inside['matmul_tflops'] / whole['matmul_tflops']:.3f} |",
           f"| device copy GB/s | {whole['copy_gbs']:.0f} | {inside['copy_gbs']:.0f} | "
           f"{inside['copy_gbs'] / whole['copy_gbs']:.3f} |", "",
           f"Held-check: one {hc['gemm']}^3 fp16 GEMM timed on each path a step uses; a partition of "
           f"{part['sms']}/{part['gpu_sms']} SMs predicts {hc['expected_fraction']:.3f} of the whole GPU's "
           f"{hc['whole_tflops']:.0f} TFLOP/s. **{'held on every path' if hc['held'] else 'NOT held on every path'}**.",
           "", "| path | TFLOP/s | fraction of the whole GPU | held |", "| --- | ---: | ---: | --- |"]
    for path, r in hc["paths"].items():
        out.append(f"| {path} | {r['tflops']:.1f} | {r['fraction_of_whole']:.3f} | {'yes' if r['held'] else 'NO'} |")
    return out + [""]
