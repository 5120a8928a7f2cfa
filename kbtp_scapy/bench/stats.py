"""Latency samples of one operation and what a benchmark reports from them: ops/s, MB/s,
percentiles (nearest rank, as perftest's), a log-scale histogram, throughput over time."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

#: the percentiles a report shows, perftest's and the tail's
PERCENTILES = (50.0, 90.0, 99.0, 99.9)


def percentile(ordered: list[int], p: float) -> int:
    """Nearest-rank percentile of sorted samples (the smallest value with p% at or below)."""
    if not ordered:
        raise ValueError("no samples")
    rank = max(1, math.ceil(round(p * len(ordered) / 100, 9)))   # 99.9% of 1000 is 999, not 1000
    return ordered[rank - 1]


@dataclass
class Samples:
    """One operation's completed requests: latency (ns: from the request handed to the RNIC
    to its completion received, what a capture's kbtp.time shows; for the direct modes, the
    whole sequence of RDMA operations), the caller's view of it (ns: from the call to its
    return, the client's own work included) and completion time (ns from the start)."""

    op: str
    size: int                               # octets of block data each request moves
    latencies: list[int] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)
    done_at: list[int] = field(default_factory=list)
    errors: int = 0
    expired: int = 0                        # DIRECT_ALLOC tickets abandoned before their BIND

    def add(self, latency_ns: int, call_ns: int, done_at_ns: int) -> None:
        self.latencies.append(latency_ns)
        self.calls.append(call_ns)
        self.done_at.append(done_at_ns)

    def summary(self, seconds: float, cpu_seconds: float, all_ops: int) -> dict[str, Any]:
        """The report's row: counts, rates, latency in microseconds, the client's own CPU per
        operation (its share of ``cpu_seconds`` by its share of ``all_ops``)."""
        ordered = sorted(self.latencies)
        n = len(ordered)
        row: dict[str, Any] = {"op": self.op, "bytes": self.size, "iterations": n, "errors": self.errors,
                               "expired": self.expired,
                               "seconds": round(seconds, 6),
                               "ops_per_s": round(n / seconds, 1) if seconds else 0.0,
                               "mb_per_s": round(n * self.size / seconds / 1e6, 3) if seconds else 0.0,
                               "gbit_per_s": round(n * self.size * 8 / seconds / 1e9, 4) if seconds else 0.0}
        if n:
            us = {"min": ordered[0], **{_key(p): percentile(ordered, p) for p in PERCENTILES},
                  "max": ordered[-1], "mean": sum(ordered) // n}
            row["latency_us"] = {k: round(v / 1000, 2) for k, v in us.items()}
            calls = sorted(self.calls)
            row["call_latency_us"] = {_key(p): round(percentile(calls, p) / 1000, 2) for p in PERCENTILES}
        row["cpu_us_per_op"] = round(cpu_seconds / all_ops * 1e6, 2) if all_ops else None
        return row

    def throughput(self, step_s: float, span_s: float) -> list[tuple[float, float]]:
        """(end of interval in s, ops/s in it), for the plot of throughput over time: whole
        intervals of the run's ``span_s`` only, as a last one cut short by the run's end
        would show a collapse that did not happen."""
        step = int(step_s * 1e9)
        counts: dict[int, int] = {}
        for t in self.done_at:
            counts[t // step] = counts.get(t // step, 0) + 1
        whole = int(round(span_s / step_s, 9))
        return [((i + 1) * step_s, counts.get(i, 0) / step_s) for i in range(whole)]


def _key(p: float) -> str:
    return f"p{p:g}"


def histogram(latencies: list[int], width: int = 50, per_decade: int = 5) -> list[str]:
    """Terminal lines: log-scale latency buckets (``per_decade`` a decade), each named by
    both its edges (from the lower, inclusive, to the upper), a bar of ``#`` scaled to the
    fullest bucket, count and share."""
    if not latencies:
        return []
    lo = math.floor(math.log10(min(latencies)) * per_decade)
    hi = math.floor(math.log10(max(latencies)) * per_decade)
    counts = [0] * (hi - lo + 1)
    for ns in latencies:
        counts[math.floor(math.log10(ns) * per_decade) - lo] += 1
    top, total = max(counts), len(latencies)
    lines = []
    for i, n in enumerate(counts):
        low, high = (10 ** ((lo + i + k) / per_decade) / 1000 for k in (0, 1))   # edges, in us
        bar = "#" * max(1 if n else 0, round(n / top * width))
        lines.append(f"{low:>9.1f} to {high:>9.1f} us | {bar:<{width}} {n:>8} {100 * n / total:5.1f}%")
    return lines
