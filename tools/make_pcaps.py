#!/usr/bin/env python3
"""Regenerate the sample captures in pcaps/ from kbtp_scapy.samples.

``--check`` writes them to a temporary folder and exits 1 if any committed capture
differs, so CI notices when the tables or the framing changed without a regeneration.
"""
from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from kbtp_scapy.samples import write_samples

PCAPS = Path(__file__).resolve().parent.parent / "pcaps"


def stale(outdir: Path = PCAPS) -> list[str]:
    """Names of committed captures that differ from what the code generates now."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = write_samples(tmp)
        return [p.name for p in fresh
                if not (outdir / p.name).exists() or not filecmp.cmp(p, outdir / p.name, shallow=False)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if pcaps/ is stale")
    args = ap.parse_args()
    if args.check:
        names = stale()
        for name in names:
            print(f"pcaps/{name} is stale: run tools/make_pcaps.py", file=sys.stderr)
        return 1 if names else 0
    for path in write_samples(PCAPS):
        print(f"wrote {path.relative_to(PCAPS.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
