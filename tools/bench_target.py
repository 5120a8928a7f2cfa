#!/usr/bin/env python
"""Benchmark the reference target: LOAD and ALLOC_STORE against a bare-socket baseline.

For every transport, operation and block size it starts ``kbtp target`` in its own
process on loopback with a pool of ``--pool-mib`` MiB (1 GiB by default), timing the
start-up to the "listening on" line and reading its resident memory (VmRSS) after start
and after the traffic. The reference initiator, in this process, keeps ``--window``
requests in flight for ``--seconds`` seconds of timed rounds: LOAD reads sealed blocks
filled beforehand; ALLOC_STORE stores into fresh handles, in rounds whose FREEs are not
timed. The transport's counters (``qp.stats``) give what each operation put on the
wire: datagrams by size on RoCEv2 (sizes from a short warm-up with a frame listener),
TCP payload octets, FPDUs and send calls on iWARP.

Right after each KBTP case the baseline, a server subprocess and a client in this
process, moves the same traffic without KBTP or RDMA: per operation the client sends the
same number of datagrams of the same sizes (RoCEv2: UDP between the same loopback
addresses) or the same octets, coalesced into one write per loop iteration or per 8
operations (iWARP: TCP, as the soft RNIC writes), and the server answers each operation
with the target's share once all of it has arrived, with the same window in flight. It is Python and asyncio,
non-blocking sockets and the same batching the soft RNIC uses, so the ratio measures
what KBTP and the RNIC add, not what the language costs. The baseline has one round
trip per operation; a store through RDMA Read takes two in KBTP.

Human progress goes to stderr and a table to stdout; ``--json FILE`` keeps everything,
``--markdown`` prints the table as Markdown too and ``--write-docs`` writes that into its
section of docs/PERFORMANCE.md.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import perf_docs

from kbtp_scapy.initiator import Initiator
from kbtp_scapy.rnic.iwarp import FLUSH_MESSAGES

TARGET_HOST = "127.77.0.1"      # loopback addresses of our own, clear of other tests
INITIATOR_HOST = "127.77.0.2"
ETH_IP_UDP = 14 + 20 + 8        # a RoCEv2 frame's headers around the UDP payload (IPv4)
MIB = 1 << 20
RSS_SLACK = 64 * MIB
START_TIMEOUT = 30.0            # a child process's ready line
CONNECT_TIMEOUT = 15.0          # the initiator's connection and HELLO
OP_TIMEOUT = 10.0               # a round overrunning its time by more has failed
LOST_AFTER = 1.0                # a baseline datagram exchange not done by then was lost
SOCK_BUF = 4 << 20              # as the soft RNIC's UDP socket
HEAD = struct.Struct("!IHH")    # baseline datagram: operation, index, datagrams in all
CHUNK = struct.Struct("!II")    # baseline TCP chunk: operation, octets in all
LISTENING = re.compile(r"listening on (\w+://\S+?:\d+)")
TRANSPORTS = ("iwarp", "roce")
OPS = ("LOAD", "ALLOC_STORE")
SIZES = (4096, 32768)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def share(per_op: float, i: int) -> int:
    """Operation ``i``'s whole part of a per-operation average, so N operations add up."""
    return math.floor((i + 1) * per_op + 1e-9) - math.floor(i * per_op + 1e-9)


