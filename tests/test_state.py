"""solution/state.py: one registry of the process state that revert() clears (plans, caches,
decisions), so that revert() then apply(settings=...) on the same model starts afresh and no
solution object stays reachable from the model through them."""
from __future__ import annotations

import gc
import re
import weakref
from pathlib import Path

import pytest
import torch

import solution
from solution import state

SOLUTION_DIR = Path(solution.__file__).resolve().parent


def test_clear_empties_every_kept_container_and_runs_every_reset():
    d, s, w = state.kept({}), state.kept(set()), state.kept(weakref.WeakKeyDictionary())
    key = torch.nn.Linear(1, 1)
    d[1], w[key] = 2, 3
    s.add(4)
    ran = []
    state.on_clear(lambda: ran.append(True))
    state.clear()
    assert not d and not s and not len(w) and ran == [True]


def test_every_module_level_cache_outside_the_kernels_is_kept():
    """A module-level dict / set / list / weak dictionary under solution/ (outside kernels/, whose
    caches depend only on a device and a dtype) is created through state.kept(...): none that
    revert() would leave behind. Constants (tuples, frozensets, names in capitals without a
    leading underscore) are not state. Left out on purpose: state.py's own registry, and the
    auto-apply hook's once-per-process guard (revert() must not make the hook apply again)."""
    not_state = {"state.py: _KEPT", "state.py: _RESETS", "autoapply.py: _APPLIED"}
    pattern = re.compile(r"^(_[A-Z0-9_]+)\s*(?::[^=]+)?=\s*(.+)$")
    mutable = re.compile(r"^(\{\}|set\(\)|\[\]|dict\(\)|weakref\.WeakKeyDictionary\(\)|weakref\.WeakValueDictionary\(\))")
    missed = []
    for path in sorted(SOLUTION_DIR.rglob("*.py")):
        if path.parent.name == "kernels":
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            m = pattern.match(line)
            where = f"{path.relative_to(SOLUTION_DIR)}: {m.group(1)}" if m else ""
            if m and where not in not_state and mutable.match(m.group(2).split("#")[0].strip()):
                missed.append(f"{path.relative_to(SOLUTION_DIR)}: {line.strip()}")
    assert not missed, missed


def test_revert_forgets_the_attention_refusal_and_the_said_lines(monkeypatch, capsys):
    from solution.say import say_once
    from solution.step import attention

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    solution.revert()
    solution.apply(verbose=False)
    try:
        attention._varlen_failed(RuntimeError("refused"))
        say_once("said once")
        assert not attention.varlen_enabled()
    finally:
        solution.revert()
    assert attention.varlen_enabled()
    say_once("said once")
    assert capsys.readouterr().out.count("said once") == 2


def _solution_objects_reachable_from(model) -> list[str]:
    """Objects whose class is defined in solution/ that the model's modules hold (their __dict__,
    their parameters' and buffers' attributes, and whatever those hold, a few levels deep)."""
    seen, found, frontier = set(), [], [m for m in model.modules()]
    for _ in range(4):
        nxt = []
        for obj in frontier:
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            mod = getattr(type(obj), "__module__", "") or ""
            if mod.startswith("solution"):
                found.append(f"{type(obj).__module__}.{type(obj).__qualname__}")
                continue
            if isinstance(obj, (str, bytes, int, float, bool, type(None), torch.dtype, torch.device)):
                continue
            nxt.extend(gc.get_referents(obj))
        frontier = nxt
    return found


@pytest.mark.gpu
def test_revert_then_apply_with_other_settings_uses_them_gpu(device, tmp_path):
    """apply() with the speed policy, two training steps, revert(), apply() with the memory policy
    on the same model: the layer plans are built again with the memory policy; after the last
    revert() no solution object is reachable from the model or its modules."""
    if device != "cuda":
        pytest.skip("bitsandbytes 4-bit needs CUDA")
    from solution import Settings
    from solution.patches.qwen2_lm_head_loss import fused_lm_head_requested
    from solution.step import layer as layer_node
    from tests.test_unpad import _right_padded_batch, qlora_tiny_model
    from workload.model_standin import write_standin

    model_dir = write_standin(tmp_path / "tiny", size="tiny")
    ids, mask, labels = _right_padded_batch([40, 17, 64, 9], 64, vocab=100, device="cuda")
    solution.revert()
    model = qlora_tiny_model(model_dir)
    policies = []

    def steps(n: int) -> None:
        for _ in range(n):
            with torch.autocast("cuda", dtype=torch.float16), fused_lm_head_requested():
                out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
            out.loss.backward()
            model.zero_grad(set_to_none=True)
        plans = [p for p in layer_node._PLANS.values() if isinstance(p, layer_node.LayerPlan)]
        assert plans, "the layer node ran no layer"
        policies.append({p.policy for p in plans})

    try:
        solution.apply(verbose=False, settings=Settings(memory_policy="speed"))
        steps(2)
        solution.revert()
        assert not len(layer_node._PLANS)
        solution.apply(verbose=False, settings=Settings(memory_policy="memory"))
        steps(1)
    finally:
        solution.revert()
    assert policies == [{"speed"}, {"memory"}]
    gc.collect()
    assert _solution_objects_reachable_from(model) == []
