"""bench/precompile_timing.py: the background precompile's cost on this machine's CPUs, measured without a GPU
(compiles target sm_75), and its one-line refusal of bad arguments."""
from __future__ import annotations

import json

from bench import precompile_timing


def test_times_one_process_in_parts_and_the_precompiles_own_processes(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert precompile_timing.main(["--limit", "2", "--processes", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text(encoding="utf-8"))
    (one,) = res["one_process"]
    assert one["arch"] == 75 and one["entries"] == 2 and len(one["slowest"]) == 2
    parts = one["start_s"] + one["imports_s"] + one["utils_s"] + one["compiles_s"]
    assert 0 <= one["launchers_s"] <= one["compiles_s"]
    assert one["compiles_s"] > 0 and abs(parts - one["wall_s"]) < 1e-6  # the parts add up to the wall time
    (procs,) = res["processes"]
    assert procs == {**procs, "arch": 75, "torch": "stand-in", "processes": 1, "entries": 2, "compiled": 2}
    assert "one process, sm_75" in capsys.readouterr().out


def test_bad_arguments_get_one_line_before_anything_runs(capsys):
    assert precompile_timing.main(["--arch", "seventy-five"]) == 2
    assert precompile_timing.main(["--processes", "0"]) == 2
    assert precompile_timing.main(["--torch", "fake"]) == 2
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("error: ") for line in lines)
