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
    assert "measured in the 8-SM partition" not in en  # no check against the partition in this summary


def test_the_projection_line_says_how_far_it_is_from_the_8_sm_run():
    summary = _summary()
    summary["t4_projection"]["against"] = {"run": "gpu-bound-sm8", "projected_ratio": 0.435,
                                           "measured_ratio": 0.382, "difference": 0.435 / 0.382 - 1}
    assert "Solution / baseline projected 0.435, measured in the 8-SM partition 0.382 (projection +14%)" in \
        df.render(summary, "en", steps=64)
    assert "по проекции 0.435, замер в разделе из 8 SM 0.382 (проекция +14%)" in df.render(summary, "ru", steps=64)


def test_runs_of_several_calls_name_their_calls():
    en = df.render(_summary(calls_differ=True), "en", steps=64)
    assert "Calls the runs came from:" in en
    assert "- gpu-bound-sm16: 2026-12-02T11:30, abc1234, `python -m bench.compare --runs shipped`" in en


def test_runs_of_one_call_share_its_line():
    summary = _summary(calls_differ=True)
    summary["runs"]["long"] = dict(summary["runs"]["gpu-bound-sm16"])  # a second run of the later call
    en = df.render(summary, "en", steps=64)
    assert "- gpu-bound-sm16, long: 2026-12-02T11:30, abc1234, `python -m bench.compare --runs shipped`" in en
    assert "- shipped: 2026-12-02T10:00, abc1234, `python -m bench.compare --runs shipped`" in en


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


# --- the front doors' limits (bench.doc_figures.limits) ----------------------------------------------
def _limits_tree(tmp_path, **texts):
    """The four pages under tmp_path, each a title and the generated block; ``texts`` (keyed by a
    short name: audit, readme, ru_readme, performance) appended to the page."""
    summary = _tree(tmp_path)
    df.main(["--write", "--root", str(tmp_path)])
    names = {"audit": "docs/ru/AUDIT.md", "readme": "README.md", "ru_readme": "docs/ru/README.md",
             "performance": "docs/PERFORMANCE.md"}
    for key, text in texts.items():
        path = tmp_path / names[key]
        path.write_text(path.read_text(encoding="utf-8") + text, encoding="utf-8")
    return summary


