#!/usr/bin/env python3
"""``kbtp decode --json`` with its compiled core, with ``KBTP_DECODE=python`` and tshark with
the C plugin, side by side on captures of 1,000,000 KBTP messages or more.

The captures are ``tools/bench_dissector.py``'s kind (generated once, cached in
``--capture DIR``): one RoCEv2 and one iWARP connection of ``--messages`` KBTP messages
each, HELLO/HELLO_ACK then LOADs (with the RDMA Write of the block) and inline STOREs with
their COMPLETIONs, the ACKs between them. Per binding, in interleaved rounds (the best
counts), one run of each:

* ``kbtp decode --json -q``: the compiled core (``kbtp_scapy/decode/_core*.c``);
* the same with ``KBTP_DECODE=python``: the pure-Python decoder, the reference;
* ``tshark -Y kbtp -T fields`` with the C plugin (packet-kbtp.c built -O2 and loaded with
  LD_PRELOAD, as ``tools/bench_dissector.py`` does) and ``-e`` for the same fields:
  frame number and time, addresses, ports or destination QP, every ``kbtp.*`` field and
  flag bit of the tables.

Output goes to /dev/null. Timed: CPU seconds (user + system), wall seconds and peak
resident memory of each process (``bench_decode.run``: started by a small process of its
own). MB/s is the capture's size over CPU seconds, so one core's rate. ``kbtp decode``
with the core is also run on a capture a tenth the size: memory must not grow with it.
**Targets: at least 100 MB/s on one core, at least 10 times less CPU than tshark with
the C plugin, memory flat.** The machine is shared: read the ratios, measured side by
side, more than the absolute times. ``--write-docs`` writes the table into its section
of docs/PERFORMANCE.md.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT))

import bench_decode  # noqa: E402 - run(): CPU, wall and peak RSS of one command
import bench_dissector  # noqa: E402 - the captures, the C plugin's environment
import perf_docs  # noqa: E402

from kbtp_scapy import tables as T  # noqa: E402
from kbtp_scapy.decode import core  # noqa: E402
from kbtp_scapy.dissector.build import build  # noqa: E402

KBTP = [sys.executable, "-m", "kbtp_scapy", "decode", "--json", "-q"]
CORE, PYTHON, TSHARK = "kbtp decode (core)", "kbtp decode (Python)", "tshark + C plugin"
#: what to_json writes besides the kbtp.* keys, as tshark names it
WHERE = ("frame.number", "frame.time_epoch", "ip.src", "ip.dst", "ipv6.src", "ipv6.dst", "tcp.srcport",
         "tcp.dstport", "infiniband.bth.destqp")


def kbtp_fields() -> list[str]:
    """Every kbtp.* key kbtp decode --json can write: fields and flag bits of the tables."""
    index = T.wire_fields()
    keys = set(index) | {bit for k, (f, _) in index.items() for m in (*T.MESSAGES, None)
                         for bit, _ in T.flag_bits(k, f, m)}
    return [f"kbtp.{k}" for k in sorted(keys)]


def tshark_cmd(binding: str, pcap: Path) -> list[str]:
    tcp = ["-o", "tcp.try_heuristic_first:TRUE"] if binding == "iwarp" else []
    fields = [a for f in (*WHERE, *kbtp_fields()) for a in ("-e", f)]
    return ["tshark", "-n", "-r", str(pcap), *tcp, "-Y", "kbtp", "-T", "fields", "-E", "occurrence=a", *fields]


def capture(directory: Path, binding: str, messages: int) -> Path:
    """The capture of ``messages`` KBTP messages (rounded up to an even count), made once."""
    ops = max(1, -(-(messages - 2) // 2))
    path = directory / f"core_{binding}_{2 * ops + 2}msgs.pcap"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        build_one = bench_dissector.roce_capture if binding == "roce" else bench_dissector.iwarp_capture
        tmp = path.with_suffix(".tmp")
        build_one(tmp, ops, bench_dissector.kbtp_message)
        tmp.replace(path)
        print(f"wrote {path}", file=sys.stderr, flush=True)
    return path


def measure(caps: dict[str, Path], rounds: int, preload: Path) -> dict[tuple[str, str], tuple]:
    """Best (CPU, wall, peak RSS) per (binding, tool), rounds interleaved."""
    bench_dissector.check_plugins(TSHARK, [], preload)
    fast = dict(os.environ)
    fast.pop(core.ENV, None)
    pure = dict(os.environ, **{core.ENV: "python"})
    best: dict[tuple[str, str], tuple] = {}
    for r in range(rounds):
        for binding, pcap in caps.items():
            for tool, cmd, env in ((CORE, [*KBTP, str(pcap)], fast), (PYTHON, [*KBTP, str(pcap)], pure),
                                   (TSHARK, tshark_cmd(binding, pcap), bench_dissector.tshark_env(preload))):
                got = bench_decode.run(cmd, env)
                old = best.get((binding, tool))
                best[(binding, tool)] = got if old is None or got[0] < old[0] else old
                print(f"round {r + 1}/{rounds} {binding:5} {tool:22} {got[0]:7.2f} s CPU {got[1]:7.2f} s wall "
                      f"{got[2] / 1e6:6.1f} MB", file=sys.stderr, flush=True)
    return best


def table(best, caps: dict[str, Path], messages: dict[str, int], small: dict[str, tuple]) -> str:
    lines = [f"Captures of {min(messages.values()):,} KBTP messages or more (`tools/bench_core.py`); output to "
             "/dev/null; best of interleaved rounds; MB/s and messages/s per CPU second (one core).", "",
             "| binding | tool | CPU s (wall) | MB/s | messages/s | peak RSS | CPU vs the core |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    worst_rate, worst_tshark = None, None
    for binding, pcap in caps.items():
        size, n = pcap.stat().st_size, messages[binding]
        base = best[(binding, CORE)][0]
        label = "RoCEv2" if binding == "roce" else "iWARP"
        for tool in (CORE, PYTHON, TSHARK):
            cpu, wall, peak, _ = best[(binding, tool)]
            lines.append(f"| {label} ({size / 1e6:,.0f} MB) | {tool} | {cpu:.2f} ({wall:.2f}) "
                         f"| {size / 1e6 / cpu:,.1f} | {n / cpu:,.0f} | {peak / 1e6:.0f} MB | {cpu / base:.1f}× |")
        rate = size / 1e6 / base
        ratio = best[(binding, TSHARK)][0] / base
        worst_rate = rate if worst_rate is None else min(worst_rate, rate)
        worst_tshark = ratio if worst_tshark is None else min(worst_tshark, ratio)
    met = {True: "met", False: "**not met**"}
    lines += ["", f"Slowest core: **{worst_rate:.0f} MB/s** on one core (target: at least 100; "
              f"{met[worst_rate >= 100]}). Smallest CPU ratio to tshark with the C plugin: **{worst_tshark:.1f}×** "
              f"(target: at least 10; {met[worst_tshark >= 10]})."]
    flat = "; ".join(f"{'RoCEv2' if b == 'roce' else 'iWARP'} {small[b][2] / 1e6:.0f} MB at a tenth the messages, "
                     f"{best[(b, CORE)][2] / 1e6:.0f} MB at all of them" for b in caps)
    lines.append(f"Peak RSS of the core: {flat}.")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capture", type=Path, default=Path(tempfile.gettempdir()) / "kbtp_bench_core",
                    help="folder of the generated captures (reused when present)")
    ap.add_argument("--messages", type=int, default=1_000_000, help="KBTP messages per capture")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the best counts")
    perf_docs.add_write_docs(ap)
    args = ap.parse_args()
    if not core.BUILT:
        print("the compiled core is not built: pip install -e . (gcc)", file=sys.stderr)
        return 1
    if args.write_docs and args.messages < 1_000_000:
        print("--write-docs wants captures of at least 1,000,000 messages", file=sys.stderr)
        return 1
    if args.write_docs:
        perf_docs.check_section(args.write_docs, "bench_core")
    caps = {b: capture(args.capture, b, args.messages) for b in ("roce", "iwarp")}
    messages = {b: 2 * max(1, -(-(args.messages - 2) // 2)) + 2 for b in caps}
    small = {b: bench_decode.run([*KBTP, str(capture(args.capture, b, args.messages // 10))]) for b in caps}
    with tempfile.TemporaryDirectory(prefix="kbtp-bench-core-") as tmp:
        preload = build(Path(tmp), preload=True)
        best = measure(caps, args.rounds, preload)
    out = table(best, caps, messages, small)
    print(out)
    if args.write_docs:
        perf_docs.write_section(args.write_docs, "bench_core", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
