"""Comments and docstrings under solution/ state contracts, not history: no session number, date,
clock-time run name, commit id or issue number (those live in docs/history/ and the git log; the
figures in docs generated from docs/runs/latest.json)."""
from __future__ import annotations

import re
from pathlib import Path

import solution

SOLUTION_DIR = Path(solution.__file__).resolve().parent
PATTERNS = {
    "a session": re.compile(r"\bsessions?\b", re.I),
    "a date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
    "an issue number": re.compile(r"\bissues? #?\d", re.I),
    # 7-12 hex digits with at least one digit and one letter: a commit id (64-digit sha256 strings
    # of reviewed sources are whole words of another length)
    "a commit id": re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,12}\b"),
    "a clock-time run name": re.compile(r"\b(?:[01]?\d|2[0-3]):[0-5]\d (?:cold |warm )?(?:run|call)\b"
                                        r"|\b(?:run|call) [0-2]\d[0-5]\d\b", re.I),
}


def test_no_history_in_solution():
    found = []
    for path in sorted(SOLUTION_DIR.rglob("*.py")):
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for what, pattern in PATTERNS.items():
                if pattern.search(line):
                    found.append(f"{path.relative_to(SOLUTION_DIR)}:{i}: {what}: {line.strip()[:100]}")
    assert not found, "\n".join(found)


def test_the_patterns_catch_what_they_mean():
    hits = {what: bool(p.search(text)) for (what, p), text in zip(PATTERNS.items(), (
        "measured in the twenty-third session", "read on 2026-12-01", "the choice of issue 5.2",
        "(56ebb1d, graphs off)", "0.05 s in the 13:59 cold run"))}
    assert all(hits.values()), hits
    assert not any(p.search("start_new_session=True; sha 0x7FFF; 1.5x; cu_seqlens") for p in PATTERNS.values())
