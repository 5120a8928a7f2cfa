#!/usr/bin/env python3
"""Codec versus Scapy, per message kind, measured side by side in one run.

For each opcode (with its conditional items present) it times codec encode+decode and
Scapy build+dissect of the same message, and prints the ratio. ``--write-docs`` rewrites
its table in docs/PERFORMANCE.md. Absolute times depend on the machine; the ratios are
what to read.
"""
from __future__ import annotations

import argparse
import sys
import time

import perf_docs

from kbtp_scapy import codec, tables as T
from kbtp_scapy.layers.kbtp import KBTP, build_packet


def _sample(opcode: int) -> dict:
    """A message of this opcode with every conditional item present."""
    values = {"opcode": opcode, "request_id": 7, "handle": 0x4001}
    for f in T.flatten(T.BY_OPCODE[opcode].body):
        values[f.key] = b"KVBLOCK!" if f.field.size == 0 else (
            b"\x11" * f.field.size if f.field.is_bytes else 1)
    for key in [k for k, v in values.items() if k.endswith("features") or k == "flags"]:
        values.pop(key)
    values.pop("dd.length", None)
    return values


def _per_op(fn, seconds: float) -> float:
    """Mean time of one call over a batch lasting about ``seconds``."""
    n, start = 0, time.perf_counter()
    while True:
        for _ in range(20):
            fn()
        n += 20
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return elapsed / n


def _compare(a, b, seconds: float, rounds: int = 5) -> tuple[float, float]:
    """Best of interleaved rounds for both, so load from elsewhere hits both alike."""
    best_a = best_b = float("inf")
    for _ in range(rounds):
        best_a = min(best_a, _per_op(a, seconds / rounds))
        best_b = min(best_b, _per_op(b, seconds / rounds))
    return best_a, best_b


def run(seconds: float, addr_le: bool) -> list[tuple[str, float, float]]:
    rows = []
    for msg in T.MESSAGES:
        values = _sample(msg.opcode)
        wire = codec.encode(values, addr_le)
        full = codec.decode(wire, addr_le)
        assert bytes(build_packet(full, addr_le=addr_le)) == wire
        codec_t, scapy_t = _compare(
            lambda: codec.decode(codec.encode(full, addr_le), addr_le),
            lambda: KBTP(bytes(build_packet(full, addr_le=addr_le)), addr_le=addr_le), seconds)
        rows.append((msg.name, codec_t, scapy_t))
    return rows


def table(rows: list[tuple[str, float, float]], addr_le: bool) -> str:
    lines = [f"| message ({'ADDR_LE' if addr_le else 'network order'}) | codec encode+decode (µs) "
             "| Scapy build+dissect (µs) | codec faster by |", "| --- | ---: | ---: | ---: |"]
    for name, c, s in rows:
        lines.append(f"| {name} | {c * 1e6:.1f} | {s * 1e6:.0f} | {s / c:.0f}× |")
    worst = min(s / c for _, c, s in rows)
    lines.append(f"\nSmallest ratio: **{worst:.0f}×** (target: at least 100×).")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=1.0, help="time per measurement")
    perf_docs.add_write_docs(ap)
    args = ap.parse_args()
    if args.write_docs:
        perf_docs.check_section(args.write_docs, "bench_codec")
    out = []
    for addr_le in (False, True):
        rows = run(args.seconds, addr_le)
        out.append(table(rows, addr_le))
        print(out[-1], "\n", flush=True)
    if args.write_docs:
        perf_docs.write_section(args.write_docs, "bench_codec", "\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