def rss(pid: int) -> int:
    """Resident memory of ``pid`` in octets (VmRSS)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def cpu_us(pid: int | None = None) -> dict[str, int]:
    """CPU time (user + system) in microseconds of ``pid``, or of this process as "cpu_self"."""
    if pid is None:
        return {"cpu_self": int(time.process_time() * 1e6)}
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return {"cpu_peer": (int(fields[11]) + int(fields[12])) * 1_000_000 // os.sysconf("SC_CLK_TCK")}


# -- child processes -----------------------------------------------------------------------

class Child:
    """A subprocess that prints a ready line on stdout; stopped with SIGTERM, then SIGKILL."""

    def __init__(self, proc: asyncio.subprocess.Process, errors: Any, ready: re.Match,
                 startup: float) -> None:
        self.proc, self.errors, self.ready, self.startup = proc, errors, ready, startup

    @classmethod
    async def start(cls, argv: list[str], pattern: re.Pattern) -> Child:
        errors = tempfile.TemporaryFile("w+")
        began = time.monotonic()
        proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.PIPE, stderr=errors)
        try:
            async with asyncio.timeout(START_TIMEOUT):
                while line := (await proc.stdout.readline()).decode():
                    if match := pattern.search(line):
                        return cls(proc, errors, match, time.monotonic() - began)
            raise RuntimeError(f"exited with {await proc.wait()}: {cls._tail(errors)}")
        except TimeoutError:
            await cls._end(proc)
            errors.close()
            raise RuntimeError(f"no ready line within {START_TIMEOUT:g} s") from None
        except BaseException:
            await cls._end(proc)
            errors.close()
            raise

    @staticmethod
    def _tail(errors: Any) -> str:
        errors.seek(0)
        lines = [line for line in errors.read().splitlines() if line.strip()]
        return lines[-1] if lines else "no output"

    @staticmethod
    async def _end(proc: asyncio.subprocess.Process) -> bytes:
        if proc.returncode is None:
            proc.terminate()
        try:
            async with asyncio.timeout(10):
                out, _ = await proc.communicate()
        except TimeoutError:
            proc.kill()
            out, _ = await proc.communicate()
        return out or b""

    async def stop(self) -> str:
        """Stop the process; returns what it printed after the ready line."""
        try:
            return (await self._end(self.proc)).decode(errors="replace")
        finally:
            self.errors.close()


# -- the timed loop ------------------------------------------------------------------------

class Meter:
    """Counter deltas over the timed intervals only, and optional hooks around them."""

    def __init__(self, counters: Callable[[], dict[str, int]]) -> None:
        self.counters = counters
        self.total: Counter[str] = Counter()
        self.running = False
        self._at: dict[str, int] = {}

    def start(self) -> None:
        self.running = True
        self._at = dict(self.counters())

    def stop(self) -> None:
        self.running = False
        for key, value in self.counters().items():
            self.total[key] += value - self._at.get(key, 0)


async def drive(op: Callable[[int], Awaitable[None]], window: int, seconds: float,
                round_ops: int, meter: Meter,
                between: Callable[[int, int], Awaitable[None]] | None = None) -> tuple[int, float]:
    """Run ``op(0), op(1), ...`` with ``window`` in flight, in rounds of ``round_ops``,
    until ``seconds`` of rounds are timed; ``between`` runs untimed after each round.
    Returns (operations completed, seconds timed)."""
    loop = asyncio.get_running_loop()
    done, issued, timed = 0, 0, 0.0
    while timed < seconds:
        first, end_at = issued, loop.time() + seconds - timed

        async def worker(first: int = first, end_at: float = end_at) -> None:
            nonlocal issued, done
            while issued < first + round_ops and loop.time() < end_at:
                i = issued
                issued += 1
                await op(i)
                done += 1

        meter.start()
        began = loop.time()
        try:
            async with asyncio.timeout(seconds - timed + OP_TIMEOUT):
                await asyncio.gather(*(worker() for _ in range(window)))
        except TimeoutError:
            raise TimeoutError(f"operations still pending {OP_TIMEOUT:g} s after the deadline "
                               f"({done} completed)") from None
        timed += loop.time() - began
        meter.stop()
        if between is not None:
            await between(first, issued)
    return done, timed


async def windowed(op: Callable[[int], Awaitable[Any]], items: range, window: int) -> None:
    """Untimed helper work (filling, freeing) with ``window`` in flight."""
    it = iter(items)

    async def worker() -> None:
        for i in it:
            await op(i)
    try:
        async with asyncio.timeout(OP_TIMEOUT + len(items) * OP_TIMEOUT / 100):
            await asyncio.gather(*(worker() for _ in range(window)))
    except TimeoutError:
        raise TimeoutError(f"filling or freeing {len(items)} blocks took too long") from None


# -- KBTP ----------------------------------------------------------------------------------

@dataclass
class Opts:
    seconds: float
    window: int
    round_ops: int
    pool_mib: int
    warmup: float
    profile_dir: str | None
    target_args: tuple[str, ...] = ()   # more options for every target (--execution chains)


async def workload(ini: Any, op: str, base: int, rounds: int, data: bytes, window: int
                   ) -> tuple[Callable[[int], Awaitable[None]],
                              Callable[[int, int], Awaitable[None]] | None]:
    """The timed request ``one(i)`` of ``op`` and what runs untimed between rounds: for
    LOAD, blocks stored first (at most 256); for ALLOC_STORE, the FREEs of a round."""
    size = len(data)
    if op == "LOAD":
        filled = min(rounds, 256)
        await windowed(lambda i: ini.alloc_store(base + i, data, seal=True), range(filled), window)

        async def load(i: int) -> None:
            if (await ini.load(base + i % filled)).data_length != size:
                raise RuntimeError("LOAD returned a short block")
        return load, None

    async def store(i: int) -> None:
        await ini.alloc_store(base + i % rounds, data)

    async def free_round(first: int, end: int) -> None:
        await windowed(lambda i: ini.free(base + i % rounds), range(first, end), window)
    return store, free_round


async def bench_kbtp(url: str, pid: int, transport: str, op: str, size: int,
                     o: Opts) -> dict[str, Any]:
    """The initiator side of one case: warm-up (with a frame listener), then the timed run."""
    options = {"local": INITIATOR_HOST} if transport == "roce" else {}
    try:
        async with asyncio.timeout(CONNECT_TIMEOUT):
            ini = await Initiator.connect(url, features=0, credits=o.window, **options)
    except TimeoutError:
        raise TimeoutError(f"no session with {url} within {CONNECT_TIMEOUT:g} s") from None
    try:
        info = ini.target
        base, rounds = info.handle_base, max(1, min(o.round_ops, info.quota, info.handle_count))
        data = bytes(range(256)) * (size // 256) + bytes(size % 256)
        writes = Counter()
        if transport == "iwarp":      # count the initiator's send calls on its TCP transport
            tcp, write = ini.qp._tp, ini.qp._tp.write

            def counted(octets: bytes) -> None:
                writes["send_calls"] += 1
                write(octets)
            tcp.write = counted
        one, between = await workload(ini, op, base, rounds, data, o.window)

        frames: Counter[tuple[str, int]] = Counter()

        def listener(direction: str, frame: bytes, ns: int) -> None:
            if warm.running:        # not the untimed FREEs between rounds
                frames[direction, len(frame) - ETH_IP_UDP] += 1

        def counters() -> dict[str, int]:
            return {**ini.qp.stats, **writes, **cpu_us(), **cpu_us(pid)}

        warm = Meter(counters)
        if transport == "roce":
            ini.qp.frame_listeners.append(listener)
        warm_ops, _ = await drive(one, o.window, o.warmup, rounds, warm, between)
        if transport == "roce":
            ini.qp.frame_listeners.remove(listener)
        meter = Meter(counters)
        ops, secs = await drive(one, o.window, o.seconds, rounds, meter, between)
        await ini.goodbye(release=True)
    finally:
        await ini.close()
    stats = dict(meter.total)
    result: dict[str, Any] = {
        "ops": ops, "seconds": secs, "round_ops": rounds, "ops_per_s": ops / secs,
        "mb_per_s": ops * size / secs / 1e6,
        "data_path": ("RDMA Write" if op == "LOAD" else
                      "inline Send" if size <= info.max_inline else "RDMA Read"),
        "stats": stats, "per_op": {k: v / ops for k, v in sorted(stats.items())}}
    if transport == "roce":
        result["wire"] = {d: sorted([n, c / warm_ops] for (dd, n), c in frames.items() if dd == d)
                          for d in ("tx", "rx")}
    else:
        result["wire"] = {d: stats.get(f"bytes_{d}", 0) / ops for d in ("tx", "rx")}
    return result


# -- the baseline --------------------------------------------------------------------------

def datagrams(profile: list[list[float]], i: int) -> list[int]:
    """Sizes of operation ``i``'s datagrams in one direction (at least one)."""
    sizes = [max(HEAD.size, int(n)) for n, per_op in profile for _ in range(share(per_op, i))]
    return sizes or [int(max(profile)[0]) if profile else HEAD.size]


