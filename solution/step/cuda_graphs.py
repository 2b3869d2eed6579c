"""CUDA graphs over the decoder layers ($SOLUTION_CUDA_GRAPHS; design and measurements: docs/cuda_graphs.md).

1-3. Per bucket of packed token counts the layers' forward and backward are recorded once in two CUDA graphs
   and replayed: two host calls a step instead of ~40 launches a layer each way. Fixed per bucket: N, padded
   by one filler row (``bucketed_tokens``); attention's ``row_bound``. Before each replay: cu_seqlens copied
   in, the LoRA dropout masks drawn with stock's calls (graph_buffers.MaskSlots.draw). Buffers and one memory
   pool are shared by every bucket (graph_buffers.Arena). Everything outside the layers stays eager.
4. Correctness risks. (a) Host values captured once: only the token count and the row bound, fixed per bucket.
   (b) Random numbers: the graphs draw nothing (checked: masks taken, generator offset around the first replay).
   (c) Module hooks would run only at capture: such a model stays eager. (d) Values: the filler changes every
   matmul's token dimension, so cuBLAS may pick other tile orders: results agree with the eager run to fp16
   rounding, not bit for bit (the filler's contribution to every weight gradient is exactly zero).
   (e) Memory: max_memory_allocated does not count the graph pool during replays: compare peak reserved.
   (f) One capture per bucket, about one eager step each.
"""
from __future__ import annotations

import contextlib
import time
import weakref

import torch
from torch.autograd.function import once_differentiable

from solution import precompile, settings, state
from solution.hooks import global_hooks, own_hooks
from solution.say import say, say_once
from solution.settings import CUDA_GRAPHS_ENV
from solution.step import attention, graph_buffers, graph_decision, lengths, packing
from solution.step import layer as layer_node

MAX_GRAPHS = 64  # captured buckets per model; beyond it new sizes run eagerly
# torch's context that turns tensor subclasses' __torch_function__ off (torch >= 2.0; a no-op where absent)
_NO_SUBCLASS_TORCH_FUNCTION = getattr(torch._C, "DisableTorchFunctionSubclass", contextlib.nullcontext)
# torch's private multi-tensor copy (one launch for all captured gradient copies; docs/GATES.md), else copy_ each
_FOREACH_COPY = getattr(torch, "_foreach_copy_", None)


def mode() -> str:
    """$SOLUTION_CUDA_GRAPHS: "auto" (where the eager step is measured host-bound: graph_decision.py), "1", "0"."""
    return settings.current().cuda_graphs


def enabled() -> bool:
    """Graphs may be used ($SOLUTION_CUDA_GRAPHS is not 0; in "auto" mode once graph_decision.py says so)."""
    return mode() != "0"


def bucket_size() -> int:
    """$SOLUTION_GRAPH_BUCKET (tokens, default 256)."""
    return settings.current().graph_bucket


def row_bound(tokens: int, longest: int, cap: int | None) -> int:
    """Attention's row bound for a bucket of ``tokens`` whose longest row (filler included) is ``longest``:
    ``cap`` (DecoderGraphs.row_cap) where it holds, else the bucket size (always a bound). Pure."""
    if cap is None or longest > cap:
        return tokens
    return min(tokens, cap)


