#!/usr/bin/env python3
"""How many planted initiator bugs does ``kbtp fuzz --role initiator`` catch on its own?

For every bug of ``tests/initiator_bugs.py`` and every binding it applies to, the
reference initiator runs with the bug planted through the hostile target's cases
``BINDING-SEED-0`` to ``BINDING-SEED-(N-1)`` (no minimisation), stopping at the first
case with a finding: the pair is caught when one has a finding. The clean initiator runs
the same cases first (``--control-cases`` of them per binding, default N) and must give none.

    .venv/bin/python tools/initiator_fuzz_rate.py --cases 12 --json fuzz-rate.json
    .venv/bin/python tools/initiator_fuzz_rate.py --bug fifo_matching --transport roce
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kbtp_scapy.conform.initiator import hostile  # noqa: E402
from tests.initiator_bugs import CORPUS, program  # noqa: E402

TRANSPORTS = ("iwarp", "roce")
_net = itertools.count(1)
NET = [64]


def address(transport: str) -> tuple[str, str]:
    """A fresh listen URL and local address on loopback (127.NET.x.y) for one campaign."""
    n = next(_net)
    host = f"127.{NET[0]}.{n % 250}.1"
    if transport == "iwarp":
        return f"iwarp://{host}:{5500 + n % 400}", ""
    return f"roce://{host}", f"127.{NET[0]}.{n % 250}.2"


def fuzz(transport: str, bug: str | None, seed: int, cases: int, timeout: float, stop: bool) -> dict:
    url, local = address(transport)
    summary = asyncio.run(hostile.campaign(program(bug), url, seed=seed, count=cases, timeout=timeout,
                                           local=local, budget=0, stop_at_first=stop))
    first = summary.findings[0] if summary.findings else None
    return {"cases": summary.cases, "seconds": summary.seconds, "error": summary.error,
            "findings": len(summary.findings),
            "found": [f"{f['case']} [{f['kind']}] {f['findings'][0]['oracle'] if f['findings'] else '?'}"
                      for f in summary.findings],
            "first": None if first is None else {"case": first["case"], "kind": first["kind"],
                                                 "findings": first["findings"][:3]}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bug", action="append", default=[], metavar="NAME", help="only these bugs")
    ap.add_argument("--transport", choices=TRANSPORTS, action="append", help="only this binding")
    ap.add_argument("--cases", type=int, default=12, help="cases per (bug, binding) (default 12)")
    ap.add_argument("--control-cases", type=int, default=None, help="cases of the clean initiator per binding")
    ap.add_argument("--control-only", action="store_true", help="only the clean initiator's cases")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds per program run (default 10)")
    ap.add_argument("--json", metavar="FILE", help="write every run's result as JSON to FILE")
    ap.add_argument("--net", type=int, default=64, help="loopback addresses 127.NET.x.y (default 64)")
    args = ap.parse_args()
    NET[0] = args.net
    unknown = set(args.bug) - {b.name for b in CORPUS}
    if unknown:
        ap.error(f"unknown bug {', '.join(sorted(unknown))}")
    transports = args.transport or list(TRANSPORTS)
    results = []
    for transport in transports:
        control = args.cases if args.control_cases is None else args.control_cases
        if control:
            r = fuzz(transport, None, args.seed, control, args.timeout, stop=False)
            print(f"control {transport}: {r['cases']} cases, {r['findings']} with findings {r['first'] or ''}",
                  file=sys.stderr, flush=True)
            results.append({"bug": None, "transport": transport, **r})
    for bug in (b for b in CORPUS if not args.control_only and (not args.bug or b.name in args.bug)):
        for transport in (t for t in transports if t in bug.transports):
            r = fuzz(transport, bug.name, args.seed, args.cases, args.timeout, stop=True)
            r.update(bug=bug.name, transport=transport, caught=bool(r["findings"]))
            results.append(r)
            how = f"by {r['first']['case']} [{r['first']['kind']}] {r['first']['findings'][0]['oracle']}" \
                if r["first"] else ""
            print(f"{bug.name:30} {transport:5} {'caught' if r['caught'] else 'MISSED':6} "
                  f"{r['cases']:3} cases {r['seconds']:6.1f} s {how}", file=sys.stderr, flush=True)
    planted = [r for r in results if r["bug"]]
    caught = sum(r["caught"] for r in planted)
    controls = [r for r in results if not r["bug"]]
    summary = {"pairs": len(planted), "caught": caught, "cases_per_pair": args.cases,
               "control_findings": sum(r["findings"] for r in controls),
               "missed": [f"{r['bug']}/{r['transport']}" for r in planted if not r["caught"]]}
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "runs": results}, indent=1))
    print(f"fuzz alone caught {caught} of {len(planted)} (bug, binding) pairs "
          f"({100 * caught / max(1, len(planted)):.0f}%) within {args.cases} cases each; clean "
          f"initiator: {summary['control_findings']} finding(s); missed: {', '.join(summary['missed']) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
