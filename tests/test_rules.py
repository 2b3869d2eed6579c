"""bench.rules' run checks on fake results (no training): each comparison passes on results within
its tolerance and fails on results just outside it, and bench.run_one records what they compare
(the GradScaler's decisions through accelerate, rewind.jsonl's rows)."""
import copy
import json
import math
from types import SimpleNamespace

import pytest

from bench import rules
from bench.run_one import StepClock, read_rewind, scaler_state

STEPS = 6
LOSSES = [2.0, 1.9, 1.8, 1.75, 1.7, 1.65]


def fake_result(variant="baseline", steps=STEPS, skipped=(), scales=True):
    """A bench.run_one result.json as Soup / trl / transformers fill it on an fp16 run: every per-step
    log key, the closing row, the GradScaler's record and rewind.jsonl (header + one row a step, 4
    dataset rows each)."""
    logs, scale, lr, tokens, out_scales = [], 65536.0, 2e-4, 0, []
    for i in range(steps):
        step, skip = i + 1, i + 1 in skipped
        tokens += 100 + 7 * i
        logs.append({"step": step, "loss": LOSSES[i % len(LOSSES)], "grad_norm": math.nan if skip else 0.5 + 0.01 * i,
                     "learning_rate": lr, "epoch": step / steps, "entropy": 1.2 - 0.01 * i, "num_tokens": float(tokens),
                     "mean_token_accuracy": 0.4 + 0.01 * i})
        if skip:
            scale /= 2
        else:
            lr *= 0.9
        out_scales.append(scale)
    logs.append({"step": steps, "train_runtime": 12.5, "train_samples_per_second": 2.0, "train_steps_per_second": 0.5,
                 "total_flos": 1.5e12, "train_loss": sum(LOSSES[:steps]) / steps, "epoch": 1.0})
    rewind = [{"kind": "header", "version": 1, "backend": "transformers", "task": "sft", "n_rows": 4 * steps,
               "batch_size": 4, "grad_accum": 1, "dataset_fingerprint": "abc", "created": 1.0}]
    rewind += [{"kind": "batch", "step": i, "micro": 0, "rows": [4 * i + r for r in range(4)],
                "row_loss": [2.0 - 0.1 * r for r in range(4)], "row_tokens": [30 + r for r in range(4)]}
               for i in range(steps)]
    return {"variant": variant, "steps": steps, "trainer_logs": logs, "skipped_steps": list(skipped),
            "scaler_scales": out_scales if scales else None, "outputs": {"rewind": rewind, "rewind_rows": len(rewind)}}


def edited(result, key, fn, steps=None):
    """A copy of ``result`` whose logged ``key`` is fn(value) at ``steps`` (default: every step)."""
    r = copy.deepcopy(result)
    for log in r["trainer_logs"]:
        if key in log and "train_runtime" not in log and (steps is None or log["step"] in steps):
            log[key] = fn(log[key])
    return r


def rows_by_check(base, sol):
    return {r["check"]: r for r in rules.compare_metrics(base, sol)}


def row_for(rows, prefix):
    match = [r for check, r in rows.items() if check.startswith(prefix)]
    assert len(match) == 1, (prefix, list(rows))
    return match[0]


def test_identical_results_pass_every_check():
    base, sol = fake_result(), fake_result("solution")
    rows = rules.compare_metrics(base, sol) + [rules.scaler_row(base, sol), rules.rewind_row(base, sol)]
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    checks = " | ".join(r["check"] for r in rows)
    for key in ("grad_norm", "entropy", "mean_token_accuracy", "learning_rate", "epoch", "num_tokens"):
        assert f"logged metric {key} " in checks  # every key trl / transformers log is compared


# --- the loss curve -------------------------------------------------------------------------------

@pytest.mark.parametrize("factor, ok", [(1 + 1.5e-4, True), (1 + 1.5e-3, False), (1 - 1.5e-3, False),
                                        (1 + 5e-3, False)])
