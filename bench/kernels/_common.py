"""What every per-op GPU benchmark shares: its command line and the CUDA check."""
from __future__ import annotations

import argparse
import sys


def bench_args(doc: str) -> argparse.Namespace | None:
    """Parse `--out FILE` (the JSON to write). Returns None, after saying so, without CUDA."""
    import torch

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return None
    return args
