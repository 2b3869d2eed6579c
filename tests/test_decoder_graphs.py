"""CUDA graphs over the decoder layers (solution/step/cuda_graphs.py).

On the CPU: the pieces a graph depends on (the filler row of a bucket, the mask slots, the
settings, the refusals), and that running the layers on a bucket (real tokens + filler row)
gives the real tokens exactly the outputs and gradients of the unbucketed run. On the GPU: the
whole QLoRA stack (bitsandbytes NF4, peft LoRA with dropout, fp16 autocast, every patch) trained
for several steps with graphs and without, on the same seeds: the same random numbers consumed,
losses and LoRA gradients equal to fp16 rounding, gradient accumulation across replays.
"""
from __future__ import annotations

import pytest
import torch

from solution.settings import Settings
from solution.step import cuda_graphs, graph_buffers, graph_decision, lengths, packing
from tests._qlora_step import run_qlora
from tests.conftest import rel_err
from tests.test_unpad import STEP_REL, _lora_model, _right_padded_batch


def test_make_unpadded_with_a_filler_row():
    info = packing.make_unpadded([3, 5, 2], 5, torch.device("cpu"), extra=4)
    assert info.lengths == (3, 5, 2, 4) and info.batch == 3 and info.seqlen == 5 and info.n_tokens == 14
    # the filler: the longest row's (row 1, flat 5..9) first tokens at positions 0..3, its own row
    assert info.idx.tolist() == [0, 1, 2, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8]
    assert info.positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 0, 1, 2, 3]
    assert info.cu_seqlens.tolist() == [0, 3, 8, 10, 14] and info.cu_seqlens.dtype == torch.int32
    plain = packing.make_unpadded([3, 5, 2], 5, torch.device("cpu"))
    assert plain.lengths == (3, 5, 2) and plain.idx.tolist() == info.idx.tolist()[:10]
    assert info.max_len == 5 and plain.max_len == 5
    longer = packing.make_unpadded([3, 2], 4, torch.device("cpu"), extra=7)  # longer than any row: cyclic
    assert longer.idx.tolist()[5:] == [0, 1, 2, 0, 1, 2, 0] and longer.positions.tolist()[5:] == list(range(7))


def test_max_len_bound():
    info = packing.make_unpadded([3, 5], 5, torch.device("cpu"))
    bounded = packing.Unpadded(idx=info.idx, positions=info.positions, batch=2, seqlen=5,
                               lengths=info.lengths, max_len_bound=64)
    assert bounded.max_len == 64 and bounded.n_tokens == 8


def test_row_bound_is_the_runs_cap_where_it_holds():
    """Attention's row bound of a bucket: the run's cap where this batch's longest row (filler
    included) is within it, never more than the bucket; the bucket without a cap or beyond it."""
    assert cuda_graphs.row_bound(1280, 512, 512) == 512
    assert cuda_graphs.row_bound(256, 200, 512) == 256  # a small bucket: itself
    assert cuda_graphs.row_bound(1280, 513, 512) == 1280  # a longer row than the run's: the bucket
    assert cuda_graphs.row_bound(1280, 0, 512) == 512  # captured ahead (stand-in rows)
    assert cuda_graphs.row_bound(1280, 300, None) == 1280  # no length profile


@pytest.mark.parametrize("n,bucket,expected", [(1, 64, 64), (63, 64, 64), (64, 64, 128), (1009, 64, 1024),
                                                (1009, 128, 1024), (1024, 128, 1152), (5, 1, 6)])
def test_bucketed_tokens(n, bucket, expected):
    assert cuda_graphs.bucketed_tokens(n, bucket) == expected


def test_settings_are_checked(monkeypatch):
    import solution

    monkeypatch.setenv("SOLUTION_GRAPH_BUCKET", "0")
    with pytest.raises(ValueError, match="SOLUTION_GRAPH_BUCKET"):
        Settings.from_env()
    monkeypatch.setenv("SOLUTION_GRAPH_BUCKET", "sixty")
    with pytest.raises(ValueError, match="SOLUTION_GRAPH_BUCKET"):
        solution.apply(verbose=False)  # refused before anything is installed
    assert solution.installed() == {}
    monkeypatch.setenv("SOLUTION_GRAPH_BUCKET", "128")
    monkeypatch.setenv("SOLUTION_CUDA_GRAPHS", "yes")
    with pytest.raises(ValueError, match="SOLUTION_CUDA_GRAPHS"):
        Settings.from_env()
    monkeypatch.setenv("SOLUTION_CUDA_GRAPHS", "1")
    Settings.from_env()
    assert cuda_graphs.bucket_size() == 128 and cuda_graphs.enabled()
    monkeypatch.delenv("SOLUTION_CUDA_GRAPHS")
    Settings.from_env()
    assert cuda_graphs.mode() == "auto" and cuda_graphs.enabled()  # the default: measured
    monkeypatch.setenv("SOLUTION_CUDA_GRAPHS", "0")
    assert not cuda_graphs.enabled()