def _check(tmp_path, capsys) -> list[str]:
    capsys.readouterr()
    rc = df.main(["--check", "--root", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == (1 if err else 0)
    return err


def test_short_clean_pages_pass_the_limits(tmp_path, capsys):
    _limits_tree(tmp_path, audit="Коммит назван в сгенерированном блоке, и только там.\n",
                 readme="Run `bash scripts/compare.sh`; report runs/<timestamp>/report.md, 2026-12-03, fp16, bf16.\n")
    assert _check(tmp_path, capsys) == []
    assert df.limits(tmp_path) == []


def test_the_audit_over_its_lines_fails(tmp_path, capsys):
    _limits_tree(tmp_path, audit="строка\n" * df.MAX_AUDIT_LINES)
    err = _check(tmp_path, capsys)
    assert len(err) == 1 and err[0].startswith("docs/ru/AUDIT.md: ") and f"(at most {df.MAX_AUDIT_LINES})" in err[0]


def test_a_line_of_the_audit_over_its_characters_fails(tmp_path, capsys):
    _limits_tree(tmp_path, audit="а" * df.MAX_LINE_CHARS + "\n" + "б" * (df.MAX_LINE_CHARS + 1) + "\n")
    err = _check(tmp_path, capsys)
    assert len(err) == 1 and "a line of 301 characters (at most 300)" in err[0]
    n = len((tmp_path / df.AUDIT).read_text(encoding="utf-8").splitlines())
    assert err[0].startswith(f"docs/ru/AUDIT.md:{n}: ")
    # a long line in the other pages is allowed (their limit is the number of lines)
    _limits_tree(tmp_path, readme="x" * 400 + "\n")
    assert _check(tmp_path, capsys) == []


@pytest.mark.parametrize("key, rel", [("readme", "README.md"), ("ru_readme", "docs/ru/README.md"),
                                      ("performance", "docs/PERFORMANCE.md")])
def test_a_front_door_over_its_lines_fails(tmp_path, capsys, key, rel):
    _limits_tree(tmp_path, **{key: "line\n" * df.MAX_FRONT_LINES})
    err = _check(tmp_path, capsys)
    assert len(err) == 1 and err[0].startswith(f"{rel}: ") and f"(at most {df.MAX_FRONT_LINES})" in err[0]


@pytest.mark.parametrize("text, what", [
    ("Measured on 56ebb1d.", "a commit id"), ("замер на d400028", "a commit id"),
    ("commit 56ebb1d048923f24e6d179b011b78ac84c0b0f18", "a commit id"), ("(`abc1234`)", "a commit id"),
    ("as in the last session", "a session"), ("в прошлой сессии", "a session"), ("Сессия Kaggle", "a session"),
    ("run 1407 says", "a clock-time run name"), ("в наборе 1407", "a clock-time run name"),
    ("отчёт «0924»", "a clock-time run name"), ("the profile (0924)", "a clock-time run name"),
    ("прогон 2141", "a clock-time run name"),
    ("issue 24's targets", "an issue number"), ("Issue 5", "an issue number"), ("задача 41", "an issue number"),
    ("цели задачи 24", "an issue number"), ("see #41", "an issue number")])
@pytest.mark.parametrize("key, rel", [("audit", "docs/ru/AUDIT.md"), ("readme", "README.md"),
                                      ("ru_readme", "docs/ru/README.md"), ("performance", "docs/PERFORMANCE.md")])
def test_a_forbidden_word_outside_the_block_fails(tmp_path, capsys, key, rel, text, what):
    _limits_tree(tmp_path, **{key: f"before\n{text}\n"})
    err = _check(tmp_path, capsys)
    n = len((tmp_path / rel).read_text(encoding="utf-8").splitlines())
    assert len(err) == 1 and err[0].startswith(f"{rel}:{n}: names {what} ("), err


@pytest.mark.parametrize("text", [
    "docs/runs/compare-h200-2026-12-03-1407.md", "fp16 bf16 sm_75 e4m3 1e-05 0.335 3.6.0", "the 2026-12-03 set",
    "runs/kaggle-20261201-101500", "64 steps at 17.5%", "# Title", "GPU `nf4_dequant_kernel`", "the decade",
    "задача конкурса", "256 examples", "Issue tracker", "между 14:02 и 14:20"])
def test_ordinary_words_are_not_taken_for_forbidden_ones(tmp_path, capsys, text):
    _limits_tree(tmp_path, readme=f"{text}\n", audit=f"{text}\n")
    assert _check(tmp_path, capsys) == []


def test_the_generated_block_may_name_its_commit(tmp_path, capsys):
    _limits_tree(tmp_path)
    assert "abc1234" in (tmp_path / "README.md").read_text(encoding="utf-8")  # the fake summary's commit
    assert _check(tmp_path, capsys) == []


def test_several_problems_one_line_each(tmp_path, capsys):
    _limits_tree(tmp_path, audit="ы" * 301 + "\n" + "56ebb1d, issue 24\n" + "ы\n" * df.MAX_AUDIT_LINES,
                 performance="in session 25\n")
    err = _check(tmp_path, capsys)
    assert len(err) == 5, err  # AUDIT: lines, one long line, a commit and an issue on one line; PERFORMANCE: a session
    assert sum(ln.startswith("docs/ru/AUDIT.md") for ln in err) == 4


def test_write_also_reports_a_broken_limit(tmp_path, capsys):
    _limits_tree(tmp_path, readme="see 56ebb1d\n")
    capsys.readouterr()
    assert df.main(["--write", "--root", str(tmp_path)]) == 1
    assert "README.md:" in capsys.readouterr().err


def test_the_repository_front_doors_keep_their_limits():
    assert df.limits(df.ROOT) == []
