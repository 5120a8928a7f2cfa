#!/usr/bin/env python
"""Model-check the free-block ring in the larger configurations and write the table.

Each configuration is explored exhaustively by ``kbtp_scapy/target/ring_check.py`` (every
interleaving of its actors' steps on the target's own ``FreeRing``); the suite runs the
small ones (tests/test_ring_check.py). The table of states, transitions, end states and
seconds replaces the one between the markers in docs/RING_CHECK.md (``--write-docs``),
and goes to stdout. A violation prints its shortest trace and makes the exit status 1.

    python tools/bench_ring_check.py                 # the table on stdout
    python tools/bench_ring_check.py --write-docs
    python tools/bench_ring_check.py --only 'N=2'    # configurations whose label has 'N=2'
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import perf_docs

from kbtp_scapy.target.ring_check import Config, Result, check

C = Config
CONFIGS = [
    # N = 2
    C(1, 2, ("alloc", "alloc"), (1, 1), rounds=3, give_up=True),
    C(1, 2, ("chain", "chain", "alloc"), (2,), rounds=2),
    C(1, 2, ("direct", "direct", "alloc"), (2,), rounds=2, give_up=True),
    C(1, 2, ("direct", "direct", "chain"), (2,), rounds=2, masked=False),
    # N = 4
    C(2, 4, ("chain", "alloc"), (1, 3), rounds=(1, 4)),
    C(2, 4, ("alloc", "alloc", "alloc"), (1, 1, 2), rounds=2, give_up=True),
    C(2, 3, ("chain", "chain", "alloc"), (1, 1, 1), rounds=2, masked=False),
    C(2, 3, ("direct", "chain", "alloc"), (3,), rounds=2, give_up=True),
    C(2, 4, ("direct", "direct", "chain"), (4,), rounds=2),
    # N = 8, F = 5 and 6
    C(3, 5, ("chain", "chain", "alloc"), (1, 2, 2), rounds=2, masked=False),
    C(3, 6, ("direct", "chain", "alloc"), (6,), rounds=(2, 2, 1), give_up=True),
]
RING_CHECK = Path(__file__).resolve().parents[1] / "docs" / "RING_CHECK.md"


def table(results: list[Result]) -> str:
    lines = ["| configuration | states | transitions | end states | most deferred | "
             "Head past Tail | seconds | result |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in results:
        lines.append(f"| {r.config.label()} | {r.states:,} | {r.transitions:,} | {r.terminal:,} | "
                     f"{r.max_deferred} | {r.behind_reclaim:,} | {r.seconds:.2f} | "
                     f"{r.violation or 'no violation'} |")
    total = sum(r.states for r in results), sum(r.seconds for r in results)
    lines.append(f"\n{len(results)} configurations, {total[0]:,} states in {total[1]:.1f} s.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    perf_docs.add_write_docs(p, RING_CHECK)
    p.add_argument("--only", default="", help="run the configurations whose label contains this")
    args = p.parse_args(argv)
    if args.write_docs:
        perf_docs.check_section(args.write_docs, "bench_ring_check")
    results = []
    for config in CONFIGS:
        if args.only not in config.label():
            continue
        print(f"checking {config.label()} ...", file=sys.stderr, flush=True)
        result = check(config)
        results.append(result)
        if result.violation:
            print(f"  {result.violation}:\n    " + "\n    ".join(result.trace), file=sys.stderr)
    text = table(results)
    print(text)
    if args.write_docs:
        perf_docs.write_section(args.write_docs, "bench_ring_check", text)
    return 1 if any(r.violation for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