@pytest.mark.parametrize("samples,verdict,words", [
    ([], None, "measuring"),
    ([(0.090, 0.092)], True, "host-bound"),  # an H200: the GPU waits for the host
    ([(0.300, 0.900)], False, "GPU-bound"),  # a GPU-bound machine
    ([(0.100, 0.114)], True, "host-bound"),  # within the 1.15 margin
    ([(0.100, 0.116)], False, "GPU-bound"),  # just over it
    ([(0.0, 0.1)], False, "GPU-bound"),  # a zero host time cannot say host-bound
    ([(0.300, 0.900), (0.1, 0.1)], False, "GPU-bound"),  # the first clean sample decides
])
def test_graph_decision_from_fake_timings(samples, verdict, words):
    """decide(): graphs only where the eager layers' GPU time stays within GPU_BOUND_RATIO of
    their host time, from the first clean sample, with its figures said."""
    got, why = graph_decision.decide(samples)
    assert got is verdict and words in why
    if samples:
        assert "ms" in why


class _Model:  # a model stand-in: the probes are kept per model object (weakly)
    pass


class _Ids:  # input_ids on a CUDA device, as far as _probe_of looks
    device = torch.device("cuda", 0)


@pytest.mark.parametrize("graphs, reason, probed", [
    ("auto", None, True),  # graphs decide from it
    ("1", None, False),  # graphs always: nothing to decide
    ("0", "$SOLUTION_CUDA_GRAPHS is 0", False),
    ("auto", "hooks on the decoder layers", False),  # graphs refused: nothing to decide
    ("auto", cuda_graphs.NOT_CUDA, False),
])
def test_probe_made_where_its_verdict_is_used(graphs, reason, probed, monkeypatch):
    """A model's eager layers are timed (the probe) only where the verdict decides something:
    graphs in "auto" mode, not refused; the decision is recorded and said once."""
    from solution import settings

    monkeypatch.setattr(settings, "_active", Settings(cuda_graphs=graphs))
    said = []
    monkeypatch.setattr(graph_decision, "say", said.append)
    monkeypatch.setattr(graph_decision, "DECISIONS", [])
    model = _Model()
    probe = graph_decision.probe_of(model, _Ids.device, reason is None and graphs == "auto")
    assert (probe is not None) == probed
    if probe is None:
        return
    assert graph_decision.probe_of(model, _Ids.device, reason is None and graphs == "auto") is probe  # one per model
    probe.samples = [(0.100, 0.101)]  # host-bound
    probe.collect()
    (d,) = graph_decision.DECISIONS
    assert d["graphs"] is True and said == [graph_decision.decision_line(d)]
    assert said[0].startswith("decoder CUDA graphs on")


def test_probe_decides_once_from_completed_events():
    """_Probe.collect reads only completed events (no sync), decides once, and records it."""
    class Ev:
        def __init__(self, t, done=True):
            self.t, self.done = t, done

        def query(self):
            return self.done

        def elapsed_time(self, other):
            return (other.t - self.t) * 1e3

    graph_decision.DECISIONS.clear()
    probe = graph_decision.Probe()
    probe.pending = [(0.1, Ev(1.0), Ev(1.3, done=False))]
    probe.collect()
    assert probe.verdict is None and probe.samples == [] and len(probe.pending) == 1  # not complete: not read
    probe.pending[0][2].done = True
    probe.collect()
    assert probe.verdict is False and "GPU-bound" in probe.reason and len(probe.samples) == 1
    assert cuda_graphs.stats()["decisions"][0]["graphs"] is False
    probe.collect()
    assert len(graph_decision.DECISIONS) == 1
    graph_decision.DECISIONS.clear()


