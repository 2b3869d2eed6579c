"""bench/doc_figures.py: one current-figures table from docs/runs/latest.json in every document
that shows the current figures; --check fails when one of them differs (and runs here, on the
repository's documents, once all of them carry the markers)."""
import json

import pytest

from bench import doc_figures as df


def _figures(soup, steps, alloc, reserved, gpu=None, loss=0.0, share=None):
    return {"soup_duration_s": soup, "train_excl_first2_s": steps, "peak_allocated_gib": alloc,
            "peak_reserved_gib": reserved, "gpu_kernel_s": gpu, "loss_max_rel_diff": loss, "own_kernel_share": share}


def _summary(calls_differ=False):
    call = {"commit": "abc1234", "date": "2026-12-02T10:00:00+00:00", "command": "python -m bench.compare --runs shipped"}
    other = {**call, "date": "2026-12-02T11:30:00+00:00"} if calls_differ else call
    record = {"sms": 16, "gpu_sms": 132, "rates": {"whole": {"matmul_tflops": 663.0}, "partition": {"matmul_tflops": 94.0}},
              "held_check": {"held": True}}
    return {"gpu": "NVIDIA H200", "date": "2026-12-02T10:00:00+00:00", "commit": "abc1234",
            "runs": {"shipped": {"baseline": _figures(19.8, 17.7, 13.17, 15.09, 3.94),
                                 "solution": _figures(8.8, 4.67, 5.54, 5.9, 1.41, 1.9e-5, 0.086), "call": call},
                     "gpu-bound-sm16": {"baseline": _figures(30.0, 24.9, 13.2, 15.1),
                                        "solution": _figures(20.0, 15.0, 5.5, 5.9, loss=2e-5),
                                        "partition": {"baseline": record, "solution": record},
                                        "prediction": {"ratio": {"predicted": 0.55, "measured": 0.60}}, "call": other}},
            "t4_projection": {"baseline_train_s": 80.0, "solution_train_s": 34.2}}


def test_the_table_states_each_figure_baseline_to_solution():
    en = df.render(_summary(), "en", steps=64)
    assert "Current figures: NVIDIA H200" in en and "2026-12-02, commit abc1234" in en
    assert "| run | steps 3-64 (s) | Soup's duration (s) | peak allocated (GiB) | peak reserved (GiB) |" in en
    assert ("| shipped | 17.7 → 4.67 (0.264) | 19.8 → 8.80 (0.444) | 13.17 → 5.54 (0.421) | 15.09 → 5.90 (0.391) "
            "| 3.94 → 1.41 (0.358) | 1.9e-05 | 8.6% |") in en
    assert "| gpu-bound-sm16 | 24.9 → 15.0 (0.602) |" in en and "| n/a | 2.0e-05 | n/a |" in en
    assert "- shipped: the defaults" in en and "- gpu-bound-sm16: both variants in a 16-SM partition" in en
    assert ("- gpu-bound-sm16: 16 of the GPU's 132 SMs, matmul 94 of 663 TFLOP/s; held on every path: yes; the model "
            "predicted solution / baseline 0.550, measured 0.600") in en
    assert "baseline 80.0 s, solution 34.2 s" in en
    assert "Calls the runs came from" not in en  # one call: its date and commit are the caption's
    ru = df.render(_summary(), "ru", steps=64)
    assert "Текущие цифры: NVIDIA H200" in ru and "| прогон | шаги 3-64 (с) | длительность по Soup (с) |" in ru
    assert "- shipped: настройки по умолчанию" in ru and "раздел удержан на всех путях: да" in ru
    assert "Проекция на T4 (модель, не измерение)" in ru


def test_runs_of_several_calls_name_their_calls():
    en = df.render(_summary(calls_differ=True), "en", steps=64)
    assert "Calls the runs came from:" in en
    assert "- gpu-bound-sm16: 2026-12-02T11:30, abc1234, `python -m bench.compare --runs shipped`" in en


def test_a_repeated_run_states_its_pairs_and_spread():
    summary = _summary()
    summary["runs"]["gpu-bound-sm16"]["repeats"] = {"pairs": [{}, {}, {}], "chosen": 2, "steps_ratio_min": 0.39,
                                                    "steps_ratio_max": 0.431}
    en = df.render(summary, "en", steps=64)
    assert ("- gpu-bound-sm16: 3 interleaved pairs (--repeat), steps 3-64 ratio 0.390 to 0.431; the table shows "
            "pair 2, the median") in en
    assert "пар вперемешку (--repeat) — 3, отношение шагов 3-64 от 0.390 до 0.431; в таблице пара 2" in df.render(
        summary, "ru", steps=64)
    assert "interleaved pairs" not in df.render(_summary(), "en", steps=64)