def test_loss_catches_a_systematic_error(factor, ok):
    """0.15% everywhere (within the old 1% max and 0.2% mean) fails; 1.5e-4 passes."""
    base = fake_result()
    assert rules.loss_row(base, edited(base, "loss", lambda v: v * factor))["ok"] is ok


def test_loss_max_and_mean_are_both_checked():
    base = fake_result()
    one_step = edited(base, "loss", lambda v: v * (1 + 9e-4), steps={3})  # max 9e-4, mean 1.5e-4
    assert rules.loss_row(base, one_step)["ok"]
    spike = edited(base, "loss", lambda v: v * (1 + 2e-3), steps={3})  # one step over the max
    assert not rules.loss_row(base, spike)["ok"]
    steady = edited(base, "loss", lambda v: v * (1 + 5e-4))  # max within, mean 5e-4 > 2e-4
    row = rules.loss_row(base, steady)
    assert not row["ok"] and "mean rel diff 5.00e-04" in row["figure"]


def test_loss_non_finite_only_where_the_baseline_is():
    base = edited(fake_result(), "loss", lambda v: math.nan, steps={2})
    assert rules.loss_row(base, copy.deepcopy(base))["ok"]  # NaN at the same step: compared elsewhere
    assert "non-finite at steps 2" in rules.loss_row(base, copy.deepcopy(base))["figure"]
    other = edited(fake_result(), "loss", lambda v: math.nan, steps={3})
    assert not rules.loss_row(base, other)["ok"]


# --- the other per-step metrics -------------------------------------------------------------------

@pytest.mark.parametrize("key, change, ok", [
    ("entropy", lambda v: v * (1 + 5e-4), True),
    ("entropy", lambda v: v * (1 + 2e-3), False),
    ("mean_token_accuracy", lambda v: v + 0.009, True),
    ("mean_token_accuracy", lambda v: v - 0.011, False),
    ("grad_norm", lambda v: v * (1 + 4e-3), True),
    ("grad_norm", lambda v: v * (1 + 1e-2), False),
    ("learning_rate", lambda v: v * (1 + 1e-12), False),  # exact: any difference
    ("epoch", lambda v: v + 1e-9, False),
    ("num_tokens", lambda v: v + 1, False),
])
def test_each_metric_has_its_tolerance(key, change, ok):
    base = fake_result()
    row = row_for(rows_by_check(base, edited(base, key, change)), f"logged metric {key} ")
    assert row["ok"] is ok, row


def test_grad_norm_is_judged_by_its_median():
    base = fake_result()
    one_step = edited(base, "grad_norm", lambda v: v * 1.5, steps={4})  # one step 50% off: median 0
    assert row_for(rows_by_check(base, one_step), "logged metric grad_norm ")["ok"]
    half = edited(base, "grad_norm", lambda v: v * 1.01, steps={1, 2, 3, 4})
    assert not row_for(rows_by_check(base, half), "logged metric grad_norm ")["ok"]


def test_a_skipped_step_s_nan_grad_norm_must_be_the_baseline_s():
    base, sol = fake_result(skipped=(1,)), fake_result("solution", skipped=(1,))
    assert row_for(rows_by_check(base, sol), "logged metric grad_norm ")["ok"]
    other = fake_result("solution", skipped=(2,))
    assert not row_for(rows_by_check(base, other), "logged metric grad_norm ")["ok"]


def test_every_step_non_finite_in_both_is_compared_as_equal():
    """A run whose every step overflowed (every grad norm NaN in both) has nothing finite to compare:
    it passes on the non-finite pattern alone; a run with no step in common fails."""
    base = fake_result(skipped=tuple(range(1, STEPS + 1)))
    assert row_for(rows_by_check(base, copy.deepcopy(base)), "logged metric grad_norm ")["ok"]
    empty = copy.deepcopy(base)
    empty["trainer_logs"] = []
    assert not rules.loss_row(base, empty)["ok"]


