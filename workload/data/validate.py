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


def _line_of(data: bytes, offset: int) -> tuple[int, int]:
    """(line, column), 1-based, of byte ``offset`` in ``data`` (lines end with \n, \r\n or \r)."""
    before = data[:offset].replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    return before.count(b"\n") + 1, len(before) - (before.rfind(b"\n") + 1) + 1


def validate_dataset(path) -> int:
    """Raise ValueError("line N: problem") for the first bad row of the JSONL file at ``path``;
    also for an unreadable or empty file. Returns the number of rows when every row is usable."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if data.startswith(b"\xef\xbb\xbf"):  # like Soup: a UTF-8 byte-order mark is allowed
        data = data[3:]
    try:
        text = data.decode("utf-8")  # lines end with \n, \r\n or \r, like Soup's
    except UnicodeDecodeError as exc:
        line, column = _line_of(data, exc.start)
        raise ValueError(f"line {line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at byte column {column})") \
            from exc
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
    return rows


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m workload.data.validate FILE", file=sys.stderr)
        return 2
    try:
        rows = validate_dataset(args[0])
    except ValueError as exc:
        print(f"invalid: {exc}", file=sys.stderr)
        return 1
    print(f"ok: {args[0]} ({rows} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
