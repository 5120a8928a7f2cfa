#!/usr/bin/env python3
"""``kbtp decode --json`` against ``tshark -X lua_script:kbtp.lua -T json``, side by side.

The captures are ``tools/bench_dissector.py``'s (generated once, cached in ``--capture
DIR``): one RoCEv2 and one iWARP connection, each a HELLO/HELLO_ACK then LOADs (with the
RDMA Write of the block) and inline STOREs with their COMPLETIONs, 100,000 KBTP messages
or more, the ACKs between them. Per binding, in interleaved rounds (the best counts), one
run of each command with its JSON written to /dev/null; timed is the CPU time (user +
system) and the wall clock, and each run's peak resident memory is read from its rusage
(the commands are started by a small process of their own, so none of this script's
memory is counted).
**Target: decode at least 2 times tshark's message throughput.**

``--big`` also writes a capture of about ``--big-size`` octets in ``--capture`` (records
of both captures repeated, times moved on; every repetition of the iWARP capture is a new
connection that starts with its SYN), decodes it once and reports the peak resident
memory. **Target: under 100 MB whatever the file size.** ``--keep-big`` keeps that file.
``--write-docs`` writes the table into its section of docs/PERFORMANCE.md.
"""
from __future__ import annotations

import argparse
import json
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import bench_dissector  # noqa: E402 - the captures are that benchmark's
import perf_docs  # noqa: E402

LUA = ROOT / "dissector" / "kbtp.lua"
KBTP = [sys.executable, "-m", "kbtp_scapy", "decode", "--json", "-q"]


#: Starts the command with stdout on /dev/null and reports its exit status, CPU and wall
#: seconds and peak RSS. A process of its own: a child's peak RSS counts the memory it
#: shared with its parent before exec, and this script holds hundreds of MB of captures.
_SPAWN = """import json, os, sys, time
started = time.perf_counter()
pid = os.posix_spawnp(sys.argv[1], sys.argv[1:], dict(os.environ),
                      file_actions=[(os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0)])
_, status, usage = os.wait4(pid, 0)
print(json.dumps([os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime,
                  time.perf_counter() - started, usage.ru_maxrss * 1024]))
"""


def run(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float, int, str]:
    """(CPU seconds, wall seconds, peak resident octets, last line on stderr) of one run,
    stdout to /dev/null, in ``env`` when given."""
    with tempfile.TemporaryFile() as err:
        proc = subprocess.run([sys.executable, "-S", "-c", _SPAWN, *cmd], stdout=subprocess.PIPE,
                              stderr=err, text=True, check=False, env=env)
        err.seek(0)
        text = err.read().decode(errors="replace")
    code, cpu, wall, peak = json.loads(proc.stdout) if proc.returncode == 0 else (proc.returncode, 0, 0, 0)
    if code or "Lua" in text:
        raise SystemExit(f"{' '.join(cmd)} failed ({code}):\n{text}")
    last = text.strip().splitlines()[-1] if text.strip() else ""
    return cpu, wall, peak, last


def tshark_cmd(binding: str, pcap: Path, lua: Path) -> list[str]:
    tcp = ["-o", "tcp.try_heuristic_first:TRUE"] if binding == "iwarp" else []
    return ["tshark", "-n", "-r", str(pcap), *tcp, "-X", f"lua_script:{lua}", "-T", "json"]


def measure(caps: dict[str, Path], rounds: int, lua: Path) -> dict[tuple[str, str], tuple]:
    """Best (CPU, wall, peak RSS) per (binding, tool), rounds interleaved."""
    best: dict[tuple[str, str], tuple] = {}
    bench_dissector.check_plugins("tshark + kbtp.lua", ["-X", f"lua_script:{lua}"])
    for r in range(rounds):
        for binding, pcap in caps.items():
            for tool, cmd in (("kbtp decode", [*KBTP, str(pcap)]),
                              ("tshark", tshark_cmd(binding, pcap, lua))):
                got = run(cmd, bench_dissector.tshark_env() if tool == "tshark" else None)
                old = best.get((binding, tool))
                best[(binding, tool)] = got if old is None or got[0] < old[0] else old
                print(f"round {r + 1}/{rounds} {binding:5} {tool:11} {got[0]:7.2f} s CPU "
                      f"{got[1]:7.2f} s wall {got[2] / 1e6:6.1f} MB", file=sys.stderr, flush=True)
    return best


