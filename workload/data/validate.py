"""Check an alpaca-format JSONL dataset before a run, with errors that name the line.

Soup 0.77.0 silently drops rows it cannot convert (soup_cli/data/loader.py ``_format_rows``), which
would change the number of training steps and break the comparison with the baseline; so we refuse
such a file up front. Rules (Soup's alpaca converter, soup_cli/data/formats.py ``_convert_alpaca``,
plus "non-empty" for instruction and output): every non-blank line is a JSON object with a
non-empty string ``instruction`` and ``output``; ``input``, if present, is a string or null; other
keys are allowed. The file is only read, never modified.

    python -m workload.data.validate FILE
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

REQUIRED = ("instruction", "output")


def validate_dataset(path) -> None:
    """Raise ValueError("line N: problem") for the first bad row of the JSONL file at ``path``;
    also for an unreadable or empty file. Returns None when every row is usable."""
    path = Path(path)
    try:
        # Like Soup: a UTF-8 byte-order mark is allowed, lines end with \n, \r\n or \r.
        text = path.read_bytes().decode("utf-8-sig")
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text (byte {exc.start})") from exc
    rows = 0
    for number, line in enumerate(text.replace("\r\n", "\n").replace("\r", "\n").split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"line {number}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
        if not isinstance(row, dict):
            raise ValueError(f"line {number}: expected a JSON object, got {type(row).__name__}")
        for key in REQUIRED:
            if key not in row:
                raise ValueError(f"line {number}: missing '{key}'")
            value = row[key]
            if not isinstance(value, str):
                raise ValueError(f"line {number}: '{key}' must be a string, got {type(value).__name__}")
            if not value.strip():
                raise ValueError(f"line {number}: '{key}' is empty")
        if row.get("input") is not None and not isinstance(row["input"], str):
            raise ValueError(f"line {number}: 'input' must be a string, got {type(row['input']).__name__}")
        rows += 1
    if rows == 0:
        raise ValueError(f"{path} is empty (no rows)")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m workload.data.validate FILE", file=sys.stderr)
        return 2
    try:
        validate_dataset(args[0])
    except ValueError as exc:
        print(f"invalid: {exc}", file=sys.stderr)
        return 1
    print(f"ok: {args[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