@pytest.mark.parametrize("text", ["no markers", f"{df.BEGIN}\n{df.BEGIN}\n{df.END}", f"{df.END}\n{df.BEGIN}",
                                  f"{df.BEGIN} only"])
def test_a_file_without_one_pair_of_markers_is_refused(text):
    assert df.replace_block(text, "x") is None


def test_only_the_block_between_the_markers_changes():
    text = f"# Title\nbefore\n{df.BEGIN}\nold table\n{df.END}\nafter\n"
    assert df.replace_block(text, "NEW") == f"# Title\nbefore\n{df.BEGIN}\nNEW\n{df.END}\nafter\n"


def _tree(tmp_path, marked=tuple(df.FILES)):
    for rel in df.FILES:
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        body = f"{df.BEGIN}\nstale\n{df.END}\n" if rel in marked else "no markers here\n"
        path.write_text(f"# {rel}\n\n{body}\nThe rest of the text.\n", encoding="utf-8")
    summary = tmp_path / "docs" / "runs" / "latest.json"
    summary.parent.mkdir(parents=True, exist_ok=True)
    summary.write_text(json.dumps(_summary()), encoding="utf-8")
    return summary


def test_check_and_write_on_temporary_files(tmp_path, capsys):
    _tree(tmp_path, marked=("README.md", "docs/PERFORMANCE.md", "docs/ru/README.md"))
    assert df.main(["--check", "--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4  # one line per file: three differ, one has no markers
    assert sum("differ from docs/runs/latest.json" in ln for ln in err) == 3
    assert [ln for ln in err if "no single pair of markers" in ln][0].startswith("docs/ru/AUDIT.md:")
    assert df.main(["--write", "--root", str(tmp_path)]) == 1  # AUDIT still has no markers: said, not written
    capsys.readouterr()
    readme = (tmp_path / "README.md").read_text(encoding="utf-8")
    assert "| shipped | 17.7 → 4.67 (0.264)" in readme and readme.endswith("\nThe rest of the text.\n")
    assert "Текущие цифры" in (tmp_path / "docs/ru/README.md").read_text(encoding="utf-8")
    assert "Current figures" in (tmp_path / "docs/PERFORMANCE.md").read_text(encoding="utf-8")
    audit = tmp_path / "docs/ru/AUDIT.md"
    audit.write_text(f"# AUDIT\n{df.BEGIN}\n{df.END}\n", encoding="utf-8")
    assert df.main(["--write", "--root", str(tmp_path)]) == 0
    assert df.main(["--check", "--root", str(tmp_path)]) == 0
    assert capsys.readouterr().err == ""
    # a figure changes in the summary: every file differs again
    summary = tmp_path / "docs/runs/latest.json"
    data = json.loads(summary.read_text(encoding="utf-8"))
    data["runs"]["shipped"]["solution"]["train_excl_first2_s"] = 4.5
    summary.write_text(json.dumps(data), encoding="utf-8")
    assert df.main(["--check", "--root", str(tmp_path)]) == 1
    assert len(capsys.readouterr().err.strip().splitlines()) == 4


@pytest.mark.parametrize("content, needle", [("{", "cannot read"), ("[]", "not a bench.compare summary.json"),
                                             ('{"runs": {"x": {"baseline": {}}}}', "run 'x' has no baseline")])
def test_an_unreadable_summary_is_one_error_line(tmp_path, capsys, content, needle):
    _tree(tmp_path)
    (tmp_path / "docs/runs/latest.json").write_text(content, encoding="utf-8")
    assert df.main(["--check", "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and len(err.strip().splitlines()) == 1


def test_the_repository_documents_match_latest_json():
    """--check on the repository's four documents; skipped while one of them has no markers yet."""
    lacking = [rel for rel in df.FILES if df.replace_block((df.ROOT / rel).read_text(encoding="utf-8"), "") is None]
    if lacking:
        pytest.skip(f"no figures markers yet in {', '.join(lacking)}")
    assert df.sync(df.ROOT, df.load_summary(df.ROOT / df.SUMMARY), str(df.SUMMARY), write=False) == []
