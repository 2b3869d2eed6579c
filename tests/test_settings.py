"""solution/settings.py: the settings read once, validated, passed down; the only reader of the
environment in solution/."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import solution
from solution import settings
from solution.settings import FLAGS, Settings

SOLUTION_DIR = Path(solution.__file__).resolve().parent


def test_defaults_are_an_empty_environment():
    assert Settings.from_env({}) == Settings()
    assert Settings() == Settings(memory_policy="speed", cuda_graphs="auto", graph_bucket=256, eager_bucket="auto",
                                  skip_patches=frozenset(), precompile_manifest=None,
                                  **{field: default for field, default in FLAGS.values()})


def test_from_env_reads_every_value():
    env = {"SOLUTION_MEMORY_POLICY": " Balanced ", "SOLUTION_CUDA_GRAPHS": " 1 ", "SOLUTION_GRAPH_BUCKET": "64",
           "SOLUTION_EAGER_BUCKET": " 128 ",
           "SOLUTION_SKIP_PATCHES": " qwen2_mlp, cuda_allocator ,", "SOLUTION_PRECOMPILE_MANIFEST": "/tmp/m.json",
           **{name: "off" if default else "yes" for name, (_, default) in FLAGS.items()}}
    s = Settings.from_env(env)
    assert (s.memory_policy, s.cuda_graphs, s.graph_bucket, s.eager_bucket) == ("balanced", "1", 64, 128)
    assert Settings.from_env({"SOLUTION_EAGER_BUCKET": "0"}).eager_bucket == 0
    assert Settings.from_env({"SOLUTION_EAGER_BUCKET": " Auto "}).eager_bucket == "auto"
    with pytest.raises(ValueError, match="expected \"auto\", 0 \\(off\\)"):
        Settings(eager_bucket="128")  # a token count is an int; the only text is "auto"
    assert s.skip_patches == {"qwen2_mlp", "cuda_allocator"} and s.precompile_manifest == Path("/tmp/m.json")
    assert all(getattr(s, field) is not default for field, default in FLAGS.values())


@pytest.mark.parametrize("name, value, message", [
    ("SOLUTION_MEMORY_POLICY", "fast", r"\$SOLUTION_MEMORY_POLICY='fast' is not a memory policy"),
    ("SOLUTION_ATTN_VARLEN", "maybe", r"\$SOLUTION_ATTN_VARLEN='maybe' is not an on/off value"),
    ("SOLUTION_CUDA_GRAPHS", "yes", r"\$SOLUTION_CUDA_GRAPHS must be auto, 0 or 1, got 'yes'"),
    ("SOLUTION_GRAPH_BUCKET", "4097", r"\$SOLUTION_GRAPH_BUCKET must be an integer from 1 to 4096"),
    ("SOLUTION_GRAPH_BUCKET", "0", r"\$SOLUTION_GRAPH_BUCKET must be an integer from 1 to 4096"),
    ("SOLUTION_EAGER_BUCKET", "-1", r"\$SOLUTION_EAGER_BUCKET must be auto, 0 \(off\) or an integer from 1 to 4096"),
    ("SOLUTION_EAGER_BUCKET", "some", r"\$SOLUTION_EAGER_BUCKET must be auto, 0 \(off\) or an integer from 1 to 4096"),
])
def test_from_env_refuses_a_bad_value_naming_it(name, value, message):
    with pytest.raises(ValueError, match=message):
        Settings.from_env({name: value})


def test_skip_patches_checked_against_the_known_names():
    assert Settings.from_env({"SOLUTION_SKIP_PATCHES": "typo"}).skip_patches == {"typo"}  # no names given
    with pytest.raises(ValueError, match=r"\$SOLUTION_SKIP_PATCHES='a, typo' names no patch: typo \(known: a, b\)"):
        Settings.from_env({"SOLUTION_SKIP_PATCHES": "a, typo"}, known_patches=["a", "b"])


def test_a_settings_object_is_valid_and_frozen():
    for bad in ({"memory_policy": "fast"}, {"cuda_graphs": "yes"}, {"graph_bucket": 0}, {"graph_bucket": "64"}):
        with pytest.raises(ValueError, match="Settings."):
            Settings(**bad)
    s = Settings(skip_patches={"qwen2_mlp"})
    assert isinstance(s.skip_patches, frozenset)
    with pytest.raises(AttributeError):
        s.precompile = False


def test_apply_passes_its_settings_down_and_reads_the_environment_once(monkeypatch):
    from solution.step import attention, cuda_graphs

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SOLUTION_CUDA_GRAPHS", "1")
    solution.revert()
    try:
        solution.apply(verbose=False, settings=Settings(cuda_graphs="0", graph_bucket=32, attn_varlen=False))
        monkeypatch.setenv("SOLUTION_GRAPH_BUCKET", "64")  # after apply(): no effect
        assert (cuda_graphs.mode(), cuda_graphs.bucket_size(), attention.varlen_enabled()) == ("0", 32, False)
    finally:
        solution.revert()
    assert (cuda_graphs.mode(), cuda_graphs.bucket_size()) == ("1", 64)  # no settings active: the environment
    try:
        solution.apply(verbose=False)
        monkeypatch.setenv("SOLUTION_CUDA_GRAPHS", "0")
        assert settings.current() == Settings(cuda_graphs="1", graph_bucket=64)
    finally:
        solution.revert()


def test_apply_refuses_unknown_patch_names_in_given_settings():
    solution.revert()
    with pytest.raises(ValueError, match="names no patch: nope"):
        solution.apply(verbose=False, settings=Settings(skip_patches={"nope"}))
    assert solution.installed() == {}


def test_only_settings_reads_the_environment_and_no_kernel_reads_the_settings():
    readers = re.compile(r"os\.environ|os\.getenv|getenv\(")
    for path in sorted(SOLUTION_DIR.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if path.name != "settings.py":
            assert not readers.search(text), path
        if path.parent.name == "kernels":  # constants such as MEMORY_POLICIES may come from there
            assert not re.search(r"from solution import settings|settings\.current|\bcurrent\(", text), path


@pytest.mark.parametrize("graphs", ["auto", "0"])
@pytest.mark.parametrize("layout, varlen", [(True, True), (True, False), (False, True), (False, False)])
def test_apply_says_what_a_setting_turns_off(monkeypatch, capsys, layout, varlen, graphs):
    """A setting that turns another feature off says so in apply()'s line for it, always (not only
    when verbose), and says exactly what the code then does: the attention layout kernels off also
    turn variable-length attention off, and attention on the padded layout is a reason for the
    decoder CUDA graphs' refusal (cuda_graphs.refusal, asked here as for a CUDA forward)."""
    from types import SimpleNamespace

    import torch

    from solution.step import attention, cuda_graphs

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # no CUDA here: not capturing
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    cuda_ids = SimpleNamespace(device=torch.device("cuda"))
    solution.revert()
    try:
        solution.apply(verbose=False, settings=Settings(attn_layout_kernels=layout, attn_varlen=varlen,
                                                        cuda_graphs=graphs))
        out = capsys.readouterr().out
        varlen_runs = attention.layout_kernels_enabled() and attention.varlen_enabled()
        refused = cuda_graphs.refusal(model, cuda_ids, {})
    finally:
        solution.revert()
    lines = [line for line in out.splitlines() if "$SOLUTION_ATTN_" in line]
    assert [line.split(":")[0] for line in lines] == (
        ["[solution] $SOLUTION_ATTN_LAYOUT_KERNELS=0"] * (not layout) + ["[solution] $SOLUTION_ATTN_VARLEN=0"] * (not varlen))
    assert varlen_runs == (layout and varlen)
    assert ("also turns off variable-length attention" in out) == (not layout)
    graphs_said_off = "the decoder CUDA graphs (a graph replays" in out
    if graphs == "0":
        assert refused == "$SOLUTION_CUDA_GRAPHS is 0" and not graphs_said_off
        assert ("off anyway" in out) == (not varlen_runs)
    else:
        assert (refused is not None) == graphs_said_off == (not varlen_runs)
        assert "off anyway" not in out