def chunk(per_op: float, i: int) -> int:
    return max(CHUNK.size, share(per_op, i))


class UdpPeer:
    """A non-blocking UDP socket read in batches from the event loop, as the RNIC's."""

    def __init__(self, host: str, on_datagram: Callable[[int, int, int, tuple], None]) -> None:
        self.loop = asyncio.get_running_loop()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            self.sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)
        self.sock.bind((host, 0))
        self.sock.setblocking(False)
        self.address = self.sock.getsockname()
        self.on_datagram = on_datagram
        self.pad = memoryview(bytes(65536))
        self.dropped = 0
        self._buf = bytearray(65536)
        self.loop.add_reader(self.sock.fileno(), self._poll)

    def send(self, op: int, sizes: list[int], addr: tuple) -> None:
        for k, n in enumerate(sizes):
            try:
                self.sock.sendmsg([HEAD.pack(op, k, len(sizes)), self.pad[:n - HEAD.size]], (), 0,
                                  addr)
            except (BlockingIOError, InterruptedError):
                self.dropped += 1

    def _poll(self) -> None:
        for _ in range(256):
            try:
                n, addr = self.sock.recvfrom_into(self._buf)
            except (BlockingIOError, InterruptedError):
                break
            if n >= HEAD.size:
                self.on_datagram(*HEAD.unpack_from(self._buf), addr)

    def close(self) -> None:
        self.loop.remove_reader(self.sock.fileno())
        self.sock.close()


