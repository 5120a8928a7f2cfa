#!/usr/bin/env python3
"""Write docs/COVERAGE.md, the requirement-to-case matrix, from the specification's text.

    .venv/bin/python tools/coverage_page.py            # regenerate the page
    .venv/bin/python tools/coverage_page.py --check    # exit 1 if the page is stale

The page is generated: edit the cases (their quoted sentences) or
kbtp_scapy/conform/coverage_map.py, never the page.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kbtp_scapy.conform import matrix  # noqa: E402

PAGE = Path(__file__).resolve().parent.parent / "docs" / "COVERAGE.md"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the page differs from what it would be")
    ap.add_argument("--out", type=Path, default=PAGE, help="the page (default docs/COVERAGE.md)")
    args = ap.parse_args()
    page = matrix.markdown(matrix.matrix())
    if args.check:
        if not args.out.exists() or args.out.read_text() != page:
            print(f"{args.out} is stale: run tools/coverage_page.py", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
