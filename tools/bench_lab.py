#!/usr/bin/env python3
"""KBTP on Linux rxe against perftest on the same device, in the RDMA lab's guest.

Both ends run in the guest on rxe0 through rxe's loopback (two rxe devices in one guest
cannot reach each other; see tools/rdma_lab.py): ``kbtp target --io verbs`` and a
verbs-backend initiator keeping ``--window`` requests in flight, against perftest moving
the same bytes with no KBTP, one case after the other in one run:

- LOAD (the target's RDMA Write of the block) against ``ib_write_bw`` of the block size;
- ALLOC_STORE of 4 KiB (an inline Send) against ``ib_send_bw``;
- ALLOC_STORE of 32 KiB (the target's RDMA Read) against ``ib_read_bw``.

Each case also runs ``kbtp bench --io verbs --device rxe0`` against the same target, so the
user's benchmark client stands beside perftest in the same run (``kbtp_bench_ratio``; its
ALLOC_STORE row is of ALLOC_STORE+FREE iterations, a FREE after each store).

    tools/bench_lab.py                     4 KiB and 32 KiB, 5 s per case (about 3 minutes)
    tools/bench_lab.py --markdown          the table as docs/PERFORMANCE.md shows it
    tools/bench_lab.py --write-docs        ... written into docs/PERFORMANCE.md
    tools/bench_lab.py --sizes 32768 --seconds 10
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import bench_target as bt  # noqa: E402
import perf_docs  # noqa: E402
import rdma_lab  # noqa: E402

DEVICE, HOST = "rxe0", rdma_lab.GUEST_IP
PERFTEST = {"LOAD": "ib_write_bw", "inline": "ib_send_bw", "read": "ib_read_bw"}


async def kbtp_load(url: str, device: str, op: str, size: int, seconds: float,
                    window: int) -> dict:
    """In the guest: ``op`` of ``size`` octets with ``window`` in flight, timed."""
    from kbtp_scapy.initiator import Initiator
    ini = await Initiator.connect(url, features=0, credits=window, io="verbs", device=device)
    info = ini.target
    base, rounds = info.handle_base, max(1, min(256, info.quota, info.handle_count))
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    one, between = await bt.workload(ini, op, base, rounds, data, window)
    meter = bt.Meter(lambda: {})
    await bt.drive(one, window, min(1.0, seconds), rounds, meter, between)       # warm-up
    ops, secs = await bt.drive(one, window, seconds, rounds, meter, between)
    await ini.goodbye(release=True)
    path = "RDMA Write" if op == "LOAD" else "inline Send" if size <= info.max_inline else "RDMA Read"
    return {"ops": ops, "seconds": secs, "ops_per_s": ops / secs, "data_path": path}


def perftest(lab, tool: str, size: int, seconds: float) -> float:
    """Messages per second of ``tool`` between rxe0 and itself."""
    args = [tool, "-d", DEVICE, "-s", str(size), "-D", str(int(seconds)), "-F"]
    server = lab.spawn(args, name=f"{tool}-server")
    time.sleep(2)
    out = lab.run(args + [HOST], timeout=seconds + 60, check=False).stdout
    server.wait(30)
    rows = [line.split() for line in out.splitlines() if re.match(r"\s*\d+\s+\d+\s", line)]
    if not rows:
        raise rdma_lab.LabError(f"{tool} printed no result: {out[-1500:]}")
    return float(rows[-1][4]) * 1e6          # MsgRate[Mpps]


def case(lab, op: str, size: int, seconds: float, window: int) -> dict:
    target = lab.spawn(lab.kbtp("target", "--io", "verbs", "--device", DEVICE, "--listen", HOST,
                                "--blocks", "512", "-S", str(size), "--max-initiators", "2",
                                "--credits", str(window), "--features", "none"),
                       name=f"bench-target-{op}-{size}")
    try:
        target.wait_for("listening on", 120)
        res = lab.run(lab.python(str(Path(__file__)), "--guest-load", f"roce://{HOST}", DEVICE, op,
                                 str(size), str(seconds), str(window)), timeout=seconds * 4 + 180)
        kbtp = json.loads(res.stdout.strip().splitlines()[-1])
        bench = lab.run(lab.kbtp("bench", f"roce://{HOST}", "--io", "verbs", "--device", DEVICE,
                                 "--op", op.lower(), "-s", str(size), "-t", str(window),
                                 "-D", str(seconds), "--json", "--no-histogram"),
                        timeout=seconds * 4 + 180)
        row = json.loads(bench.stdout)["results"][0]
    finally:
        target.stop()
    tool = PERFTEST["LOAD" if op == "LOAD" else "inline" if kbtp["data_path"] == "inline Send" else "read"]
    base = perftest(lab, tool, size, seconds)
    return {"op": op, "size": size, **kbtp, "baseline": tool, "baseline_per_s": base,
            "ratio": kbtp["ops_per_s"] / base, "kbtp_bench_per_s": row["ops_per_s"],
            "kbtp_bench_ratio": row["ops_per_s"] / base, "kbtp_bench_latency_us": row["latency_us"]}


def markdown(cases: list[dict]) -> str:
    lines = ["| op | size | data path | KBTP ops/s | baseline | baseline msgs/s | KBTP/baseline "
             "| kbtp bench ops/s | kbtp bench/baseline | kbtp bench p50/p99 us |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in cases:
        lat = c["kbtp_bench_latency_us"]
        lines.append(f"| {c['op']} | {c['size']} | {c['data_path']} | {c['ops_per_s']:.0f} | "
                     f"`{c['baseline']}` | {c['baseline_per_s']:.0f} | {c['ratio']:.2f} "
                     f"| {c['kbtp_bench_per_s']:.0f} | {c['kbtp_bench_ratio']:.2f} "
                     f"| {lat['p50']:.0f}/{lat['p99']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(line for line in __doc__.splitlines()
                                                   if line.strip().startswith("tools/bench_lab.py")))
    ap.add_argument("--sizes", default="4096,32768", help="block sizes (comma-separated)")
    ap.add_argument("--seconds", type=float, default=5.0, help="timed seconds per case")
    ap.add_argument("--window", type=int, default=16, help="requests in flight")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    perf_docs.add_write_docs(ap)
    ap.add_argument("--guest-load", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.guest_load:
        url, device, op, size, seconds, window = args.guest_load
        print(json.dumps(asyncio.run(kbtp_load(url, device, op, int(size), float(seconds),
                                                int(window)))))
        return 0
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        ap.error(f"--sizes: {args.sizes!r} is not a list of numbers")
    if args.write_docs:
        perf_docs.check_section(args.write_docs, "bench_lab")
    lab = rdma_lab.Lab.running() or rdma_lab.Lab()
    try:
        if lab.agent is None:
            lab.boot()
        cases = []
        for op in ("LOAD", "ALLOC_STORE"):
            for size in sizes:
                c = case(lab, op, size, args.seconds, args.window)
                print(f"{op} {size}: KBTP {c['ops_per_s']:.0f} ops/s ({c['data_path']}), "
                      f"{c['baseline']} {c['baseline_per_s']:.0f} msgs/s, ratio {c['ratio']:.2f}; "
                      f"kbtp bench {c['kbtp_bench_per_s']:.0f} ops/s, ratio {c['kbtp_bench_ratio']:.2f}",
                      file=sys.stderr)
                cases.append(c)
    except rdma_lab.LabError as exc:
        print(f"bench_lab: {exc}", file=sys.stderr)
        return 1
    finally:
        lab.close()
    print(markdown(cases) if args.markdown else json.dumps(cases, indent=2))
    if args.write_docs:
        perf_docs.write_section(args.write_docs, "bench_lab", markdown(cases))
    return 0


if __name__ == "__main__":
    sys.exit(main())
