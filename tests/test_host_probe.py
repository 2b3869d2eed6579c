"""bench/host_probe.py: the host-speed probe every bench.run_one pass records, and its column in
the report."""
from __future__ import annotations

from bench import host_probe, report


def test_the_probe_times_both_operations_on_the_cpu(monkeypatch):
    monkeypatch.setattr(host_probe, "CALLS", 50)
    monkeypatch.setattr(host_probe, "ROUNDS", 3)
    p = host_probe.probe("cpu")
    assert p["device"] == "cpu"
    assert p["empty_us"] > 0 and p["launch_us"] > 0
    assert p["us_per_call"] == (p["empty_us"] + p["launch_us"]) / 2


def test_the_report_takes_the_probe_from_each_pass_and_none_from_older_results():
    assert report.run_figures({"host_probe": {"us_per_call": 7.5}})["host_probe_us"] == 7.5
    assert report.run_figures({})["host_probe_us"] is None  # a result from before the probe
    titles = [t for _, t in report.FIGURES]
    assert "host probe (us a call)" in titles
    assert "host_probe_us" not in report.RATIO_FIGURES  # a host's speed, not a gain