def write_big(path: Path, sources: list[Path], size: int) -> int:
    """A classic pcap of about ``size`` octets: the records of ``sources`` in turn, again
    and again, each repetition moved on in time. Returns the octets written."""
    bodies = [src.read_bytes() for src in sources]
    header = bodies[0][:24]
    records = []
    for body in bodies:
        at, recs = 24, []
        while at + 16 <= len(body):
            caplen = struct.unpack_from("<I", body, at + 8)[0]
            recs.append(body[at:at + 16 + caplen])
            at += 16 + caplen
        records.append(recs)
    written, shift = 24, 0
    with open(path, "wb") as out:
        out.write(header)
        while written < size:
            for recs in records:
                last = 0
                for rec in recs:
                    sec = struct.unpack_from("<I", rec)[0]
                    last = sec
                    out.write(struct.pack("<I", sec + shift) + rec[4:])
                    written += len(rec)
                shift += last - struct.unpack_from("<I", recs[0])[0] + 1
    return written


def table(best, messages: int, frames: dict[str, int], big: tuple | None) -> str:
    lines = [f"Captures of {messages:,} KBTP messages each (`tools/bench_dissector.py`'s); JSON to "
             "/dev/null; best of interleaved rounds.", "",
             "| binding | kbtp decode --json: CPU s (wall) | messages/s | peak RSS "
             "| tshark -T json + kbtp.lua: CPU s (wall) | messages/s | peak RSS | decode faster by |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    worst = None
    for binding in frames:
        d, t = best[(binding, "kbtp decode")], best[(binding, "tshark")]
        ratio = t[0] / d[0]
        worst = ratio if worst is None else min(worst, ratio)
        label = "RoCEv2" if binding == "roce" else "iWARP"
        lines.append(f"| {label} ({frames[binding]:,} frames) | {d[0]:.2f} ({d[1]:.2f}) "
                     f"| {messages / d[0]:,.0f} | {d[2] / 1e6:.0f} MB | {t[0]:.2f} ({t[1]:.2f}) "
                     f"| {messages / t[0]:,.0f} | {t[2] / 1e6:.0f} MB | **{ratio:.1f}×** |")
    verdict = "met" if worst is not None and worst >= 2 else "**not met**"
    lines += ["", f"Smallest ratio: **{worst:.1f}×** (target: at least 2×; {verdict})."]
    if big is not None:
        octets, seconds, peak, summary = big
        met = "met" if peak < 100e6 else "**not met**"
        lines.append(f"On a {octets / 1e9:.2f} GB capture ({summary}) `kbtp decode --json` took "
                     f"{seconds:.0f} s CPU with a peak RSS of **{peak / 1e6:.0f} MB** "
                     f"(target: under 100 MB; {met}).")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capture", type=Path, default=Path(tempfile.gettempdir()) / "kbtp_bench_dissector",
                    help="folder of the generated captures (reused when present)")
    ap.add_argument("--messages", type=int, default=100_000, help="KBTP messages per capture")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best counts")
    ap.add_argument("--lua", type=Path, default=LUA, help="the plugin tshark loads")
    ap.add_argument("--big", action="store_true", help="also decode a large capture for memory")
    ap.add_argument("--big-size", type=float, default=1.0, help="its size in GB (default 1)")
    ap.add_argument("--keep-big", action="store_true", help="keep the large capture afterwards")
    perf_docs.add_write_docs(ap)
    args = ap.parse_args()
    if args.write_docs and (args.messages < 100_000 or not args.big):
        print("--write-docs wants captures of at least 100,000 messages and --big", file=sys.stderr)
        return 1
    if args.write_docs:
        perf_docs.check_section(args.write_docs, "bench_decode")
    ops = max(1, -(-(args.messages - 2) // 2))
    caps = bench_dissector.captures(args.capture, ops, False)
    kbtp_caps = {b: caps[(b, "kbtp")] for b in ("roce", "iwarp")}
    frames = {b: bench_dissector._count(p) for b, p in kbtp_caps.items()}
    best = measure(kbtp_caps, args.rounds, args.lua)
    big = None
    if args.big:
        path = args.capture / "bench_decode_big.pcap"
        octets = write_big(path, list(kbtp_caps.values()), int(args.big_size * 1e9))
        try:
            cpu, _, peak, summary = run([*KBTP, str(path)])
        finally:
            if not args.keep_big:
                path.unlink()
        big = (octets, cpu, peak, summary)
    out = table(best, 2 * ops + 2, frames, big)
    print(out)
    if args.write_docs:
        perf_docs.write_section(args.write_docs, "bench_decode", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