class TcpPeer(asyncio.Protocol):
    """Chunks of ``CHUNK`` header and padding; what one loop iteration queues leaves in
    one write, or at most ``FLUSH_MESSAGES`` chunks wait for that, as the RNIC's iWARP
    transport flushes."""

    def __init__(self, on_chunk: Callable[[int], None]) -> None:
        self.on_chunk = on_chunk
        self.tp: asyncio.Transport | None = None
        self.pad = bytes(65536)
        self.rx = bytearray()
        self.tx = bytearray()
        self.queued = 0
        self.send_calls = self.bytes_tx = 0
        self.lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.tp = transport    # type: ignore[assignment]   asyncio sets TCP_NODELAY

    def send(self, op: int, n: int) -> None:
        self.tx += CHUNK.pack(op, n)
        self.tx += self.pad[:n - CHUNK.size]
        self.message_queued()

    def message_queued(self) -> None:
        """One more message is in ``tx``: it leaves at the end of this loop iteration, or
        now if ``FLUSH_MESSAGES`` are waiting."""
        if not self.queued:
            asyncio.get_running_loop().call_soon(self._flush)
        self.queued += 1
        if self.queued >= FLUSH_MESSAGES:
            self._flush()

    def _flush(self) -> None:
        self.queued = 0
        if self.tx and not self.tp.is_closing():
            data, self.tx = self.tx, bytearray()
            self.send_calls += 1
            self.bytes_tx += len(data)
            self.tp.write(data)

    def data_received(self, data: bytes) -> None:
        rx = self.rx
        rx += data
        at = 0
        while len(rx) - at >= CHUNK.size:
            op, n = CHUNK.unpack_from(rx, at)
            if len(rx) - at < n:
                break
            at += n
            self.on_chunk(op)
        del rx[:at]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(exc)


async def serve_baseline(spec: dict[str, Any]) -> None:
    """The baseline server process: answer each operation with its share, until killed
    or ``spec["lifetime"]`` seconds have passed."""
    if spec["kind"] == "udp":
        got: Counter[int] = Counter()

        def on_datagram(op: int, _k: int, total: int, addr: tuple) -> None:
            got[op] += 1
            if got[op] == total:
                del got[op]
                peer.send(op, datagrams(spec["reply"], op), addr)
        peer = UdpPeer(spec["host"], on_datagram)
        address = peer.address
    else:
        protocols: list[TcpPeer] = []

        def factory() -> TcpPeer:
            proto = TcpPeer(lambda op: proto.send(op, chunk(spec["reply"], op)))
            protocols.append(proto)
            return proto
        server = await asyncio.get_running_loop().create_server(factory, spec["host"], 0)
        address = server.sockets[0].getsockname()
    print(f"baseline listening on {address[0]}:{address[1]}", flush=True)
    await asyncio.sleep(spec["lifetime"])