def test_mask_slots_record_and_check():
    slots = graph_buffers.MaskSlots(capacity=10)
    slots.begin(6)
    x = torch.zeros(1, 6, 4)
    m0, m1 = slots.take(0.1, x), slots.take(0.1, x)
    assert m0.shape == x.shape and m0.dtype == torch.bool and slots.calls() == 2 and len(slots.buffers) == 2
    assert m0.data_ptr() == slots.buffers[0].data_ptr() and m1.data_ptr() == slots.buffers[1].data_ptr()
    slots.begin(6)
    assert slots.take(0.1, x).data_ptr() == m0.data_ptr()  # the same buffer at the same call
    with pytest.raises(RuntimeError, match="recorded"):
        slots.take(0.2, x)  # call 1 recorded with p 0.1
    slots.begin(5)
    with pytest.raises(RuntimeError, match="tokens"):
        slots.take(0.1, x)


def test_mask_slots_pack_into_one_block_and_keep_handing_out_views():
    """pack() (after the warm-up) moves the masks into one allocation, in call order, with their
    shapes; take() and draw() then work on the packed views as before."""
    slots = graph_buffers.MaskSlots(capacity=10)
    slots.begin(6)
    x4, x8 = torch.zeros(1, 6, 4), torch.zeros(1, 6, 8)
    slots.take(0.1, x4)
    slots.take(0.2, x8)
    before = [b.data_ptr() for b in slots.buffers]
    slots.pack()
    b0, b1 = slots.buffers
    assert b0.shape == (10, 4) and b1.shape == (10, 8) and b0.dtype == torch.bool
    assert b0.untyped_storage().data_ptr() == b1.untyped_storage().data_ptr()  # one allocation
    assert b1.data_ptr() == b0.data_ptr() + 40 and b0.data_ptr() not in before
    slots.begin(6)
    assert slots.take(0.1, x4).data_ptr() == b0.data_ptr() and slots.take(0.2, x8).data_ptr() == b1.data_ptr()
    info = packing.make_unpadded([4, 2], 4, torch.device("cpu"))
    torch.manual_seed(3)
    slots.draw(info)
    stock = _stock_lora_dropout_masks([4, 2], 4, slots.specs, seed=3)
    for (padded, real), buf in zip(stock, (b0, b1)):
        assert torch.equal(buf[: info.n_tokens], real)
    graph_buffers.MaskSlots(capacity=3).pack()  # nothing recorded: nothing to do


def test_grad_buffers_hand_out_one_clone_as_parameter_views():
    """The graphs' gradient buffers are views of one flat buffer; a replay's copies are views of
    one clone of it, each kept by autograd as its parameter's .grad (no second copy), and the
    optimizer and clipping read them as before. Mixed dtypes fall back to one buffer each."""
    ps = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(2, 2))]
    bufs = graph_buffers.GradBuffers(ps)
    for i, v in enumerate(bufs.views):
        v.fill_(i + 1)
    assert bufs.flat is not None and bufs.flat.numel() == 21

    class Replay(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *params):
            return sum(p.sum() for p in params)

        @staticmethod
        def backward(ctx, _):
            return tuple(bufs.copies([True, False, True]))

    Replay.apply(*ps).backward()
    assert [p.grad is None for p in ps] == [False, True, False]
    assert torch.equal(ps[0].grad, torch.full((3, 4), 1.0)) and torch.equal(ps[2].grad, torch.full((2, 2), 3.0))
    assert ps[0].grad.untyped_storage().data_ptr() == ps[2].grad.untyped_storage().data_ptr()  # kept, not copied
    assert ps[0].grad.untyped_storage().data_ptr() != bufs.flat.untyped_storage().data_ptr()  # safe from the next replay
    bufs.views[0].fill_(7)
    assert torch.equal(ps[0].grad, torch.full((3, 4), 1.0))
    torch.nn.utils.clip_grad_norm_([ps[0], ps[2]], 0.5, foreach=True)
    torch.optim.AdamW([ps[0], ps[2]], foreach=True).step()
    mixed = graph_buffers.GradBuffers([ps[0], torch.nn.Parameter(torch.randn(2, dtype=torch.float16))])
    assert mixed.flat is None and [c.dtype for c in mixed.copies([True, True])] == [torch.float32, torch.float16]


