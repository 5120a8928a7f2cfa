#!/usr/bin/env python3
"""How many realistic initiator bugs does ``kbtp conform --role initiator`` catch?

For every bug of the corpus (``tests/initiator_bugs.py``: each breaks one sentence that
binds an initiator) and every binding it applies to, the reference initiator runs with
the bug planted against the case meant for it, as ``kbtp conform --role initiator
--only CASE`` runs it (or, for a ``fuzz:SEED-INDEX`` case, as ``kbtp fuzz --role
initiator --replay`` runs it). A bug is caught when that case FAILs (or WARNs, for a SHOULD).
The clean reference initiator runs the whole suite ``--control-runs`` times per binding
first: every run must pass.

    .venv/bin/python tools/initiator_catch_rate.py                    # every bug, both bindings
    .venv/bin/python tools/initiator_catch_rate.py --bug fifo_matching --transport roce
    .venv/bin/python tools/initiator_catch_rate.py --control-runs 5 --json rate.json --markdown
    .venv/bin/python tools/initiator_catch_rate.py --whole-suite --bug id_uuid4   # by any case
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kbtp_scapy.conform.initiator import hostile  # noqa: E402
from kbtp_scapy.conform.initiator.runner import all_cases, run  # noqa: E402
from kbtp_scapy.conform.registry import select  # noqa: E402
from tests.initiator_bugs import CORPUS, program  # noqa: E402

TRANSPORTS = ("iwarp", "roce")
_net = itertools.count(1)


def address(transport: str) -> tuple[str, str]:
    """A fresh listen URL and local address on loopback for one run."""
    n = next(_net)
    host = f"127.63.{n % 250}.1"
    if transport == "iwarp":
        return f"iwarp://{host}:{5500 + n % 400}", ""
    return f"roce://{host}", f"127.63.{n % 250}.2"


def run_cases(transport: str, bug: str | None, only: list[str], timeout: float) -> dict:
    url, local = address(transport)
    cases = select(all_cases(), tuple(only))
    started = time.monotonic()
    outcomes = asyncio.run(run(url, program(bug), cases, timeout=timeout, local=local))
    verdicts = {o.case.id: o.verdict for o in outcomes}
    return {"failed": sorted(c for c, v in verdicts.items() if v in ("FAIL", "WARN")),
            "errors": sorted(c for c, v in verdicts.items() if v == "ERROR"),
            "details": {o.case.id: f"{o.expected} / {o.seen} {o.detail}".strip()
                        for o in outcomes if o.verdict != "PASS" and o.verdict != "SKIP"},
            "seconds": round(time.monotonic() - started, 1)}


def run_fuzz(transport: str, bug: str | None, case: str, timeout: float) -> dict:
    """One replay of the hostile target's case ``SEED-INDEX`` (from ``fuzz:SEED-INDEX``)."""
    url, local = address(transport)
    name = f"{transport}-{case.split(':', 1)[1]}"
    started = time.monotonic()
    summary = asyncio.run(hostile.campaign(program(bug), url, seed=0,
                                           count=1, timeout=timeout, local=local, replay=name))
    found = [f for record in summary.findings for f in record["findings"]]
    return {"failed": [case] if found else [], "errors": [summary.error] if summary.error else [],
            "details": {case: "; ".join(f"{f['oracle']}: {f['detail']}" for f in found)},
            "seconds": round(time.monotonic() - started, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bug", action="append", default=[], metavar="NAME", help="only these bugs")
    ap.add_argument("--transport", choices=TRANSPORTS, action="append", help="only this binding")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds per program run (default 10)")
    ap.add_argument("--control-runs", type=int, default=1, metavar="N",
                    help="full runs of the clean initiator per binding (default 1)")
    ap.add_argument("--json", metavar="FILE", help="write every run's result as JSON to FILE")
    ap.add_argument("--markdown", action="store_true", help="print the summary as a Markdown table")
    ap.add_argument("--whole-suite", action="store_true",
                    help="judge each bug by every conformance case, not only the one meant for it "
                         "(caught when any case FAILs or WARNs)")
    args = ap.parse_args()
    unknown = set(args.bug) - {b.name for b in CORPUS}
    if unknown:
        ap.error(f"unknown bug {', '.join(sorted(unknown))}")
    bugs = [b for b in CORPUS if not args.bug or b.name in args.bug]
    transports = args.transport or list(TRANSPORTS)
    known = {c.id for c in all_cases()}
    fuzzed = sorted({b.case for b in CORPUS if b.case.startswith("fuzz:")})
    results = []
    for transport in transports:
        for i in range(args.control_runs):
            r = run_cases(transport, None, [], args.timeout)
            ok = not r["failed"] and not r["errors"]
            print(f"control {transport} run {i + 1}: {'passes' if ok else 'DOES NOT PASS'} "
                  f"{r['failed']} {r['errors']} {r['seconds']} s", file=sys.stderr)
            results.append({"bug": None, "transport": transport, "passed": ok, **r})
        for case in fuzzed:
            r = run_fuzz(transport, None, case, args.timeout)
            ok = not r["failed"] and not r["errors"]
            print(f"control {transport} {case}: {'no finding' if ok else 'FINDING'} {r['details']}",
                  file=sys.stderr)
            results.append({"bug": None, "transport": transport, "passed": ok, **r})
    for bug in bugs:
        for transport in (t for t in transports if t in bug.transports):
            if bug.case.startswith("fuzz:"):
                r = run_fuzz(transport, bug.name, bug.case, args.timeout)
            else:
                r = run_cases(transport, bug.name, [] if args.whole_suite else [bug.case], args.timeout)
            caught = bool(r["failed"]) if args.whole_suite else bug.case in r["failed"]
            r.update(bug=bug.name, transport=transport, case=bug.case, caught=caught,
                     case_exists=bug.case in known or bug.case.startswith("fuzz:"))
            results.append(r)
            by = ",".join(r["failed"]) if args.whole_suite else bug.case
            print(f"{bug.name:30} {transport:5} {'caught' if r['caught'] else 'MISSED':6} by {by:30} "
                  f"{r['seconds']:5.1f} s {'' if r['caught'] else r['details']}", file=sys.stderr)
    planted = [r for r in results if r["bug"]]
    controls = [r for r in results if not r["bug"]]
    caught = sum(r["caught"] for r in planted)
    summary = {"pairs": len(planted), "caught": caught,
               "rate": round(caught / len(planted), 3) if planted else None,
               "control_runs": len(controls), "control_passed": sum(r["passed"] for r in controls),
               "missed": [f"{r['bug']}/{r['transport']}" for r in planted if not r["caught"]]}
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "runs": results}, indent=1))
    if args.markdown:
        print("| bug | binding | case | caught |")
        print("| --- | --- | --- | --- |")
        for r in planted:
            print(f"| {r['bug']} | {r['transport']} | {r['case']} | {'yes' if r['caught'] else '**no**'} |")
    print(f"caught {caught} of {len(planted)} (bug, binding) pairs "
          f"({100 * caught / max(1, len(planted)):.0f}%), "
          f"{'by any case' if args.whole_suite else 'each by the case meant for it'}; clean "
          f"initiator passed {summary['control_passed']} of {len(controls)} full runs; missed: "
          f"{', '.join(summary['missed']) or 'none'}")
    return 0 if not summary["missed"] and summary["control_passed"] == len(controls) else 1


if __name__ == "__main__":
    sys.exit(main())
