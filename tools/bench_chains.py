#!/usr/bin/env python
"""LOAD or ALLOC_STORE with ``--execution chains`` against the software target, on the same binding.

Runs tools/bench_target.py twice per mode: once plain, for operations per second (the
ratio chains / software), and once with the target under cProfile, for its CPU per
operation split by where the time went: the chain engine (kbtp_scapy/rnic/chains), the
chains' refills (kbtp_scapy/target/chains.py, run once per batch), KBTP code run per
request (the rest of kbtp_scapy/target, the codec, the tables), the soft RNIC's transport
(the rest of kbtp_scapy/rnic) and everything else (asyncio, the interpreter). The target's closing
counters give the KBTP Python run per operation. The Markdown table goes to stdout and, with
``--write-docs``, between the markers in docs/CHAINS.md (one section per operation).

    python tools/bench_chains.py --transport iwarp --seconds 4
    python tools/bench_chains.py --transport roce --write-docs
    python tools/bench_chains.py --op ALLOC_STORE --seconds 3 --write-docs
"""
from __future__ import annotations

import argparse
import json
import pstats
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import perf_docs

ROOT = Path(__file__).resolve().parents[1]
CHAINS = ROOT / "docs" / "CHAINS.md"
PARTS = (("engine", ("kbtp_scapy/rnic/chains/",)),
         ("refill", ("kbtp_scapy/target/chains.py", "kbtp_scapy/target/chain_alloc.py")),
         ("KBTP", ("kbtp_scapy/target/", "kbtp_scapy/codec.py", "kbtp_scapy/tables/")),
         ("transport", ("kbtp_scapy/rnic/",)))


def bench(transport: str, op: str, mode: str, seconds: float, work: Path, profile: bool) -> dict:
    out = work / f"{mode}{'-prof' if profile else ''}.json"
    argv = [sys.executable, str(ROOT / "tools" / "bench_target.py"), "--transports", transport,
            "--ops", op, "--sizes", "4096", "--seconds", str(seconds), "--pool-mib", "64",
            "--target-args", f"--execution {mode}", "--json", str(out)]
    if profile:
        argv += ["--profile-target", str(work / f"prof-{mode}")]
    subprocess.run(argv, check=False, stdout=subprocess.DEVNULL)
    case = json.loads(out.read_text())["cases"][0]
    if "error" in case:
        raise SystemExit(f"bench_target ({mode}): {case['error']}")
    return case


def split(profile: Path, ops: int) -> dict[str, float]:
    """Microseconds per operation by part (own time of the functions in each)."""
    stats = pstats.Stats(str(profile))
    total = {name: 0.0 for name, _ in PARTS}
    total["other"] = 0.0
    for (file, _, _), (_, _, tottime, _, _) in stats.stats.items():   # type: ignore[attr-defined]
        where = file.replace("\\", "/")
        part = next((name for name, prefixes in PARTS if any(p in where for p in prefixes)), "other")
        total[part] += tottime
    return {k: v / max(1, ops) * 1e6 for k, v in total.items()}


def python_per_op(case: dict, op: str) -> str:
    m = re.search(op + r": KBTP Python per request (\d+), run by chains (\d+)", case["target_output"])
    return f"{m.group(1)} of {int(m.group(1)) + int(m.group(2))}" if m else "?"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transport", choices=["iwarp", "roce"], default="iwarp")
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--op", choices=["LOAD", "ALLOC_STORE"], default="LOAD")
    perf_docs.add_write_docs(p, CHAINS)
    args = p.parse_args(argv)
    op = args.op
    section = "bench_chains" if op == "LOAD" else "bench_chains_alloc_store"
    if args.write_docs:
        perf_docs.check_section(args.write_docs, section)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for mode in ("software", "chains"):
            print(f"{mode}: plain run ...", file=sys.stderr, flush=True)
            plain = bench(args.transport, op, mode, args.seconds, work, False)
            print(f"{mode}: profiled run ...", file=sys.stderr, flush=True)
            prof = bench(args.transport, op, mode, args.seconds, work, True)
            profile = work / f"prof-{mode}" / f"{args.transport}-{op}-4096.prof"
            rows[mode] = (plain, prof, split(profile, prof["kbtp"]["ops"]))
    soft = rows["software"][0]["kbtp"]["ops_per_s"]
    what = "LOAD" if op == "LOAD" else "ALLOC_STORE (each round's FREEs, untimed, in software)"
    lines = [f"{what} of 4096-octet blocks over {args.transport}, {args.seconds:g} s per run, "
             "window 16 (tools/bench_chains.py).", "",
             f"| execution | {op}/s | vs software | KBTP Python per {op} | target CPU us/{op} "
             "(profiled): engine | chain refills | KBTP per request | transport | other |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for mode, (plain, _, parts) in rows.items():
        rate = plain["kbtp"]["ops_per_s"]
        lines.append(f"| {mode} | {rate:,.0f} | {rate / soft:.2f} | {python_per_op(plain, op)} | "
                     f"{parts['engine']:.0f} | {parts['refill']:.0f} | {parts['KBTP']:.0f} | "
                     f"{parts['transport']:.0f} | "
                     f"{parts['other']:.0f} |")
    text = "\n".join(lines)
    print(text)
    if args.write_docs:
        perf_docs.write_section(args.write_docs, section, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
