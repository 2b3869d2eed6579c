"""bench/partition.py: every CUDA stream of a run in one green context of N SMs.

On the CPU: the stream constructor's replacement with fakes (which constructions it serves from
the partition, which it passes on, isinstance, the swap and its undo), the held-check's verdict,
the report's lines, and the one-line refusal without a GPU. On a GPU (@pytest.mark.gpu): a real
16-SM partition, every path timed, and the constructor put back."""
from types import SimpleNamespace

import pytest

from bench import partition


class FakeStream:
    """The shape of torch.cuda.Stream's constructor: (device=None, priority=0, **kwargs)."""

    def __new__(cls, device=None, priority=0, **kwargs):
        obj = super().__new__(cls)
        obj.args = (device, priority, kwargs)
        return obj


def _device_index(device):
    return 0 if device in (None, 0, "cuda", "cuda:0") else int(str(device)[-1])


def _partition_class():
    made, ids = [], iter(range(100, 200))
    cls = partition.partition_stream_class(FakeStream, lambda: FakeStream(stream_id=next(ids)), _device_index, 0, made)
    return cls, made


def test_plain_constructions_come_from_the_partition():
    cls, made = _partition_class()
    a, b, c = cls(), cls(device="cuda:0"), cls(device=0, priority=-1)  # as solution/step/cuda_graphs.py makes one
    assert made == [a, b, c] and [s.args[2]["stream_id"] for s in made] == [100, 101, 102]
    assert all(type(s) is FakeStream for s in made)


def test_wrapping_constructions_and_other_devices_are_the_originals():
    cls, made = _partition_class()
    wrapped = cls(stream_id=7, device_index=0, device_type=1)  # as torch.cuda.current_stream() builds its answer
    other = cls(device="cuda:1")
    assert made == [] and wrapped.args == (None, 0, {"stream_id": 7, "device_index": 0, "device_type": 1})
    assert other.args == ("cuda:1", 0, {})


def test_isinstance_answers_as_for_the_original_class():
    cls, _ = _partition_class()
    assert isinstance(FakeStream(), cls) and isinstance(cls(), cls) and issubclass(FakeStream, cls)
    assert not isinstance(object(), cls) and not issubclass(int, cls) and issubclass(cls, FakeStream)


def test_the_swap_covers_every_module_that_holds_the_class_and_is_undone():
    cls, _ = _partition_class()
    cuda, streams, unrelated = (SimpleNamespace(Stream=FakeStream), SimpleNamespace(Stream=FakeStream),
                                SimpleNamespace(Stream=int))
    restore = partition.swap_stream_class((cuda, streams, unrelated), FakeStream, cls)
    assert cuda.Stream is cls and streams.Stream is cls and unrelated.Stream is int
    restore()
    assert cuda.Stream is FakeStream and streams.Stream is FakeStream and unrelated.Stream is int


def test_held_means_nearer_n_over_sms_than_the_whole_gpu():
    whole = 660.0
    paths = {"current stream": 94.0, "torch.cuda.Stream()": 90.0, "CUDA graph replay": 650.0,
             "autograd backward": 93.0}
    v = partition.judge(paths, whole, num_sms=16, gpu_sms=132)
    assert v["expected_fraction"] == pytest.approx(16 / 132)
    assert v["paths"]["current stream"]["held"] and v["paths"]["autograd backward"]["held"]
    assert not v["paths"]["CUDA graph replay"]["held"] and v["held"] is False  # one escaped: not held
    assert v["paths"]["torch.cuda.Stream()"]["fraction_of_whole"] == pytest.approx(90 / 660)
    assert partition.judge({k: 94.0 for k in paths}, whole, 16, 132)["held"] is True


def _record(held=True):
    paths = {p: (94.0 if held else 650.0) for p in partition.PATHS}
    return {"sms": 16, "gpu_sms": 132, "streams_made": 1,
            "rates": {"whole": {"matmul_tflops": 663.0, "copy_gbs": 3900.0},
                      "partition": {"matmul_tflops": 94.0, "copy_gbs": 1200.0}},
            "held_check": partition.judge(paths, 663.0, 16, 132)}