def _stock_lora_dropout_masks(lengths, seqlen, specs, seed):
    """What stock draws: peft's LoRA layer calls its ``nn.Dropout`` on the padded input [batch,
    seqlen, hidden], one call per LoRA layer in call order, from the default generator seeded with
    ``seed``. For each spec (p, dtype, hidden) of ``_MaskSlots``: (the kept elements over the
    padded shape [batch, seqlen, hidden], those of the real tokens in packed order [n, hidden]).
    A kept element of ``dropout(ones)`` is nonzero (1 / (1 - p)), a dropped one zero."""
    torch.manual_seed(seed)
    real = torch.arange(seqlen) < torch.tensor(lengths)[:, None]  # the attention mask of right padding
    out = []
    for p, dtype, hidden in specs:
        kept = torch.nn.Dropout(p).train()(torch.ones(len(lengths), seqlen, hidden, dtype=dtype)) != 0
        out.append((kept, kept[real]))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mask_slots_draw_as_the_stock_dropout(dtype):
    """draw() fills each slot with the mask stock's own LoRA dropout (nn.Dropout over the padded
    batch) draws for the same seed, in the same call order, real tokens' rows in packed order;
    the filler row's masks are those of the longest row's first tokens (what its tokens copy), and
    the generator ends where stock's does."""
    lengths, seqlen, extra = [3, 5, 2], 5, 6
    info = packing.make_unpadded(lengths, seqlen, torch.device("cpu"), extra=extra)
    slots = graph_buffers.MaskSlots(capacity=20)
    slots.begin(info.n_tokens)
    x = torch.zeros(1, info.n_tokens, 8, dtype=dtype)
    slots.take(0.3, x)
    slots.take(0.5, x)
    torch.manual_seed(7)
    slots.draw(info)
    after_ours = torch.rand(1)
    stock = _stock_lora_dropout_masks(lengths, seqlen, slots.specs, seed=7)
    after_stock = torch.rand(1)
    n_real, longest = sum(lengths), max(range(len(lengths)), key=lambda b: lengths[b])
    for (padded, real), buf in zip(stock, slots.buffers):
        assert torch.equal(buf[:n_real], real)
        assert torch.equal(buf[n_real:info.n_tokens], padded[longest, torch.arange(extra) % lengths[longest]])
    assert torch.equal(after_ours, after_stock)


def test_refused_without_cuda_or_setting(monkeypatch):
    model = _lora_model("cpu").base_model.model.model
    ids, mask, _ = _right_padded_batch([5, 3], 6)
    info = packing.make_unpadded([5, 3], 6, torch.device("cpu"))
    monkeypatch.setenv("SOLUTION_CUDA_GRAPHS", "0")
    assert "SOLUTION_CUDA_GRAPHS is 0" in cuda_graphs.refusal(model, ids, {})
    assert cuda_graphs.decoder_forward(model, ids, info, {}) is None
    monkeypatch.setenv("SOLUTION_CUDA_GRAPHS", "1")
    assert cuda_graphs.refusal(model, ids, {}) == "not on CUDA"
    assert cuda_graphs.decoder_forward(model, ids, info, {}) is None


def test_scan_finds_hooks_and_active_lora_dropouts(monkeypatch):
    """_scan counts the LoRA dropouts a forward draws from (p > 0, training mode), sees hooks
    anywhere in the layers, and lists the trainable parameters exactly as
    ``layer.parameters()`` does (the same objects, in the same order, each once). The tiny
    model's LoRA layers are peft's plain Linear; the scan is pointed at that class in place of the
    bnb 4-bit one."""
    import peft.tuners.lora.bnb as lora_bnb
    from peft.tuners.lora.layer import Linear as LoraLinear

    def found(layers):
        scan = cuda_graphs._scan(layers)
        expected = [p for layer in layers for p in layer.parameters() if p.requires_grad]
        assert len(scan.params) == len(expected) and all(a is b for a, b in zip(scan.params, expected))
        return scan.hooked, scan.dropouts

    monkeypatch.setattr(lora_bnb, "Linear4bit", LoraLinear, raising=False)
    model = _lora_model("cpu", dropout=0.1).train()
    layers = model.base_model.model.model.layers
    assert found(layers) == (False, 4)  # 2 layers x (q, v)
    assert len(cuda_graphs._scan(layers).params) == 8  # q's and v's A and B in 2 layers
    layers[0].self_attn.q_proj.lora_dropout["default"].eval()
    assert found(layers) == (False, 3)
    handle = layers[1].mlp.register_forward_hook(lambda *a: None)
    assert found(layers) == (True, 3)
    handle.remove()
    layers[1].self_attn.k_proj.weight.requires_grad_(True)  # one more trainable parameter: listed in its place
    assert found(layers) == (False, 3)
    layers[1].self_attn.k_proj.weight.requires_grad_(False)
    layers[1].self_attn.extra = layers[1].self_attn.q_proj  # a module seen twice is walked once
    assert found(layers) == (False, 3)
    del layers[1].self_attn.extra
    assert found(_lora_model("cpu", dropout=0.0).base_model.model.model.layers) == (False, 0)


