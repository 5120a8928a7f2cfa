#!/usr/bin/env python3
"""How many realistic bugs does ``kbtp conform`` catch? Plant each, run the whole checker.

For every bug of the corpus (``tests/planted_bugs.py``: each breaks one sentence of the
specification and shows on the wire) and every binding it applies to, a fresh reference
target is started on loopback, the bug is planted, and the full conformance suite runs
against it, as ``kbtp conform`` runs it (no --quick). A bug is caught when at least one
case FAILs, or WARNs for a bug against a SHOULD (what ``--strict`` turns into a failure).
The report also says whether the case meant for the bug was among those that failed and
how many cases blamed it (one broken mechanism should fail its own case, not thirty).
An unmodified target runs first on each binding as the control: it must pass.

    .venv/bin/python tools/conform_catch_rate.py                 # the whole corpus, both bindings
    .venv/bin/python tools/conform_catch_rate.py --bug stores_overtaken --bug credits_one_short
    .venv/bin/python tools/conform_catch_rate.py --json rate.json --markdown

To measure an older checker against the same corpus, put its ``kbtp_scapy`` first on
PYTHONPATH (``git archive BASE kbtp_scapy | tar -x -C /tmp/base``, then
``PYTHONPATH=/tmp/base``); the corpus and the target it plants into come from here.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parent.parent))   # after PYTHONPATH: see above

from kbtp_scapy.conform.cases import all_cases  # noqa: E402
from kbtp_scapy.conform.runner import run  # noqa: E402
from tests.planted_bugs import CORPUS, Bug, start  # noqa: E402

TRANSPORTS = ("iwarp", "roce")
_net = itertools.count(1)


def run_checker(transport: str, bug: Bug | None, timeout: float) -> dict:
    """One full conform run against a fresh target with ``bug`` planted."""
    n = next(_net)
    t = start(transport, [f"127.53.{n % 250}.1", f"127.53.{n % 250}.2"], bug)
    started = time.monotonic()
    try:
        with pytest.MonkeyPatch.context() as mp:
            if bug is not None:
                bug.plant(t, mp)
            local = t.initiator_hosts[0] if transport == "roce" else None
            try:
                _, outcomes = asyncio.run(run(t.url, all_cases(), timeout=timeout, local=local))
            except Exception as exc:           # the whole run could not go on
                return {"error": f"{type(exc).__name__}: {exc}", "failed": [], "errors": [],
                        "seconds": round(time.monotonic() - started, 1)}
    finally:
        t.stop()
    verdicts = {o.case.id: o.verdict for o in outcomes}
    return {"failed": sorted(c for c, v in verdicts.items() if v in ("FAIL", "WARN")),
            "errors": sorted(c for c, v in verdicts.items() if v == "ERROR"),
            "seconds": round(time.monotonic() - started, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bug", action="append", default=[], metavar="NAME", help="only these bugs")
    ap.add_argument("--transport", choices=TRANSPORTS, action="append", help="only this binding")
    ap.add_argument("--timeout", type=float, default=5.0, help="conform --timeout (default 5 s)")
    ap.add_argument("--json", metavar="FILE", help="write every run's result as JSON to FILE")
    ap.add_argument("--markdown", action="store_true", help="print the summary as a Markdown table")
    args = ap.parse_args()
    unknown = set(args.bug) - {b.name for b in CORPUS}
    if unknown:
        ap.error(f"unknown bug {', '.join(sorted(unknown))}")
    bugs = [b for b in CORPUS if not args.bug or b.name in args.bug]
    transports = args.transport or list(TRANSPORTS)
    known_cases = {c.id for c in all_cases()}

    results = []
    for transport in transports:
        control = run_checker(transport, None, args.timeout)
        ok = not control["failed"] and not control["errors"] and "error" not in control
        print(f"control {transport}: {'passes' if ok else 'DOES NOT PASS'} "
              f"{control.get('error', '')} {control['failed']} {control['errors']}", file=sys.stderr)
        results.append({"bug": None, "transport": transport, **control})
    for bug in bugs:
        for transport in (t for t in transports if t in bug.transports):
            r = run_checker(transport, bug, args.timeout)
            r.update(bug=bug.name, transport=transport, case=bug.case, caught=bool(r["failed"]),
                     own_case=bug.case in r["failed"], case_exists=bug.case in known_cases)
            results.append(r)
            print(f"{bug.name:28} {transport:5} {'caught' if r['caught'] else 'MISSED':6} "
                  f"own case {'yes' if r['own_case'] else 'no ':3} {len(r['failed']):2} failed "
                  f"{len(r['errors']):2} errors {r['seconds']:5.1f} s", file=sys.stderr)
    planted = [r for r in results if r["bug"]]
    caught = sum(r["caught"] for r in planted)
    own = sum(r["own_case"] for r in planted)
    spread = sorted(len(r["failed"]) for r in planted if r["caught"])
    summary = {"pairs": len(planted), "caught": caught, "own_case": own,
               "rate": round(caught / len(planted), 3) if planted else None,
               "median_failed_cases": spread[len(spread) // 2] if spread else 0,
               "max_failed_cases": spread[-1] if spread else 0,
               "missed": [f"{r['bug']}/{r['transport']}" for r in planted if not r["caught"]]}
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "runs": results}, indent=1))
    if args.markdown:
        print("| bug | binding | caught | by its own case | cases failed | errors |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in planted:
            print(f"| {r['bug']} | {r['transport']} | {'yes' if r['caught'] else '**no**'} | "
                  f"{'yes' if r['own_case'] else 'no'} | {len(r['failed'])} | {len(r['errors'])} |")
    print(f"caught {caught} of {len(planted)} (bug, binding) pairs ({100 * caught / max(1, len(planted)):.0f}%), "
          f"{own} by the case meant for the bug; failed cases per caught bug: median "
          f"{summary['median_failed_cases']}, max {summary['max_failed_cases']}; "
          f"missed: {', '.join(summary['missed']) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