async def bench_baseline(transport: str, size: int, wire: dict[str, Any], rounds: int,
                         o: Opts) -> dict[str, Any]:
    """The baseline client of one case, against a fresh server subprocess."""
    kind = "udp" if transport == "roce" else "tcp"
    spec = {"kind": kind, "host": TARGET_HOST, "reply": wire["rx"],
            "lifetime": 4 * (o.seconds + o.warmup) + 60}
    server = await Child.start([sys.executable, os.path.abspath(__file__), "--serve-baseline",
                                json.dumps(spec)],
                               re.compile(r"baseline listening on ([\d.]+):(\d+)"))
    addr, pid = (server.ready[1], int(server.ready[2])), server.proc.pid
    loop = asyncio.get_running_loop()
    pending: dict[int, tuple[asyncio.Future, float]] = {}     # operation: (answer, sent at)
    lost = 0
    try:
        if kind == "udp":
            got: Counter[int] = Counter()

            def on_datagram(op_id: int, _k: int, total: int, _addr: tuple) -> None:
                got[op_id] += 1
                if got[op_id] == total:
                    del got[op_id]
                    if (entry := pending.pop(op_id, None)) is not None:
                        entry[0].set_result(None)
            udp = UdpPeer(INITIATOR_HOST, on_datagram)
            send = lambda i: udp.send(i, datagrams(wire["tx"], i), addr)
            counters = lambda: {"dropped": udp.dropped, **cpu_us(), **cpu_us(pid)}
        else:
            def on_chunk(op_id: int) -> None:
                if (entry := pending.pop(op_id, None)) is not None:
                    entry[0].set_result(None)
            _, tcp = await loop.create_connection(lambda: TcpPeer(on_chunk), *addr)
            send = lambda i: tcp.send(i, chunk(wire["tx"], i))
            counters = lambda: {"send_calls": tcp.send_calls, **cpu_us(), **cpu_us(pid)}

        async def one(i: int) -> None:
            future = loop.create_future()
            pending[i] = future, loop.time()
            send(i)
            await future

        async def sweep() -> None:
            """Datagrams may be lost: an operation unanswered for LOST_AFTER is given up."""
            nonlocal lost
            while True:
                await asyncio.sleep(LOST_AFTER / 4)
                late = loop.time() - LOST_AFTER
                for i in [i for i, (_, at) in pending.items() if at < late]:
                    pending.pop(i)[0].set_result(None)
                    lost += 1
        sweeper = loop.create_task(sweep())

        await drive(one, o.window, o.warmup, rounds, Meter(counters))
        meter = Meter(counters)
        ops, secs = await drive(one, o.window, o.seconds, rounds, meter)
        sweeper.cancel()
        if kind == "udp":
            udp.close()
        else:
            tcp.tp.close()
    finally:
        await server.stop()
    ok = ops - lost
    return {"ops": ok, "lost": lost, "seconds": secs, "ops_per_s": ok / secs,
            "mb_per_s": ok * size / secs / 1e6,
            "per_op": {k: v / max(1, ops) for k, v in meter.total.items()}}


# -- one case ------------------------------------------------------------------------------