def test_a_metric_logged_by_one_run_only_fails():
    base = fake_result()
    sol = copy.deepcopy(base)
    for log in sol["trainer_logs"]:
        log.pop("entropy", None)
    rows = rows_by_check(base, sol)
    assert not row_for(rows, "the solution logs the baseline's metrics")["ok"]
    assert not row_for(rows, "logged metric entropy ")["ok"]


def test_an_unknown_logged_metric_is_compared_too():
    base = fake_result()
    for log in base["trainer_logs"]:
        log["aux_loss"] = 0.25
    near, far = edited(base, "aux_loss", lambda v: v * (1 + 5e-4)), edited(base, "aux_loss", lambda v: v * 1.01)
    assert row_for(rows_by_check(base, near), "logged metric aux_loss ")["ok"]
    assert not row_for(rows_by_check(base, far), "logged metric aux_loss ")["ok"]


def test_closing_row_compares_values_not_timings():
    base = fake_result()
    sol = copy.deepcopy(base)
    final = sol["trainer_logs"][-1]
    final.update(train_runtime=3.0, train_samples_per_second=9.0, train_steps_per_second=2.0)
    assert rules.final_row(base, sol)["ok"]
    final["total_flos"] += 1
    assert not rules.final_row(base, sol)["ok"]
    sol = copy.deepcopy(base)
    sol["trainer_logs"][-1]["train_loss"] *= 1.01
    assert "train_loss" in rules.final_row(base, sol)["figure"] and not rules.final_row(base, sol)["ok"]


# --- the GradScaler -------------------------------------------------------------------------------

def test_scaler_same_skipped_steps_and_scales_pass():
    row = rules.scaler_row(fake_result(skipped=(1, 2)), fake_result("solution", skipped=(1, 2)))
    assert row["ok"] and "skipped steps 1, 2" in row["figure"] and "16384.0" in row["figure"]


def test_scaler_other_skipped_steps_fail():
    row = rules.scaler_row(fake_result(skipped=(1,)), fake_result("solution", skipped=(1, 4)))
    assert not row["ok"] and "skipped steps 1 vs 1, 4" in row["figure"]
    row = rules.scaler_row(fake_result(skipped=(1,)), fake_result("solution"))
    assert not row["ok"] and "vs none" in row["figure"]


def test_scaler_other_scales_fail_even_with_the_same_skips():
    base, sol = fake_result(skipped=(2,)), fake_result("solution", skipped=(2,))
    sol["scaler_scales"][3] = 65536.0
    row = rules.scaler_row(base, sol)
    assert not row["ok"] and "scales differ from step 4" in row["figure"]


def test_scaler_not_recorded_fails_and_no_scaler_passes():
    base = fake_result()
    old = copy.deepcopy(base)
    del old["skipped_steps"]
    assert not rules.scaler_row(base, old)["ok"]
    fp32 = fake_result(scales=False)
    row = rules.scaler_row(fp32, copy.deepcopy(fp32))
    assert row["ok"] and "no GradScaler" in row["figure"]


# --- rewind.jsonl ---------------------------------------------------------------------------------

def _rewind_edit(fn):
    sol = fake_result("solution")
    fn(sol["outputs"]["rewind"])
    return sol


@pytest.mark.parametrize("edit, ok, says", [
    (lambda rw: rw[0].update(created=99.0), True, "7 rows, 24 row losses"),  # a timestamp
    (lambda rw: rw[3]["row_loss"].__setitem__(1, rw[3]["row_loss"][1] * (1 + 5e-4)), True, "max rel diff 5.00e-04"),
    (lambda rw: rw[3]["row_loss"].__setitem__(1, rw[3]["row_loss"][1] * (1 + 2e-3)), False, "per-row loss max rel"),
    (lambda rw: rw[3]["row_loss"].__setitem__(1, None), False, "non-finite at other places"),
    (lambda rw: rw[2]["rows"].reverse(), False, "rows differ"),
    (lambda rw: rw[2]["row_tokens"].__setitem__(0, 31), False, "row_tokens differ"),
    (lambda rw: rw[0].update(dataset_fingerprint="xyz"), False, "header differs"),
    (lambda rw: rw.pop(), False, "6 rows, the baseline's 7"),
])
def test_rewind_is_compared_row_by_row(edit, ok, says):
    row = rules.rewind_row(fake_result(), _rewind_edit(edit))
    assert row["ok"] is ok and says in row["figure"], row


