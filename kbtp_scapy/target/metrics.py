"""The target's counters (the text's SHOULD in "Operational Considerations").

Counters per operation and status, ring occupancy, quota use per initiator, and what the
limits did: connections refused and why, connections terminated and why, liveness
probes, sessions retained, dropped for a newcomer and expired, with every limit's value.
They are served in the Prometheus text format by prometheus-client on request, and
printed as a table when ``kbtp target`` exits.
"""
from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ..tables.enums import OPCODES, STATUS

if TYPE_CHECKING:
    from .server import Target


#: upper bounds (seconds) of the latency histograms' buckets: 10 us to 1 s, then +Inf
LATENCY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
                   5e-2, 0.1, 0.25, 0.5, 1.0)


class Metrics:
    def __init__(self, target: Target) -> None:
        self.target = target
        self.operations: Counter[tuple[int, int]] = Counter()   # (opcode, status): count
        #: per opcode: requests per bucket (the last is +Inf) and the sum of their seconds
        self.latency: dict[int, list[int]] = {}
        self.latency_sum: dict[int, float] = {}
        self.hellos: Counter[str] = Counter()
        self.terminated: Counter[str] = Counter()   # connections the target ended, by why
        self.probes = 0
        # issue 25: KBTP Python code run per request, and requests a chain ran without any
        self.python: Counter[int] = Counter()     # opcode: requests served by Python
        self.chain: Counter[int] = Counter()      # opcode: requests run by a chain
        self.refills = 0                          # batches of chains rebuilt

    def python_request(self, opcode: int) -> None:
        self.python[opcode] += 1

    def chained(self, opcode: int, n: int) -> None:
        """``n`` requests a chain executed and completed (counted once per refill batch)."""
        self.chain[opcode] += n
        self.operations[opcode, 0] += n

    def operation(self, opcode: int, status: int) -> None:
        """Counted by number on the data path; named when shown."""
        self.operations[opcode, status] += 1

    def served(self, opcode: int, seconds: float) -> None:
        """A request's time from its arrival to its completion posted (data path: a bisect
        and two additions)."""
        counts = self.latency.get(opcode)
        if counts is None:
            counts = self.latency[opcode] = [0] * (len(LATENCY_BUCKETS) + 1)
        counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.latency_sum[opcode] = self.latency_sum.get(opcode, 0.0) + seconds

    def _histograms(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily("kbtp_request_latency_seconds", "Requests from arrival to "
                                       "completion posted, by opcode", labels=["opcode"])
        for opcode, counts in sorted(self.latency.items()):
            running, buckets = 0, []
            for bound, n in zip((*map(repr, LATENCY_BUCKETS), "+Inf"), counts):
                running += n
                buckets.append((bound, running))
            family.add_metric([OPCODES.describe(opcode)], buckets, self.latency_sum[opcode])
        return family

    def _named(self) -> list[tuple[str, str, int]]:
        return sorted((OPCODES.describe(op), STATUS.describe(st), n)
                      for (op, st), n in self.operations.items())

    def hello(self, status: str) -> None:
        self.hellos[status] += 1

    def probe(self) -> None:
        self.probes += 1

    def _limits(self) -> Iterator:
        t, s = self.target, self.target.sessions
        refused = CounterMetricFamily("kbtp_connections_refused",
                                      "Connections refused or closed before their session, by why",
                                      labels=["reason"])
        for reason, n in sorted(t.half_open.refused.items()):
            refused.add_metric([reason], n)
        yield refused
        ended = CounterMetricFamily("kbtp_connections_terminated",
                                    "Session connections the target ended, by why", labels=["reason"])
        for reason, n in sorted(self.terminated.items()):
            ended.add_metric([reason], n)
        yield ended
        yield CounterMetricFamily("kbtp_liveness_probes", "Zero-length RDMA Writes sent to silent "
                                  "connections", value=self.probes)
        sessions = CounterMetricFamily("kbtp_sessions", "Sessions moved to retention, dropped "
                                       "from it for a new initiator, expired, ended idle for one, "
                                       "displaced for one (fair share), refused for their "
                                       "source's cap", labels=["event"])
        for event, n in (("retained", s.retained), ("evicted", s.evicted), ("expired", s.expired),
                         ("ended_idle", s.ended_idle), ("displaced", s.displaced),
                         ("refused_per_source", s.refused_per_source)):
            sessions.add_metric([event], n)
        yield sessions
        yield GaugeMetricFamily("kbtp_connections_half_open", "Connections in set-up or without "
                                "a session", value=t.half_open.count)
        limits = GaugeMetricFamily("kbtp_limit", "The target's limits (seconds, octets, counts)",
                                   labels=["limit"])
        for name, value in t.config.limits().items():
            limits.add_metric([name], value)
        yield limits

    # -- Prometheus ----------------------------------------------------------------------

    def collect(self) -> Iterator:
        ops = CounterMetricFamily("kbtp_operations", "KBTP requests completed, by opcode and status",
                                  labels=["opcode", "status"])
        for opcode, status, n in self._named():
            ops.add_metric([opcode, status], n)
        yield ops
        yield self._histograms()
        hellos = CounterMetricFamily("kbtp_hellos", "HELLOs answered, by HELLO_ACK status",
                                     labels=["status"])
        for status, n in sorted(self.hellos.items()):
            hellos.add_metric([status], n)
        yield hellos
        rings = GaugeMetricFamily("kbtp_ring_blocks", "Free blocks in each ring", labels=["ring"])
        for name, ring in self.target.rings():
            rings.add_metric([name], ring.occupancy())
        yield rings
        deferred = GaugeMetricFamily("kbtp_ring_deferred_frees", "Frees waiting for their slot",
                                     labels=["ring"])
        for name, ring in self.target.rings():
            deferred.add_metric([name], ring.deferred)
        yield deferred
        usage = GaugeMetricFamily("kbtp_quota_used", "Blocks bound plus tickets outstanding",
                                  labels=["initiator"])
        quota = GaugeMetricFamily("kbtp_quota", "Allocation Quota", labels=["initiator"])
        active = GaugeMetricFamily("kbtp_session_active", "1 while connected, 0 while retained",
                                   labels=["initiator"])
        for state in self.target.sessions.by_id.values():
            label = [state.initiator_id.hex()[:8]]
            usage.add_metric(label, state.usage)
            quota.add_metric(label, state.quota)
            active.add_metric(label, int(state.active))
        yield from (usage, quota, active)
        python = CounterMetricFamily("kbtp_python_requests", "Requests whose serving ran KBTP "
                                     "Python code (zero for chain-executed ones)", labels=["opcode"])
        chain = CounterMetricFamily("kbtp_chain_requests", "Requests a work-request chain ran "
                                    "from receive to completion", labels=["opcode"])
        for number in sorted(set(self.python) | set(self.chain)):
            python.add_metric([OPCODES.describe(number)], self.python[number])
            chain.add_metric([OPCODES.describe(number)], self.chain[number])
        yield from (python, chain)
        yield from self._limits()

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        """Serve ``/metrics`` over HTTP from a background thread."""
        registry = CollectorRegistry()
        registry.register(self)
        start_http_server(port, addr=addr, registry=registry)

    def table(self) -> str:
        """The counters as a plain text table."""
        rows = [("operation", "status", "count"), *((op, st, str(n)) for op, st, n in self._named()),
                *(("HELLO", st, str(n)) for st, n in sorted(self.hellos.items()))]
        # at least the usual widths, wider for "Unknown (0x7e)" and its kind
        w = [max(least, *(len(row[i]) for row in rows)) for i, least in enumerate((12, 17, 10))]
        lines = [f"{op:<{w[0]}} {st:<{w[1]}} {n:>{w[2]}}" for op, st, n in rows]
        for reason, n in sorted(self.target.half_open.refused.items()):
            lines.append(f"connections refused ({reason}): {n}")
        for reason, n in sorted(self.terminated.items()):
            lines.append(f"connections terminated ({reason}): {n}")
        for number in sorted(set(self.python) | set(self.chain)):
            lines.append(f"{OPCODES.describe(number)}: KBTP Python per request "
                         f"{self.python[number]}, run by chains {self.chain[number]}")
        if self.target.config.execution == "chains":
            lines.append(f"chain refills: {self.refills} batches")
        s = self.target.sessions
        lines.append(f"liveness probes: {self.probes}; sessions retained {s.retained}, "
                     f"evicted {s.evicted}, expired {s.expired}, ended idle {s.ended_idle}, "
                     f"displaced {s.displaced}, "
                     f"refused per source {s.refused_per_source}")
        for name, ring in self.target.rings():
            lines.append(f"ring {name}: {ring.occupancy()} free blocks, {ring.deferred} deferred frees")
        for state in self.target.sessions.by_id.values():
            lines.append(f"initiator {state.initiator_id.hex()[:8]}: {state.usage}/{state.quota} "
                         f"blocks, {'active' if state.active else 'retained'}")
        return "\n".join(lines)
