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
    assert Settings() == Settings(memory_policy="speed", cuda_graphs="auto", graph_bucket=256,
                                  skip_patches=frozenset(), **{field: default for field, default in FLAGS.values()})


def test_at_most_six_settings_and_no_other_solution_variable_is_read():
    """Six $SOLUTION_* variables in all (settings.ALL_ENV), each a Settings field or the auto-apply
    switch; no file under solution/ names another $SOLUTION_* variable."""
    import dataclasses

    assert len(settings.ALL_ENV) == len(set(settings.ALL_ENV)) <= 6
    fields = {f.name for f in dataclasses.fields(Settings)}
    assert len(fields) == len(settings.ALL_ENV) - 1  # every variable but the auto-apply switch is a field
    named = set()
    for path in sorted(SOLUTION_DIR.rglob("*.py")):
        named |= set(re.findall(r"\bSOLUTION_[A-Z_]+\b", path.read_text(encoding="utf-8")))
    assert named <= set(settings.ALL_ENV), sorted(named - set(settings.ALL_ENV))


def test_from_env_reads_every_value():
    env = {"SOLUTION_MEMORY_POLICY": " Balanced ", "SOLUTION_CUDA_GRAPHS": " 1 ", "SOLUTION_GRAPH_BUCKET": "64",
           "SOLUTION_SKIP_PATCHES": " qwen2_mlp, cuda_allocator ,",
           **{name: "off" if default else "yes" for name, (_, default) in FLAGS.items()}}
    s = Settings.from_env(env)
    assert (s.memory_policy, s.cuda_graphs, s.graph_bucket) == ("balanced", "1", 64)
    assert s.skip_patches == {"qwen2_mlp", "cuda_allocator"}
    assert all(getattr(s, field) is not default for field, default in FLAGS.values())


@pytest.mark.parametrize("name, value, message", [
    ("SOLUTION_MEMORY_POLICY", "fast", r"\$SOLUTION_MEMORY_POLICY='fast' is not a memory policy"),
    ("SOLUTION_PRECOMPILE", "maybe", r"\$SOLUTION_PRECOMPILE='maybe' is not an on/off value"),
    ("SOLUTION_CUDA_GRAPHS", "yes", r"\$SOLUTION_CUDA_GRAPHS must be auto, 0 or 1, got 'yes'"),
    ("SOLUTION_GRAPH_BUCKET", "4097", r"\$SOLUTION_GRAPH_BUCKET must be an integer from 1 to 4096"),
    ("SOLUTION_GRAPH_BUCKET", "0", r"\$SOLUTION_GRAPH_BUCKET must be an integer from 1 to 4096"),
    ("SOLUTION_GRAPH_BUCKET", "some", r"\$SOLUTION_GRAPH_BUCKET must be an integer from 1 to 4096"),
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
    from solution.step import cuda_graphs

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SOLUTION_CUDA_GRAPHS", "1")
    solution.revert()
    try:
        solution.apply(verbose=False, settings=Settings(cuda_graphs="0", graph_bucket=32))
        monkeypatch.setenv("SOLUTION_GRAPH_BUCKET", "64")  # after apply(): no effect
        assert (cuda_graphs.mode(), cuda_graphs.bucket_size()) == ("0", 32)
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


def test_apply_says_what_a_skipped_patch_turns_off(monkeypatch, capsys):
    """A patch others depend on, skipped, says what else goes with it; the others' lines do not."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    solution.revert()
    try:
        solution.apply(verbose=False, settings=Settings(skip_patches={"qwen2_unpad", "qwen2_layer_node", "trainer_flops"}))
        out = capsys.readouterr().out
    finally:
        solution.revert()
    said = {line.split(":")[0]: line for line in out.splitlines() if line.startswith("[solution] skip ")}
    assert "this also turns off the packed step" in said["[solution] skip qwen2_unpad"]
    assert "decoder CUDA graphs" in said["[solution] skip qwen2_unpad"]
    assert "this also turns off the packed step" in said["[solution] skip qwen2_layer_node"]
    assert said["[solution] skip trainer_flops"].endswith("(stock path kept)")