def test_layer_arguments_the_graph_may_ignore():
    """The Trainer's num_items_in_batch reaches the layers (nothing there reads it); any other
    argument refuses the graph, since a replay would not see it."""
    assert cuda_graphs.arguments_refusal({"num_items_in_batch": torch.tensor(3), "cache_position": None}) is None
    reason = cuda_graphs.arguments_refusal({"num_items_in_batch": torch.tensor(3), "foo": 1})
    assert reason is not None and "foo" in reason


@pytest.mark.parametrize("extra", [1, 7, 30])
def test_filler_row_leaves_real_tokens_unchanged(device, tmp_path, autocast_ctx, extra):
    """The layers (the decoder-layer node, as a replay runs them) on real tokens + a filler row (a
    bucket) give the real tokens the unbucketed outputs, the same LoRA gradients (the filler's
    contribution is exactly zero), a zero input gradient on the filler. The workload's stack on the
    tiny stand-in, LoRA dropout off (a filler changes no draw, but the masks' shape would); limit:
    the GEMMs run over more rows (cuBLAS may pick other kernels), one fp16 rounding apart at most."""
    import solution
    from solution.settings import Settings
    from tests.test_unpad import qlora_tiny_model
    from workload.model_standin import write_standin

    solution.revert()
    solution.apply(verbose=False, settings=Settings(cuda_graphs="0", precompile=False))
    try:
        model = qlora_tiny_model(write_standin(tmp_path / "tiny", size="tiny"), device)
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        dec = model.base_model.model.model
        layers = dec.layers
        lengths, seqlen = [9, 4, 13], 13
        ids, _, _ = _right_padded_batch(lengths, seqlen, vocab=100, device=device)
        n = sum(lengths)
        g = torch.Generator().manual_seed(3)
        grad = (torch.randn(1, n, dec.config.hidden_size, generator=g) * 0.1).to(device)

        def run(info):
            h = dec.embed_tokens(packing.unpad_rows(ids.reshape(-1), info).unsqueeze(0)).detach().float()
            h.requires_grad_()
            cos, sin = dec.rotary_emb(h, info.positions.unsqueeze(0))
            with autocast_ctx():
                out = cuda_graphs.run_layers(layers, h, info, cos, sin)
            model.zero_grad(set_to_none=True)
            out[:, :n].backward(grad)
            grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
            return out[:, :n].detach(), h.grad, grads

        out_a, hg_a, grads_a = run(packing.make_unpadded(lengths, seqlen, torch.device(device)))
        out_b, hg_b, grads_b = run(packing.make_unpadded(lengths, seqlen, torch.device(device), extra=extra))
    finally:
        solution.revert()
    limit = 2.0 ** -11
    assert rel_err(out_b, out_a) < limit
    assert rel_err(hg_b[:, :n], hg_a) < limit and torch.all(hg_b[:, n:] == 0)
    assert set(grads_a) == set(grads_b) and any("lora_B" in k for k in grads_a)
    for k, g_ref in grads_a.items():
        assert rel_err(grads_b[k], g_ref) < limit, k


def _four_batches():
    return [_right_padded_batch(lens, 64, vocab=100, seed=i, device="cuda")
            for i, lens in enumerate([[40, 17, 64, 9], [38, 20, 64, 9], [12, 30, 5, 60], [64, 64, 64, 1]])]