def test_the_report_lines_state_n_the_rates_and_every_path():
    text = "\n".join(partition.markdown(_record()))
    assert "16 of the GPU's 132 SMs" in text and "| fp16 matmul TFLOP/s | 663 | 94.0 | 0.142 |" in text
    assert "| device copy GB/s | 3900 | 1200 | 0.308 |" in text and "held on every path" in text
    assert all(f"| {p} |" in text for p in partition.PATHS)
    assert "NOT held" in "\n".join(partition.markdown(_record(held=False)))
    assert partition.markdown(None) == [] and partition.markdown({"sms": 16}) == []


def test_without_a_gpu_the_partition_is_refused_in_one_line(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the CPU's answer")
    assert "needs a CUDA GPU" in partition.unsupported(16)
    from bench import run_one

    work = tmp_path / "work"
    rc = run_one.main(["--variant", "baseline", "--model", "m", "--data", "d", "--workdir", str(work), "--sms", "16"])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip() == "error: --sms 16: an SM partition needs a CUDA GPU (this machine has none)"
    assert not work.exists()  # refused before anything was written


@pytest.mark.gpu
def test_a_real_partition_holds_on_every_path_and_is_undone():
    import torch

    why = partition.unsupported(16)
    if why:
        pytest.skip(why)
    orig = torch.cuda.Stream
    part = partition.Partition(16).enter()
    try:
        figures = part.measure()
        side = torch.cuda.Stream(device=torch.device("cuda"))  # the solution's way to a side stream
        assert part.made == [side]
        assert isinstance(torch.cuda.current_stream(), torch.cuda.Stream)
        rates = figures["rates"]
        assert rates["partition"]["matmul_tflops"] < 0.5 * rates["whole"]["matmul_tflops"]
        assert figures["held_check"]["held"], figures["held_check"]
    finally:
        part.exit()
    assert torch.cuda.Stream is orig and torch.cuda.current_stream() == torch.cuda.default_stream()
    assert part.record()["streams_made"] == 1


@pytest.mark.gpu
def test_a_partition_entered_again_keeps_its_green_context_and_holds():
    """bench/run_one.py measures the partition, leaves it, and enters it again when Soup builds its
    Trainer (after the model is loaded: the module docstring of run_one says why)."""
    import torch

    why = partition.unsupported(16)
    if why:
        pytest.skip(why)
    part = partition.Partition(16).enter()
    try:
        part.measure()
    finally:
        part.exit()
    ctx, first = part.ctx, part.stream
    assert not part.entered
    part.enter()
    try:
        assert part.entered and part.ctx is ctx and part.stream is not first
        assert torch.cuda.current_stream() == part.stream
        whole = partition.rates(torch.cuda.default_stream())["matmul_tflops"]
        inside = partition.rates(torch.cuda.current_stream())["matmul_tflops"]
        assert inside < 0.5 * whole, (inside, whole)
    finally:
        part.exit()
    assert torch.cuda.current_stream() == torch.cuda.default_stream()


def test_run_one_enters_the_partition_as_the_trainer_is_built(monkeypatch):
    """install_clock's ``on_trainer`` runs before each Trainer's __init__ (bench/run_one.py enters
    the SM partition there, after Soup loaded the model), and install_clock's undo puts __init__ back."""
    import types

    import transformers

    from bench import run_one

    calls = []

    def fake_init(self, *a, **kw):  # stands for the real __init__ (install_clock wraps what it finds)
        calls.append("init")

    trainer_cls = transformers.Trainer
    monkeypatch.setattr(trainer_cls, "__init__", fake_init)
    clock = types.SimpleNamespace(callback=object(), host_split=None, trainer=None, linear4bit_layers=None)
    undo = run_one.install_clock(clock, on_trainer=lambda: calls.append("enter"))
    trainer = types.SimpleNamespace(model=None, add_callback=lambda cb: calls.append("callback"))
    trainer_cls.__init__(trainer)
    assert calls == ["enter", "init", "callback"] and clock.trainer is trainer
    undo()
    calls.clear()
    trainer_cls.__init__(trainer)
    assert calls == ["init"]