def test_rewind_values_not_recorded_fail():
    sol = fake_result("solution")
    del sol["outputs"]["rewind"]
    assert not rules.rewind_row(fake_result(), sol)["ok"]


# --- a whole report, with another run ------------------------------------------------------------

def _report(other_sol):
    base = fake_result()
    return {"workload": {"steps": STEPS}, "baseline": base, "solution": fake_result("solution"),
            "own_kernels_ran": ["k"], "own_kernel_share": 0.1,
            "shape_runs": {"outliers": {"baseline": fake_result(skipped=(1,)), "solution": other_sol}}}


def test_every_run_of_a_report_is_judged():
    rows = {r["check"]: r for r in rules.check_run(_report(fake_result("solution", skipped=(1,))))}
    scaler = "GradScaler: the same skipped optimizer steps and the same scale after each step"
    assert rows[scaler]["ok"] and rows[f"outliers: {scaler}"]["ok"]
    assert rows["outliers: every other logged metric and rewind.jsonl as the baseline's"]["ok"]
    rows = {r["check"]: r for r in rules.check_run(_report(fake_result("solution")))}
    assert not rows[f"outliers: {scaler}"]["ok"]  # stock skipped step 1, the solution did not
    bad = edited(fake_result("solution", skipped=(1,)), "entropy", lambda v: v * 1.01)
    rows = {r["check"]: r for r in rules.check_run(_report(bad))}
    other = rows["outliers: every other logged metric and rewind.jsonl as the baseline's"]
    assert not other["ok"] and "logged metric entropy" in other["figure"]


# --- what bench.run_one records -------------------------------------------------------------------

def test_run_one_records_accelerate_s_skipped_steps_and_scales():
    """accelerate's AcceleratedOptimizer over a real torch GradScaler (on the CPU): a step with an
    inf gradient is recorded as skipped, and the scale after it is halved."""
    torch = pytest.importorskip("torch")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    # accelerate keeps one process-wide state: an earlier test in this process (a GPU machine runs
    # Soup in-process) may have made it a CUDA one, which Accelerator(cpu=True) refuses to change
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        _check_scaler_records(Accelerator(cpu=True), torch)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def _check_scaler_records(acc, torch):
    """One optimizer over a CPU GradScaler through ``acc``: steps 2 (inf) and 4 (NaN) skipped."""
    from accelerate.optimizer import AcceleratedOptimizer

    p = torch.nn.Parameter(torch.ones(3))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    opt = AcceleratedOptimizer(torch.optim.SGD([p], lr=0.1), device_placement=False, scaler=scaler)
    acc.scaler, acc._optimizers = scaler, [opt]
    clock = StepClock(profile=False)
    clock.trainer = SimpleNamespace(accelerator=acc)
    for step, g in enumerate((1.0, math.inf, 1.0, math.nan), 1):
        opt.zero_grad()
        scaler.scale((p * g).sum()).backward()
        opt.step()
        clock.note_scaler(step)
    assert clock.skipped_steps == [2, 4]
    assert clock.scaler_scales == [1024.0, 512.0, 512.0, 256.0]
    assert scaler_state(SimpleNamespace(accelerator=SimpleNamespace(scaler=None))) == (False, None)


def test_run_one_reads_rewind_rows(tmp_path):
    path = tmp_path / "rewind.jsonl"
    assert read_rewind(path) is None
    path.write_text(json.dumps({"kind": "header"}) + "\n\n" + json.dumps({"kind": "batch", "row_loss": [None]})
                    + "\n{cut\n", encoding="utf-8")
    assert read_rewind(path) == [{"kind": "header"}, {"kind": "batch", "row_loss": [None]},
                                 {"kind": "unreadable", "text": "{cut"}]