def _train_steps(model_dir, batches, plan, graphs: str, monkeypatch, profile=None, ckpt=None):
    """The tiny QLoRA model trained on ``plan`` ((batch index, zero_grad first) per step) with
    $SOLUTION_CUDA_GRAPHS=graphs, every patch on (tests/_qlora_step.py): per step (loss, gradients,
    generator offset), and (graphs captured, failure) of the model's runner (None: no runner).
    ``profile``: row lengths noted as patches/trainer_lengths does, so that their buckets are captured
    ahead. ``ckpt``: gradient checkpointing on, with use_reentrant=ckpt (None: off)."""
    monkeypatch.setenv("SOLUTION_CUDA_GRAPHS", graphs)
    lengths.clear()
    if profile is not None:  # as a profile whose simulated runs all meet them
        lengths.note(profile, batch=1, steps=len(profile))
    try:
        # num_items_in_batch: the Trainer passes it; transformers hands it to every layer
        run = run_qlora(model_dir, [batches[b] for b, _ in plan], apply=True, ckpt=ckpt, num_items_in_batch=50,
                        accumulate={i for i, (_, zero) in enumerate(plan) if not zero}, after_steps=_graphs_state)
    finally:
        lengths.clear()
    assert "qwen2_unpad" in run.installed
    return run.steps, run.after_steps


def _graphs_state(model):
    """(graphs captured, failure) of the model's CUDA-graph runner; None: no runner."""
    runner = cuda_graphs.runner_of(model.base_model.model.model)
    return None if runner is None else (len(runner.graphs), runner.failed)


def _assert_trains_like_eager(eager, graphed):
    """Per step: the same generator offset (the same random numbers consumed), loss within rel 1e-3,
    LoRA gradients within ``STEP_REL`` (tests/test_unpad.py: the filler rows change the GEMMs' token
    dimension, so other cuBLAS tiles and summation orders)."""
    for i, ((loss_e, grads_e, off_e), (loss_g, grads_g, off_g)) in enumerate(zip(eager, graphed)):
        assert off_g == off_e, f"step {i}: the generator moved differently"
        assert rel_err(loss_g, loss_e) < 1e-3, i
        assert set(grads_g) == set(grads_e) and any("lora_B" in n for n in grads_e)
        for name, g in grads_e.items():
            assert rel_err(grads_g[name], g) <= STEP_REL, (i, name, rel_err(grads_g[name], g))


@pytest.mark.gpu
@pytest.mark.parametrize("bucket,ahead,cap", [("64", False, None), ("16", False, None), ("16", True, None),
                                              ("16", False, 64)])
def test_graphs_train_like_eager_gpu(device, tmp_path, monkeypatch, bucket, ahead, cap):
    """Graphs against eager on 4 QLoRA steps: same generator offsets, losses and gradients. With
    ``ahead`` a length profile is noted (as patches/trainer_lengths does) that predicts the
    batches' buckets: they are captured ahead, in the first step, from zeros, and the replays
    of the later steps still train as eager does. With ``cap`` the runner takes it as the run's
    longest row (the batches' longest is 64): attention's row bound is then 64 in every bucket
    above it, and the filler row (at most one bucket width, 16) within it.
    The workload's stack on a tiny model (NF4 double quant, LoRA r=16 on q/v, dropout 0.05,
    fp16 autocast, every patch): four forward/backward steps on batches of different lengths
    (two in one bucket, a new bucket, and a gradient accumulation of two batches), with graphs and
    eagerly, the same seeds. After every step the CUDA generator must be at the same offset (the
    same random numbers consumed); losses within rel 1e-3 and LoRA gradients within ``STEP_REL``
    (_assert_trains_like_eager)."""
    if device != "cuda":
        pytest.skip("needs CUDA")
    from workload.model_standin import write_standin

    monkeypatch.setenv("SOLUTION_GRAPH_BUCKET", bucket)
    model_dir = write_standin(tmp_path / "tiny", size="tiny")
    batches = _four_batches()
    plan = [(0, True), (1, True), (2, True), (3, False)]  # (batch, zero_grad first): the last accumulates
    if cap is not None:
        bound = cuda_graphs.row_bound
        monkeypatch.setattr(cuda_graphs, "row_bound", lambda tokens, longest, _cap: bound(tokens, longest, cap))

    def run(graphs: bool):
        return _train_steps(model_dir, batches, plan, "1" if graphs else "0", monkeypatch,
                            profile=[int(m.sum()) for _, m, _ in batches] if ahead else None)

    first_capture = len(cuda_graphs.CAPTURES)
    eager, none = run(False)
    graphed, state = run(True)
    lengths.clear()
    assert none is None
    assert state is not None and state[1] is None, state
    assert state[0] == len({cuda_graphs.bucketed_tokens(int(m.sum()), int(bucket)) for _, m, _ in batches})
    caps = cuda_graphs.CAPTURES[first_capture:]
    assert sum(1 for c in caps if c.get("ahead")) == (state[0] - 1 if ahead else 0)
    if cap is not None:
        assert [c["row_bound"] for c in caps] == [min(c["tokens"], cap) for c in caps]
        assert any(c["row_bound"] < c["tokens"] for c in caps)
    _assert_trains_like_eager(eager, graphed)


