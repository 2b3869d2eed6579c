"""The compile manifest (kernels/compile_manifest.json): our kernels' Triton specializations recorded in
earlier runs (``add_to_manifest``), which solution/precompile.py compiles in the background (``entries_for``)."""
from __future__ import annotations

import json
import re
from pathlib import Path

MANIFEST = Path(__file__).resolve().parent / "kernels" / "compile_manifest.json"
OWN_PREFIX = "solution.kernels."


def manifest_path() -> Path:
    """The manifest in use: the shipped one (kernels/compile_manifest.json)."""
    return MANIFEST


def load_manifest(path: Path | None = None) -> list[dict]:
    """The manifest's entries ([] when there is none). Raises ValueError for a malformed file."""
    path = manifest_path() if path is None else path
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        entries = data["entries"]
        for e in entries:
            if not all(isinstance(e.get(k), str) for k in ("arch", "triton", "kernel", "specialization_data")):
                raise KeyError("arch / triton / kernel / specialization_data")
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a compile manifest ({type(exc).__name__}: {exc})") from exc
    return entries


def _jit_key(data: str) -> str:
    """The JIT cache key inside a serialized specialization (the data itself when it has none)."""
    try:
        key = json.loads(data).get("key")
    except (ValueError, AttributeError):
        key = None
    return key if isinstance(key, str) else data


def entries_for(entries: list[dict], triton_version: str) -> list[dict]:
    """The entries recorded with this Triton version, any architecture, one per kernel and JIT key; with none,
    those of the newest recorded version of the same record format (a notebook keeps its own Triton)."""
    versions = {e["triton"] for e in entries}
    if triton_version not in versions:
        usable = sorted((v for v in versions if same_record_format(v, triton_version)), key=_version_tuple)
        triton_version = usable[-1] if usable else triton_version
    out, seen = [], set()
    for e in entries:
        k = (e["kernel"], _jit_key(e["specialization_data"]))
        if e["triton"] == triton_version and k not in seen:
            seen.add(k)
            out.append(e)
    return out


def _version_tuple(version: str) -> tuple[int, ...]:
    """(3, 9, 0) from "3.9.0" or "3.9.0+git"; () when the version does not start with a number."""
    m = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(x) for x in m.group().split(".")[:3]) if m else ()


# Triton versions whose preload reads one record format (each runtime/jit.py read; 3.3 and older differ). Not
# checked on a GPU: that one version's record compiles what another's launch needs (else: first-launch compile).
SAME_FORMAT = ((3, 4), (3, 9))


def same_record_format(recorded: str, running: str) -> bool:
    lo, hi = SAME_FORMAT
    return all(lo <= _version_tuple(v)[:2] <= hi for v in (recorded, running))


def add_to_manifest(compile_log_json: Path, arch: str, triton_version: str, path: Path | None = None,
                    replace: bool = False) -> int:
    """Add our kernels' compiles from a compile log (.json) to the manifest, tagged; returns how many were new.
    ``replace``: the entries of this arch and Triton version are the log's alone (those it lacks are dropped)."""
    log = json.loads(Path(compile_log_json).read_text(encoding="utf-8"))
    path = manifest_path() if path is None else path
    entries = load_manifest(path)
    if replace:
        entries = [e for e in entries if (e["arch"], e["triton"]) != (arch, triton_version)]
    seen = {(e["arch"], e["triton"], e["kernel"], e["specialization_data"]) for e in entries}
    added = 0
    for row in log.get("compiles", []):
        kernel, data = row.get("kernel"), row.get("specialization_data")
        if not (isinstance(kernel, str) and kernel.startswith(OWN_PREFIX) and isinstance(data, str)):
            continue
        k = (arch, triton_version, kernel, data)
        if k not in seen:
            seen.add(k)
            entries.append({"arch": arch, "triton": triton_version, "kernel": kernel, "specialization_data": data})
            added += 1
    path.write_text(json.dumps({"entries": entries}, indent=1) + "\n", encoding="utf-8")
    return added
