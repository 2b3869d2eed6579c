"""bench/pairs.py: the order of paired timings and what the pairs say (CPU, no torch)."""
import pytest

from bench import pairs


def test_order_alternates_the_arm_that_runs_first():
    assert [pairs.order(i) for i in range(4)] == [(True, False), (False, True), (True, False), (False, True)]


def test_a_linear_drift_cancels_over_alternating_pairs():
    # each timing = its setting's true cost + a drift growing by 1 ms a timing; "on" costs 0.5 ms less
    on, off, t = [], [], 0
    for i in range(20):
        for state in pairs.order(i):
            (on if state else off).append((10.0 if state else 10.5) + t)
            t += 1
    s = pairs.summary(on, off)
    # on-first pairs read -1.5 (the drift added to "off"), off-first pairs +0.5: the median of the
    # differences is the true -0.5, where always running "on" first would read -1.5 in every pair
    assert s["diff"] == pytest.approx(-0.5)
    assert (s["q1"], s["q3"]) == (pytest.approx(-1.5), pytest.approx(0.5))


def test_summary_figures():
    on = [10.0, 11.0, 9.0, 10.0, 12.0]
    off = [10.5, 11.2, 9.9, 10.1, 11.0]
    s = pairs.summary(on, off)
    assert s["on"] == 10.0 and s["off"] == 10.5
    assert s["diff"] == pytest.approx(-0.2)
    assert s["n"] == 5 and s["on_faster"] == 4
    assert s["q1"] <= s["diff"] <= s["q3"]


def test_summary_with_few_pairs():
    s = pairs.summary([1.0, 2.0], [2.0, 2.5])
    assert s["n"] == 2 and s["on_faster"] == 2 and s["q1"] == -1.0 and s["q3"] == -0.5
    s = pairs.summary([1.0], [3.0])
    assert s["q1"] == s["q3"] == s["diff"] == -2.0


@pytest.mark.parametrize("on,off", [([], []), ([1.0], [1.0, 2.0])])
def test_summary_refuses_unmatched_pairs(on, off):
    with pytest.raises(ValueError, match="pairs"):
        pairs.summary(on, off)


def test_verdict_needs_both_quartiles_on_one_side():
    assert pairs.verdict({"q1": -0.5, "q3": -0.1}) == "on faster"
    assert pairs.verdict({"q1": 0.1, "q3": 0.7}) == "on slower"
    assert pairs.verdict({"q1": -0.3, "q3": 0.4}) == "no difference shown"


def test_whole_run_table_reads_the_committed_levers_file():
    """The committed whole-run pairs (docs/runs/levers-*.json) render as one row per comparison,
    the median of the pairs' differences as off - default, with the verdict in the off arm's terms."""
    import json
    from pathlib import Path

    from bench.pairs import whole_run_table

    doc = {"comparisons": [{"name": "x off", "where": "here", "off": ["o1", "o2", "o3"], "default": ["d1", "d2", "d3"],
                            "decision": "removed"}],
           "runs": {"o1": {"steps_3_64_s": 9.0}, "o2": {"steps_3_64_s": 9.5}, "o3": {"steps_3_64_s": 9.8},
                    "d1": {"steps_3_64_s": 10.0}, "d2": {"steps_3_64_s": 10.0}, "d3": {"steps_3_64_s": 10.0}}}
    row = whole_run_table(doc).splitlines()[-1]
    assert row.startswith("| x off | here | 3 | 10.00 | 9.50 | -0.500 s (-5.0%) |") and "| 3 of 3 | off faster | removed |" in row
    for path in sorted(Path(__file__).resolve().parent.parent.glob("docs/runs/levers-*.json")):
        table = whole_run_table(json.loads(path.read_text(encoding="utf-8")))
        assert table.count("\n") >= 3, path