@pytest.mark.gpu
@pytest.mark.parametrize("reentrant", [False, True])
def test_graphs_under_gradient_checkpointing_gpu(device, tmp_path, monkeypatch, reentrant):
    """Gradient checkpointing with transformers' checkpoint function (torch's, reentrant or not):
    the layers go through the node's own checkpointing, which the graphs capture (the masks come
    from the graph's slots; the recompute takes them again). Against the eager checkpointed run
    on the same seeds: the same generator offset after every step, losses and gradients within
    the graphs' tolerances (test_graphs_train_like_eager_gpu), the node's checkpointing captured.
    Rows x12: fewer than ~512 packed rows of the tiny model fall under bitsandbytes' small-M rule,
    where the node leaves the layer to the modules (tests/test_layer_node.py)."""
    if device != "cuda":
        pytest.skip("needs CUDA")
    from solution.kernels import _launches
    from solution.step.layer import CHECKPOINT_COUNT
    from workload.model_standin import write_standin

    monkeypatch.setenv("SOLUTION_GRAPH_BUCKET", "256")
    model_dir = write_standin(tmp_path / "tiny", size="tiny")
    batches = [_right_padded_batch([n * 12 for n in lens], 64 * 12, vocab=100, seed=i, device="cuda")
               for i, lens in enumerate([[40, 17, 64, 9], [38, 20, 64, 9], [12, 30, 5, 60]])]
    plan = [(0, True), (1, True), (2, False)]
    eager, none = _train_steps(model_dir, batches, plan, "0", monkeypatch, ckpt=reentrant)
    _launches.reset()
    graphed, state = _train_steps(model_dir, batches, plan, "1", monkeypatch, ckpt=reentrant)
    assert none is None
    assert state is not None and state[1] is None and state[0] >= 1, state
    assert _launches.LAUNCHES[CHECKPOINT_COUNT] > 0  # the node's own checkpointing ran in the captures
    _assert_trains_like_eager(eager, graphed)


@pytest.mark.gpu
def test_failed_capture_falls_back_to_eager_and_draws_again_gpu(device, tmp_path, monkeypatch):
    """A capture that an operation invalidates (here a device sync inside it, as a host read of a
    tensor would be) must leave the run as if graphs had never been asked for: the first error
    named in the failure, the CUDA generator usable again (dropout draws in the eager layers), and
    losses, gradients and generator offsets exactly the eager run's."""
    if device != "cuda":
        pytest.skip("needs CUDA")
    from workload.model_standin import write_standin

    model_dir = write_standin(tmp_path / "tiny", size="tiny")
    batches, plan = _four_batches(), [(0, True), (1, True), (2, True)]
    eager, _ = _train_steps(model_dir, batches, plan, "0", monkeypatch)
    real = cuda_graphs.run_layers

    def sync_inside_capture(*args):
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()  # not permitted while capturing: invalidates the capture
        return real(*args)

    monkeypatch.setattr(cuda_graphs, "run_layers", sync_inside_capture)
    failed, state = _train_steps(model_dir, batches, plan, "1", monkeypatch)
    assert state is not None and state[0] == 0 and state[1] and "first:" in state[1], state
    for i, ((loss_e, grads_e, off_e), (loss_f, grads_f, off_f)) in enumerate(zip(eager, failed)):
        assert off_f == off_e, i
        assert torch.equal(loss_f, loss_e), i
        assert set(grads_f) == set(grads_e) and all(torch.equal(grads_f[n], g) for n, g in grads_e.items()), i


def test_describe_failure_names_the_first_error():
    try:
        try:
            raise RuntimeError("operation not permitted when stream is capturing")
        finally:
            raise RuntimeError("operation failed due to a previous error during capture")
    except RuntimeError as exc:
        text = cuda_graphs._describe_failure(exc)
    assert text == ("RuntimeError: operation failed due to a previous error during capture; "
                    "first: RuntimeError: operation not permitted when stream is capturing")
    assert cuda_graphs._describe_failure(ValueError("x")) == "ValueError: x"