def bucketed_tokens(n: int, bucket: int) -> int:
    """The bucket for n packed tokens: the next multiple of ``bucket`` above n (always one filler row or more)."""
    return (n // bucket + 1) * bucket


class _LayerGraphs:
    """The forward and backward graphs of one bucket, and the views of the arena they use."""

    def __init__(self, arena: graph_buffers.Arena, n: int, rows: int, needs_input_grad: bool, device, bound: int):
        self.arena, self.n, self.needs_input_grad = arena, n, needs_input_grad
        self.bound = bound  # attention's row bound (``row_bound``)
        self.h, self.out = arena.h[:, :n], arena.out[:, :n]
        self.grad_out, self.grad_h = arena.grad_out[:, :n], arena.grad_h[:, :n]
        self.cos, self.sin, self.pos = arena.cos[:, :n], arena.sin[:, :n], arena.pos[:, :n]
        self.cu_seqlens = torch.zeros(rows + 1, dtype=torch.int32, device=device)
        self.arange = torch.arange(n, device=device)
        self.fwd, self.bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        self.param_grads: graph_buffers.GradBuffers | None = None  # the runner's buffers, shared by its graphs
        self.has_grad: list[bool] = []
        self.rng_checked = False

    def info(self, capture: packing.Unpadded) -> packing.Unpadded:
        """The Unpadded the captured layers see: this graph's buffers and row bound."""
        return packing.Unpadded(idx=self.arange, positions=self.pos[0], batch=capture.batch, seqlen=capture.seqlen,
                                lengths=capture.lengths, cu_seqlens=self.cu_seqlens, max_len_bound=self.bound)

    def load(self, info: packing.Unpadded, h, cos, sin) -> None:
        """This step's inputs into the graph's buffers (h's values; its autograd edge stays with the replay)."""
        with torch.no_grad():
            self.h.copy_(h)
            self.cos.copy_(cos)
            self.sin.copy_(sin)
            self.pos[0].copy_(info.positions)
            self.cu_seqlens.copy_(info.cu_seqlens)


class _ReplayDecoderLayers(torch.autograd.Function):
    """The decoder layers as one autograd node: forward replays the forward graph; backward copies the
    gradient in, replays the backward graph and hands out copies (the next replay overwrites its buffers)."""

    @staticmethod
    def forward(ctx, graphs: _LayerGraphs, h, *params):
        gen = _cuda_generator(h.device) if not graphs.rng_checked else None
        before = gen.get_offset() if gen is not None else None
        graphs.fwd.replay()
        if gen is not None:
            graphs.rng_checked = True
            if gen.get_offset() != before:
                raise RuntimeError("the decoder-layer CUDA graph consumed random numbers: its dropout would "
                                   "differ from stock's; set SOLUTION_CUDA_GRAPHS=0")
        ctx.graphs = graphs
        return graphs.out.detach()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        g = ctx.graphs
        g.grad_out.copy_(grad_out)
        g.bwd.replay()
        grad_h = g.grad_h.clone() if g.needs_input_grad else None
        grads = g.param_grads.copies(g.has_grad)
        return (None, grad_h, *grads)


def _cuda_generator(device: torch.device):
    try:
        gen = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
        gen.get_offset()
        return gen
    except Exception:  # noqa: BLE001 - a torch without get_offset: the take count still checks
        return None


def _describe_failure(exc: BaseException) -> str:
    """One line for a failed capture: the exception and, when it differs, the first of its chain (an
    invalidated capture fails again at capture_end; the first, naming the operation, is its ``__context__``)."""
    def line(e: BaseException) -> str:
        return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"

    first = exc
    while first.__context__ is not None and first.__context__ is not first:
        first = first.__context__
    return line(exc) if first is exc else f"{line(exc)}; first: {line(first)}"


def _release_capture_state(device: torch.device) -> None:
    """After a failed capture, give the CUDA generator a clone of its state (same seed and offset, not
    capturing): capture_end releases the state only after a successful capture, and a state still
    "capturing" fails every later eager draw ("Offset increment outside graph capture ...")."""
    gen = _cuda_generator(device)
    if gen is None:
        return
    try:
        gen.graphsafe_set_state(gen.clone_state())
    except Exception as exc:  # noqa: BLE001 - a torch without these: say it, the draws will tell
        say(f"could not reset the CUDA generator after the failed capture ({type(exc).__name__}: {exc})")


def run_layers(layers, h, info, cos, sin):
    """Every layer through the decoder-layer node; raises where the node does not take them all (eager)."""
    node = layer_node.step_context(cos, sin, info, h, packing.dropout_mask_source())
    plans = layer_node.plans(layers, h, node)
    if plans is None:
        raise RuntimeError("the decoder-layer node does not take every layer of this step")
    x = h
    for layer, plan in zip(layers, plans):
        x = layer_node.run_layer(layer, plan, x, node)
    return x


class Scan:
    """What ``_scan`` finds: any module hook in or around the layers, the LoRA dropouts with p > 0 in
    training mode (the masks one forward takes), the trainable parameters in ``Module.parameters()`` order."""

    __slots__ = ("hooked", "dropouts", "params")

    def __init__(self, hooked: bool, dropouts: int, params: list):
        self.hooked, self.dropouts, self.params = hooked, dropouts, params


def _scan(layers) -> Scan:
    """One pass over the layers' modules' own dicts, every step, visiting what ``layer.modules()`` and
    ``layer.parameters()`` would, in their order (docs/cuda_graphs.md, "Host work per step")."""
    try:
        from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit
    except Exception:  # noqa: BLE001 - peft / bnb absent: no LoRA layer of that kind
        LoraLinear4bit = ()
    dropout_cls = torch.nn.Dropout
    hooked, dropouts, params = global_hooks(), 0, []
    seen_modules: set = set()
    seen_params: set = set()
    stack = [(layer, False) for layer in reversed(list(layers))]  # (module, inside a LoRA layer's lora_dropout)
    # bitsandbytes' Params4bit routes every attribute read through __torch_function__ (~2.5 us for
    # requires_grad; 196 weights): read the flags with subclass overrides off (nothing is computed here)
    with _NO_SUBCLASS_TORCH_FUNCTION():
        while stack:
            m, in_dropout = stack.pop()
            if id(m) in seen_modules:
                continue
            seen_modules.add(id(m))
            d = m.__dict__
            if not hooked and (own_hooks(m) or "forward" in d):  # a hook or a forward set on the instance
                hooked = True
            if in_dropout and isinstance(m, dropout_cls) and m.training and m.p > 0:
                dropouts += 1
            for p in d["_parameters"].values():
                if p is not None and p.requires_grad and id(p) not in seen_params:
                    seen_params.add(id(p))
                    params.append(p)
            children = d["_modules"]
            if children:
                lora_dropout = children.get("lora_dropout") if LoraLinear4bit and isinstance(m, LoraLinear4bit) else None
                stack.extend((c, in_dropout or c is lora_dropout) for c in reversed(children.values()) if c is not None)
    return Scan(hooked, dropouts, params)


class DecoderGraphs:
    """The graphs of one Qwen2Model (created on its first packed training forward)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device=device)
        self.graphs: dict[tuple, _LayerGraphs] = {}
        self.arena: graph_buffers.Arena | None = None
        self.params: list[torch.nn.Parameter] | None = None
        self.grads: graph_buffers.GradBuffers | None = None
        self.warmed = False
        self.failed: str | None = None
        self.full_said = False
        self.ahead: list[int] | None = None  # buckets to capture ahead (lengths.py), set at the first step
        # the run's longest row (``row_bound``; set with ``ahead``), None where unknown (the bucket is the bound)
        self.row_cap: int | None = None

    # -- parameters ---------------------------------------------------------------------------
    def _trainable(self, params: list) -> list[torch.nn.Parameter]:
        """The layers' trainable parameters this step (``_scan``'s), the graphs dropped when they changed."""
        if self.params is None or len(params) != len(self.params) or any(a is not b for a, b in zip(params, self.params)):
            self.params, self.graphs, self.grads = params, {}, graph_buffers.GradBuffers(params)
        return params

    # -- capture ------------------------------------------------------------------------------
    def _graphs_for(self, layers, binfo, h, cos, sin, dropouts: int, ahead: bool = False) -> _LayerGraphs | None:
        n = h.shape[1]
        autocast = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        # a real batch's rows (filler included) are checked; a bucket captured ahead has stand-in rows
        bound = row_bound(n, 0 if ahead else max(binfo.lengths), self.row_cap)
        # dropouts: the LoRA dropouts active now (a dropout put in eval mode changes what the layers do)
        key = (n, bound, binfo.batch, len(binfo.lengths), h.dtype, cos.dtype, h.requires_grad, autocast, dropouts)
        g = self.graphs.get(key)
        if g is not None:
            return g
        if len(self.graphs) >= MAX_GRAPHS:
            if not self.full_said:
                self.full_said = True
                say(f"{MAX_GRAPHS} decoder graphs captured: new batch sizes run eagerly")
            return None
        self._ensure_arena(binfo, h, cos)
        g = _LayerGraphs(self.arena, n, len(binfo.lengths), h.requires_grad, self.device, bound)
        g.load(binfo, h, cos, sin)
        g.param_grads = self.grads
        t0 = time.perf_counter()
        self._capture(g, layers, binfo, autocast, dropouts)
        seconds = time.perf_counter() - t0
        CAPTURES.append({"tokens": n, "seconds": seconds, "t": t0, "ahead": ahead, "row_bound": bound})
        say(f"captured the decoder layers' CUDA graphs for {n} tokens in {seconds * 1e3:.0f} ms "
             f"({len(self.graphs) + 1} buckets{', ahead' if ahead else ''})")
        self.graphs[key] = g
        return g

    def _ensure_arena(self, binfo, h, cos) -> None:
        """Buffers for the largest bucket this run can meet (one that no longer fits is replaced)."""
        if self.arena is None or not self.arena.fits(h, cos):
            capacity = max([h.shape[1], bucketed_tokens(binfo.batch * binfo.seqlen, bucket_size())] + (self.ahead or []))
            self.arena = graph_buffers.Arena(capacity, h, cos)

    def _capture(self, g: _LayerGraphs, layers, binfo, autocast, dropouts: int) -> None:
        masks = g.arena.masks
        info = g.info(binfo)
        params = self.params
        inputs_from = 1 if g.needs_input_grad else 0

        def forward():
            x_in = g.h.detach().requires_grad_(g.needs_input_grad)
            masks.begin(g.n)
            with torch.autocast("cuda", enabled=autocast[0], dtype=autocast[1], cache_enabled=False), \
                    packing.dropout_masks_from(masks):
                out = run_layers(layers, x_in, info, g.cos, g.sin)
            return ([x_in] if g.needs_input_grad else []) + params, out

        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            if not self.warmed:  # lazy initialisations (cuBLAS, autograd's device thread) outside a capture
                # freed blocks are cached per stream: the eager steps' cannot serve this side stream's
                # warm-up, which would reserve a second copy. Give them back first.
                torch.cuda.current_stream(self.device).synchronize()
                torch.cuda.empty_cache()
                inputs, out = forward()
                torch.autograd.grad(out, inputs, grad_outputs=g.grad_out, allow_unused=True)
                del inputs, out
                masks.pack()  # the masks made during the warm-up, now in one block
                # the warm-up's activations sit in the eager pool, the graphs' in the graph pool: give the
                # eager copy back (peak reserved measured higher without: docs/cuda_graphs.md, section 5)
                self.stream.synchronize()
                torch.cuda.empty_cache()
                self.warmed = True
            g.fwd.capture_begin(pool=self.pool)
            try:
                inputs, out = forward()
                g.out.copy_(out)
            finally:
                g.fwd.capture_end()
            taken = masks.calls()
            g.bwd.capture_begin(pool=self.pool)
            try:
                grads = torch.autograd.grad(out, inputs, grad_outputs=g.grad_out, allow_unused=True)
                if g.needs_input_grad:
                    g.grad_h.copy_(grads[0])
                pairs = [(buf, gr) for buf, gr in zip(self.grads.views, grads[inputs_from:]) if gr is not None]
                if pairs and _FOREACH_COPY is not None:
                    _FOREACH_COPY([b for b, _ in pairs], [gr for _, gr in pairs])
                elif pairs:
                    say_once("torch has no _foreach_copy_: the captured gradient copies run one Tensor.copy_ each")
                    for buf, gr in pairs:
                        buf.copy_(gr)
            finally:
                g.bwd.capture_end()
            g.has_grad = [gr is not None for gr in grads[inputs_from:]]
            del inputs, out, grads, pairs
        current.wait_stream(self.stream)
        if taken != dropouts or len(masks.specs) != taken:
            raise RuntimeError(f"the captured layers took {taken} dropout masks, expected {dropouts} "
                               "(one per LoRA dropout): some dropout would draw inside the graph")

    def _capture_ahead(self, layers, binfo, h, cos, dropouts: int) -> None:
        """Capture the buckets lengths.py predicts (``self.ahead``) in this step, after its own bucket, so that
        none falls in a later step. Largest first: a smaller bucket reuses the shared pool's blocks (the order:
        docs/cuda_graphs.md, section 5a). Recorded from zeros shaped like a batch of ``binfo.batch`` rows (a
        capture runs no kernel; each replay loads its step's values)."""
        for nb in sorted(self.ahead or [], reverse=True):
            if nb == h.shape[1] or nb > self.arena.capacity:
                continue
            real = nb - 1  # one filler token, as bucketed_tokens always leaves at least one
            rows = [real // binfo.batch + (1 if i < real % binfo.batch else 0) for i in range(binfo.batch)]
            if min(rows) < 1:
                continue
            fake = packing.make_unpadded(rows, max(rows), self.device, extra=1)
            h0 = torch.zeros((1, nb, h.shape[-1]), dtype=h.dtype, device=self.device).requires_grad_(h.requires_grad)
            c0 = torch.zeros((1, nb, cos.shape[-1]), dtype=cos.dtype, device=self.device)
            self._graphs_for(layers, fake, h0, c0, c0, dropouts, ahead=True)

    # -- a step -------------------------------------------------------------------------------
    def forward(self, model, layers, input_ids, info, scan: Scan) -> torch.Tensor | None:
        """The layers' output [1, N, H] on the packed real tokens replayed from a graph; None: run them eagerly."""
        n = info.n_tokens
        nb = bucketed_tokens(n, bucket_size())
        binfo = packing.make_unpadded(list(info.lengths), info.seqlen, input_ids.device, extra=nb - n)
        ids = packing.unpad_rows(input_ids.reshape(-1), binfo).unsqueeze(0)  # [1, nb]
        h = model.embed_tokens(ids)
        pos = binfo.positions.unsqueeze(0)
        cos, sin = model.rotary_emb(h, pos)
        params = self._trainable(scan.params)
        dropouts = scan.dropouts
        first = self.ahead is None
        if first:
            prof = lengths.profile()
            self.ahead = [] if prof is None else lengths.predicted_buckets(prof, lambda t: bucketed_tokens(t, bucket_size()))
            self.row_cap = None if prof is None else max(bucket_size(), max(prof.lengths))
            if self.ahead:
                say(f"decoder CUDA graphs: {len(self.ahead)} buckets predicted from the dataset's row lengths "
                     f"({self.ahead[0]}-{self.ahead[-1]} tokens), captured ahead in this step")
        try:
            g = self._graphs_for(layers, binfo, h, cos, sin, dropouts)
            if first and g is not None and self.ahead:
                self._capture_ahead(layers, binfo, h, cos, dropouts)
        except Exception as exc:  # noqa: BLE001 - a refused capture: eager from now on, said once
            self.failed = _describe_failure(exc)
            FAILURES.append(self.failed)
            self.graphs.clear()
            _release_capture_state(self.device)
            say(f"decoder CUDA graphs disabled ({self.failed}); the layers run eagerly")
            g = None
        if g is None:
            # the caller's eager loop on the real tokens only (a filler row there would take real
            # positions' gradients); nothing random was drawn yet
            return None
        g.load(binfo, h, cos, sin)
        g.arena.masks.draw(binfo)
        out = _ReplayDecoderLayers.apply(g, h, *params)
        return out[:, :n]


_RUNNERS: "weakref.WeakKeyDictionary" = state.kept(weakref.WeakKeyDictionary())
_REFUSALS_SAID: set[str] = state.kept(set())

# Every capture and failure in this process, for the measurement harness (bench/run_one.py):
# {"tokens", "seconds", "t": time.perf_counter() at its start, "ahead", "row_bound"}, and the failure reasons.
CAPTURES: list[dict] = []
FAILURES: list[str] = []


def stats() -> dict:
    """Captures, failures and "auto" decisions so far (copies), plus the refusals said."""
    return {"captures": [dict(c) for c in CAPTURES], "failed": list(FAILURES), "refused": sorted(_REFUSALS_SAID),
            "decisions": [dict(d) for d in graph_decision.DECISIONS]}

# forward arguments no op in the layers reads (the Trainer's loss normaliser, passed down in **kwargs)
IGNORED_KWARGS = frozenset({"num_items_in_batch"})


NOT_CUDA = "not on CUDA"


def arguments_refusal(kwargs) -> str | None:
    """The forward's extra arguments a replay cannot honour (None: all None or ignored)."""
    extra = [k for k, v in (kwargs or {}).items() if v is not None and k not in IGNORED_KWARGS]
    return f"extra forward arguments ({', '.join(sorted(extra))})" if extra else None


def refusal(model, input_ids, kwargs, hooked: bool = False) -> str | None:
    """Why this packed forward cannot replay graphs (None: it can). ``hooked``: ``_scan``'s answer."""
    if not enabled():
        return f"${CUDA_GRAPHS_ENV} is 0"
    if input_ids.device.type != "cuda":
        return NOT_CUDA
    runner = _RUNNERS.get(model)
    if runner is not None and runner.failed:
        return runner.failed
    reason = arguments_refusal(kwargs)
    if reason is not None:
        return reason
    if torch.cuda.is_current_stream_capturing():
        return "already inside a CUDA graph capture"
    if not attention.varlen_enabled():
        return "variable-length attention refused on this machine (the step runs stock's forward)"
    if hooked:
        return "hooks or instance-level forwards on the decoder layers (they would run only at capture)"
    ckpt = [layer for layer in model.layers if layer_node.checkpointed(layer)]
    if ckpt and (layer_node.PLANNER is None or not all(
            layer_node.own_checkpoint(getattr(layer, "_gradient_checkpointing_func", None)) for layer in ckpt)):
        return ("gradient checkpointing outside the layer node's own (the node is off, or the checkpoint "
                "function is not torch's plain one)")
    return None


def decoder_forward(model, input_ids, info, kwargs) -> torch.Tensor | None:
    """The packed decoder layers' output [1, N, H] from CUDA graphs, or None (run them eagerly)."""
    layers = model.layers[: model.config.num_hidden_layers]
    scan = _scan(layers) if enabled() and input_ids.device.type == "cuda" else None
    reason = refusal(model, input_ids, kwargs, scan is not None and scan.hooked)
    probe = graph_decision.probe_of(model, input_ids.device, reason is None and mode() == "auto")
    if probe is not None:
        probe.collect()
        if not probe.verdict:
            return None  # still measuring (the caller's eager loop is timed), or decided off (said once)
    if reason is not None:
        if enabled() and reason not in _REFUSALS_SAID:  # asked for, not possible: say why, once
            _REFUSALS_SAID.add(reason)
            if reason != NOT_CUDA:  # without CUDA there is nothing to say: graphs are a CUDA feature
                say(f"decoder CUDA graphs not used for this forward: {reason}; the layers run eagerly")
        return None
    runner = _RUNNERS.get(model)
    if runner is None:
        precompile.wait()  # a background compile must not load modules while a graph is captured
        runner = _RUNNERS[model] = DecoderGraphs(input_ids.device)
    return runner.forward(model, layers, input_ids, info, scan)


def runner_of(model) -> DecoderGraphs | None:
    return _RUNNERS.get(model)