def target_argv(transport: str, size: int, o: Opts, name: str) -> list[str]:
    blocks = max(1, o.pool_mib * MIB // size)
    prefix = [sys.executable]
    if o.profile_dir:
        prefix += ["-m", "cProfile", "-o", os.path.join(o.profile_dir, f"{name}.prof")]
    return prefix + ["-m", "kbtp_scapy", "target", "--transport", transport,
                     # a RoCEv2 listener names an rdma_cm port (4791 when omitted), never 0
                     "--listen", TARGET_HOST if transport == "roce" else f"{TARGET_HOST}:0",
                     "--blocks", str(blocks),
                     "--block-size", str(size), "--features", "none",
                     "--credits", str(max(32, o.window)), *o.target_args]


async def run_case(transport: str, op: str, size: int, o: Opts) -> dict[str, Any]:
    name = f"{transport}-{op}-{size}"
    pool = max(1, o.pool_mib * MIB // size) * size
    case: dict[str, Any] = {"transport": transport, "op": op, "size": size, "pool": pool}
    log(f"{name}: starting target ({pool // MIB} MiB pool)")
    try:
        target = await Child.start(target_argv(transport, size, o, name), LISTENING)
    except Exception as exc:
        case["error"] = f"target did not start: {exc}"
        log(f"{name}: FAILED: {case['error']}")
        return case
    try:
        case["startup_s"] = target.startup
        case["rss_start"] = rss(target.proc.pid)
        log(f"{name}: target up in {target.startup:.2f} s, RSS {case['rss_start'] / MIB:.1f} MiB; "
            f"KBTP for {o.seconds} s")
        case["kbtp"] = await bench_kbtp(target.ready[1], target.proc.pid, transport, op, size, o)
        case["rss_end"] = rss(target.proc.pid)
    except Exception as exc:
        case["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        case["target_output"] = await target.stop()
    if "error" in case:
        log(f"{name}: FAILED: {case['error']}")
        return case
    # the target faults its whole pool in at start, so both figures count all of it
    case["rss_ok"] = max(case["rss_start"], case["rss_end"]) <= pool + RSS_SLACK
    log(f"{name}: KBTP {case['kbtp']['ops_per_s']:.0f} ops/s; baseline for {o.seconds} s")
    try:
        case["baseline"] = await bench_baseline(transport, size, case["kbtp"]["wire"],
                                                case["kbtp"]["round_ops"], o)
    except Exception as exc:
        case["error"] = f"baseline: {type(exc).__name__}: {exc}"
        log(f"{name}: FAILED: {case['error']}")
        return case
    case["ratio"] = case["kbtp"]["ops_per_s"] / case["baseline"]["ops_per_s"]
    log(f"{name}: baseline {case['baseline']['ops_per_s']:.0f} ops/s, ratio {case['ratio']:.2f}")
    return case


# -- output --------------------------------------------------------------------------------

def wire_text(case: dict[str, Any]) -> str:
    """What one operation put on the wire, as the initiator counted it."""
    per = case["kbtp"]["per_op"]
    if case["transport"] == "roce":
        return f"{per.get('frames_tx', 0):.1f}/{per.get('frames_rx', 0):.1f} datagrams"
    return (f"{per.get('bytes_tx', 0):.0f}/{per.get('bytes_rx', 0):.0f} B, "
            f"{per.get('fpdus_tx', 0):.1f}/{per.get('fpdus_rx', 0):.1f} FPDUs")


def rows(cases: list[dict[str, Any]]) -> list[list[str]]:
    out = []
    for c in cases:
        head = [c["transport"], c["op"], str(c["size"])]
        if "ratio" not in c:
            out.append(head + ["FAILED"] + [""] * (len(HEADER) - 4))
            continue
        k, b = c["kbtp"], c["baseline"]
        out.append(head + [k["data_path"], f"{k['ops_per_s']:.0f}", f"{k['mb_per_s']:.1f}",
                           f"{b['ops_per_s']:.0f}", f"{b['mb_per_s']:.1f}", f"{c['ratio']:.2f}",
                           f"{cpu(k)} / {cpu(b)}", wire_text(c)])
    return out


def cpu(side: dict[str, Any]) -> str:
    """CPU microseconds per operation: the peer process (target, server) + this one."""
    per = side["per_op"]
    return f"{per.get('cpu_peer', 0):.0f}+{per.get('cpu_self', 0):.0f}"


HEADER = ["transport", "op", "size", "data path", "KBTP ops/s", "KBTP MB/s", "baseline ops/s",
          "baseline MB/s", "KBTP/baseline", "CPU us/op: KBTP t+i / base s+c",
          "wire per op (tx/rx)"]


def notes(cases: list[dict[str, Any]]) -> list[str]:
    """Failures with their errors, then start-up time and resident memory per target."""
    lines = [f"{c['transport']} {c['op']} {c['size']} FAILED: {c['error']}"
             for c in cases if "ratio" not in c]
    for c in cases:
        if "rss_ok" in c:
            lines.append(f"{c['transport']} {c['op']} {c['size']}: {c['pool'] // MIB} MiB pool, "
                         f"start-up {c['startup_s']:.2f} s, RSS {c['rss_start'] / MIB:.0f} MiB "
                         f"after start, {c['rss_end'] / MIB:.0f} MiB after traffic "
                         f"({'within' if c['rss_ok'] else 'OVER'} pool + 64 MiB)")
    return lines


def text_table(cases: list[dict[str, Any]]) -> str:
    table = [HEADER] + rows(cases)
    widths = [max(len(r[i]) for r in table if len(r) > i) for i in range(len(HEADER))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in table]
    return "\n".join(lines + [""] + notes(cases))


def markdown(cases: list[dict[str, Any]], o: Opts) -> str:
    lines = [(f"Window {o.window}, {o.seconds:g} s per case, {os.cpu_count()} CPUs; "
             "MB/s counts block payload (10^6 octets). Baseline: the same datagrams (RoCEv2) or "
             "octets (iWARP) per operation over bare asyncio sockets, in the same run. CPU: "
             "microseconds per operation in the target (t) and initiator (i), and in the "
             "baseline's server (s) and client (c)."), "",
             "| " + " | ".join(HEADER) + " |", "|" + " --- |" * len(HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in rows(cases)]
    return "\n".join(lines + [""] + [f"- {line}" for line in notes(cases)])


# -- command line --------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Every case starts its own target (python -m kbtp_scapy target) on "
               f"{TARGET_HOST}; the initiator and the baseline client use {INITIATOR_HOST}. "
               "A case that fails (a transport not ready, a target that does not start) is "
               "reported with its error and the run goes on. Exit status 1 if any case failed.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seconds", type=float, default=3.0, help="timed seconds per case and side")
    p.add_argument("--warmup", type=float, default=0.5,
                   help="untimed seconds before each timed run (RoCEv2: datagram sizes measured)")
    p.add_argument("--transports", default=",".join(TRANSPORTS), help="comma-separated: iwarp,roce")
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated: LOAD,ALLOC_STORE")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="block sizes in octets")
    p.add_argument("--window", type=int, default=16, help="requests in flight (initiator credits)")
    p.add_argument("--round", dest="round_ops", type=int, default=1024,
                   help="ALLOC_STORE operations per timed round (then freed untimed)")
    p.add_argument("--pool-mib", type=int, default=1024,
                   help="target pool in MiB (blocks = pool / size)")
    p.add_argument("--profile-target", metavar="DIR", default=None,
                   help="run each target under cProfile, writing DIR/TRANSPORT-OP-SIZE.prof")
    p.add_argument("--target-args", default="", metavar="ARGS",
                   help="more options for every target, e.g. '--execution chains'")
    p.add_argument("--json", metavar="FILE", help="write every result and counter here")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown too")
    perf_docs.add_write_docs(p)
    p.add_argument("--serve-baseline", metavar="SPEC", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    args.ops = [x.strip().upper() for x in args.ops.split(",") if x.strip()]
    args.sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    bad = [t for t in args.transports if t not in TRANSPORTS]
    bad += [x for x in args.ops if x not in OPS]
    if bad:
        p.error(f"unknown transport or op: {', '.join(bad)}")
    if args.window < 1 or args.seconds <= 0 or args.round_ops < 1 or args.warmup <= 0:
        p.error("--window and --round must be at least 1, --seconds and --warmup positive")
    if args.profile_target and os.path.exists(args.profile_target) \
            and not os.path.isdir(args.profile_target):
        p.error(f"--profile-target {args.profile_target}: not a directory")
    if any(s < 8 or s % 8 for s in args.sizes):
        p.error("sizes must be multiples of 8")
    return args


async def run_all(args: argparse.Namespace, o: Opts) -> list[dict[str, Any]]:
    return [await run_case(t, op, s, o) for t in args.transports for op in args.ops
            for s in args.sizes]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_baseline:
        asyncio.run(serve_baseline(json.loads(args.serve_baseline)))
        return 0
    o = Opts(args.seconds, args.window, args.round_ops, args.pool_mib, args.warmup,
             args.profile_target, tuple(args.target_args.split()))
    if o.profile_dir:
        os.makedirs(o.profile_dir, exist_ok=True)
    if args.write_docs:
        perf_docs.check_section(args.write_docs, "bench_target")
    cases = asyncio.run(run_all(args, o))
    print(text_table(cases))
    if args.markdown:
        print()
        print(markdown(cases, o))
    if args.write_docs:
        perf_docs.write_section(args.write_docs, "bench_target", markdown(cases, o))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"options": vars(o), "cases": cases}, out, indent=1)
    return 1 if any("ratio" not in c for c in cases) else 0


if __name__ == "__main__":
    sys.exit(main())