def test_predicted_buckets_from_row_lengths():
    """lengths.predicted_buckets: the buckets most simulated runs meet, from the row lengths
    alone, with a generator of its own (the global ones do not move)."""
    import random

    from solution.step import lengths

    rows = [100] * 200 + [400] * 56  # most batches of 4 hold 400-700 tokens
    prof = lengths.LengthProfile(tuple(rows), batch=4, steps=64)
    state = (random.getstate(), torch.random.get_rng_state())
    buckets = lengths.predicted_buckets(prof, lambda t: cuda_graphs.bucketed_tokens(t, 128))
    assert random.getstate() == state[0] and torch.equal(torch.random.get_rng_state(), state[1])
    assert buckets == sorted(buckets) and {512, 768} <= set(buckets)  # 400 (4 short rows), 700 (one long)
    assert 1664 not in buckets  # four long rows: 1600 tokens, in few runs
    assert buckets == lengths.predicted_buckets(prof, lambda t: cuda_graphs.bucketed_tokens(t, 128))  # seeded
    # every batch 4 x 512 (rows over max_length, truncated by the profile): one bucket
    long = lengths.note([900] * 256, batch=4, steps=64, max_length=512)
    assert lengths.predicted_buckets(long, lambda t: cuda_graphs.bucketed_tokens(t, 128)) == [2176]
    assert lengths.note([], batch=4, steps=64) is None and lengths.note([5], batch=0, steps=1) is None
    lengths.clear()
    assert lengths.profile() is None


def test_trainer_lengths_reads_the_profile_and_changes_nothing():
    """patches/trainer_lengths.profile_of: the dataset's row lengths, batch and batches to run;
    nothing for a dataset without input_ids or with length-grouped sampling."""
    from types import SimpleNamespace

    from solution.patches import trainer_lengths
    from solution.step import lengths

    args = SimpleNamespace(per_device_train_batch_size=4, max_steps=-1, num_train_epochs=1.0,
                           gradient_accumulation_steps=1, max_length=512, group_by_length=False)
    rows = {"input_ids": [[1] * n for n in (10, 600, 30, 40, 50)]}
    prof = trainer_lengths.profile_of(SimpleNamespace(args=args, train_dataset=_Rows(rows)))
    assert prof.lengths == (10, 512, 30, 40, 50) and prof.batch == 4 and prof.steps == 2
    args.max_steps = 7
    assert trainer_lengths.profile_of(SimpleNamespace(args=args, train_dataset=_Rows(rows))).steps == 7
    assert trainer_lengths.profile_of(SimpleNamespace(args=args, train_dataset=_Rows({"text": ["a"]}))) is None
    args.group_by_length = True
    assert trainer_lengths.profile_of(SimpleNamespace(args=args, train_dataset=_Rows(rows))) is None
    lengths.clear()


class _Rows:
    """A stand-in for a datasets.Dataset: len() and column access."""

    def __init__(self, columns):
        self.columns = columns

    def __len__(self):
        return len(next(iter(self.columns.values())))

    def __getitem__(self, name):
        return self.columns[name]


def test_settle_precompile_waits_for_the_in_process_preload_only(monkeypatch):
    """Before the first probe sample the precompile's in-process preload is waited for (bounded),
    so it cannot void the sample; nothing is waited for when no precompile runs, nor while only
    its compile processes run (they do not void a sample)."""
    import threading
    import time

    from solution import precompile

    monkeypatch.setattr(precompile, "_thread", None)
    assert graph_decision.settle_precompile() == 0.0
    monkeypatch.setattr(precompile, "STATE", {"preload_started_t": None, "finished_t": None})
    workers = threading.Thread(target=lambda: time.sleep(0.3))
    monkeypatch.setattr(precompile, "_thread", workers)
    workers.start()
    assert graph_decision.settle_precompile(timeout=5.0) == 0.0 and precompile.running()  # compile processes only
    workers.join()
    done = threading.Event()
    preload = threading.Thread(target=lambda: (time.sleep(0.2), done.set()))
    monkeypatch.setattr(precompile, "_thread", preload)
    precompile.STATE["preload_started_t"] = time.perf_counter()
    preload.start()
    waited = graph_decision.settle_precompile(timeout=5.0)
    assert done.is_set() and waited >= 0.1 and not precompile.running()
    slow = threading.Thread(target=lambda: time.sleep(1.0))
    monkeypatch.setattr(precompile, "_thread", slow)
    slow.start()
    assert graph_decision.settle_precompile(timeout=0.05) < 0.5  # bounded: a stuck preload is not waited out
    slow.join()