def test_apply_says_what_a_skipped_patch_turns_off(monkeypatch, capsys):
    """A patch others depend on, skipped, says what else goes with it; the others' lines do not."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    solution.revert()
    try:
        solution.apply(verbose=False, settings=Settings(skip_patches={"qwen2_unpad", "peft_lora_bnb4bit", "qwen2_rope"}))
        out = capsys.readouterr().out
    finally:
        solution.revert()
    said = {line.split(":")[0]: line for line in out.splitlines() if line.startswith("[solution] skip ")}
    assert "this also turns off the packed step" in said["[solution] skip qwen2_unpad"]
    assert "decoder CUDA graphs" in said["[solution] skip qwen2_unpad"]
    assert "graphs when LoRA dropout is > 0" in said["[solution] skip peft_lora_bnb4bit"]
    assert said["[solution] skip qwen2_rope"].endswith("(stock path kept)")


def test_eager_bucket_said_to_have_no_effect_on_the_padded_layout():
    from solution.settings import cross_effects

    assert cross_effects(Settings(eager_bucket=128)) == []
    assert cross_effects(Settings(eager_bucket=0, attn_varlen=False))[-1].startswith("$SOLUTION_ATTN_VARLEN=0")
    # "auto" (the default) asks for nothing: on the padded layout it simply never buckets, unsaid
    assert cross_effects(Settings(attn_varlen=False))[-1].startswith("$SOLUTION_ATTN_VARLEN=0")
    for off in ({"attn_varlen": False}, {"attn_layout_kernels": False}):
        line = cross_effects(Settings(eager_bucket=128, **off))[-1]
        assert line.startswith("$SOLUTION_EAGER_BUCKET=128 has no effect: attention runs on the padded layout")
