"""Helpers of the attacks in tests/test_target_hostile.py: a ``kbtp target`` process with
its resident memory, file descriptors and metrics, a well-behaved client that keeps
checking its data in a thread of its own, and the attackers' raw tools (CM REQs on a UDP
socket, an MPA peer on a TCP socket).
"""
from __future__ import annotations

import asyncio
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import nullcontext

from kbtp_scapy import codec
from kbtp_scapy.initiator import Initiator, KbtpError
from kbtp_scapy.rnic import cm
from kbtp_scapy.vocab import Opcode
from kbtp_scapy.wire import iwarp as w, roce as rw
from kbtp_scapy.wire.iwarp_defs import DDP_UNTAGGED_LEN, FPDU_OVERHEAD, Op, fpdu_pad_len

from .live_capture import free_port
from .netns import enter

KBTP = [sys.executable, "-m", "kbtp_scapy"]


def samples(text: str) -> dict[str, float]:
    """Prometheus text exposition: every sample by its name and labels."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


class TargetProc:
    """``kbtp target`` as a user starts it, with ``--metrics``; ``netns`` runs it there."""

    def __init__(self, transport: str, host: str, *args: str, port: int | None = None,
                 netns: str | None = None) -> None:
        self.netns = netns
        with self._ns():
            self.metrics_port = free_port("127.0.0.1")
            port = port or (free_port(host) if transport == "iwarp" else 4791)
        self.url = f"{transport}://{host}:{port}"
        cmd = [*KBTP, "target", "--transport", transport, "--listen", f"{host}:{port}",
               "--metrics", str(self.metrics_port), "--duration", "300", *args]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        # its log goes to a file: a pipe nobody reads during a long run fills, and the
        # target would stop in the middle of a log line
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.proc.stdout.readline()
        if "listening on" not in line:
            self.proc.kill()
            raise AssertionError(line + self._log())

    def _ns(self):
        return enter(self.netns) if self.netns else nullcontext()

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as status:
            kb = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
        return kb / 1024

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by its name and labels, as Prometheus writes them."""
        with self._ns():
            return samples(urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                                  timeout=5).read().decode())

    def stop(self) -> str:
        """Ctrl-C; its log (stderr)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
        return self._log()

    def _log(self) -> str:
        self.proc.wait(20)
        self.log.seek(0)
        return self.log.read()


class RssWatch:
    """The target's resident memory sampled every 50 ms in a thread: its peak."""

    def __init__(self, target: TargetProc) -> None:
        self.target, self.peak = target, target.rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self.target.rss_mb())

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak


def under_attack(target: TargetProc, attack, **steady_options) -> dict:
    """Run coroutine function ``attack`` while a ``Steady`` client works: its result, the
    target's resident memory (MB) before, at the peak and half a second after, the
    client's operations and the target's metrics afterwards."""
    steady = Steady(target.url, **steady_options)
    time.sleep(0.5)
    base = target.rss_mb()
    watch = RssWatch(target)
    result = asyncio.run(asyncio.wait_for(attack(), 60))
    peak = watch.stop()
    time.sleep(0.5)
    return {"result": result, "base": base, "peak": peak, "after": target.rss_mb(),
            "ops": steady.stop(), "metrics": target.metrics()}


async def keep_sending(qp, request, per_tick: int, tick: float, limit: float = 8.0):
    """Post ``request(n)`` unsignaled, ``per_tick`` every ``tick`` seconds, until the
    connection ends or ``limit`` seconds pass: (seconds, requests posted, ended)."""
    loop = asyncio.get_running_loop()
    start, sent = loop.time(), 0
    while not qp.closed and loop.time() - start < limit:
        for _ in range(per_tick):
            qp.send(request(sent), signaled=False)
            sent += 1
        await asyncio.sleep(tick)
    return loop.time() - start, sent, qp.closed


class Steady:
    """A well-behaved initiator in a thread and event loop of its own: ALLOC_STORE, LOAD
    (compared with what it stored) and FREE, over and over, until ``stop``."""

    def __init__(self, url: str, netns: str | None = None, **options) -> None:
        self.url, self.netns, self.options = url, netns, options
        self.ops, self.errors = 0, []
        self.connected = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self.connected.wait(30):
            raise AssertionError(f"the well-behaved client could not connect: {self.errors}")

    def _run(self) -> None:
        with enter(self.netns) if self.netns else nullcontext():
            try:
                asyncio.run(self._work())
            except Exception as exc:     # reported by stop()
                self.errors.append(f"{type(exc).__name__}: {exc}")
                self.connected.set()

    async def _work(self) -> None:
        ini = await Initiator.connect(self.url, features=0, **self.options)
        self.connected.set()
        rng = random.Random(1)
        base = ini.target.handle_base
        while not self._stop.is_set():
            handle = base + rng.randrange(4)
            data = rng.randbytes(rng.choice((8, 300, 4096)))
            await asyncio.wait_for(ini.alloc_store(handle, data, seal=True,
                                                   inline=rng.random() < 0.5), 10)
            got = (await asyncio.wait_for(ini.load(handle), 10)).data
            if got != data:
                self.errors.append(f"LOAD 0x{handle:x}: {len(got)} octets, not what was stored")
            await asyncio.wait_for(ini.free(handle), 10)
            self.ops += 3
            await asyncio.sleep(0.005)
        await ini.goodbye(release=True)

    def stop(self) -> int:
        """The operations it completed; fails if any went wrong."""
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), "the well-behaved client hangs"
        assert self.errors == [], self.errors
        return self.ops


def hello(initiator_id: bytes | None = None, credits: int = 32) -> bytes:
    return codec.encode({"opcode": Opcode.HELLO, "hello.completion_credits": credits,
                         "hello.initiator_id": initiator_id or secrets.token_bytes(16)})


# -- RoCEv2: CM REQs from a plain UDP socket --------------------------------------------

class CmFlooder:
    """A UDP socket at (``host``, 4791) sending CM REQs to a target and counting its REPs
    (RoCEv2 answers the sender's address at port 4791, so this is where they come)."""

    def __init__(self, host: str, target: str) -> None:
        self.host, self.target = host, target
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.sock.bind((host, 4791))
        self.sock.setblocking(False)
        self.tx = rw.Path((host, 4791), (target, 4791))
        self.sent = 0
        self.reps = 0

    def req(self, port: int = 4791) -> bytes:
        """A REQ with a comm ID, QPN and PSN of its own, as librdmacm sends one."""
        msg = cm.CmMessage(cm.CmAttr.REQ, secrets.randbits(64), local_comm_id=secrets.randbits(32),
                           service_id=cm.rdma_cm_service_id(port), local_qpn=secrets.randbits(24) | 2,
                           starting_psn=secrets.randbits(24), local_gid=self.host,
                           remote_gid=self.target, responder_resources=16, initiator_depth=16,
                           private_data=cm.rdma_cm_private_data(self.host, self.target, 40000))
        head = rw.BTH_DETH.pack(rw.UD_SEND_ONLY, 0, rw.DEFAULT_PKEY, rw.CM_QPN, 0, rw.CM_QKEY,
                                rw.CM_QPN)
        return b"".join(rw.seal(self.tx, [head, cm.encode(msg)], 0))

    def send(self, count: int) -> None:
        for _ in range(count):
            datagram = self.req()
            while True:
                try:
                    self.sock.sendto(datagram, (self.target, 4791))
                    break
                except BlockingIOError:
                    time.sleep(0.001)
            self.sent += 1
            self.collect()

    def collect(self) -> None:
        while True:
            try:
                data = self.sock.recv(4096)
            except BlockingIOError:
                return
            msg = cm.decode(data[20:20 + cm.MAD_SIZE]) if len(data) >= 20 + cm.MAD_SIZE else None
            if msg is not None and msg.attr == cm.CmAttr.REP:
                self.reps += 1

    def close(self) -> None:
        self.collect()
        self.sock.close()


# -- iWARP: an MPA peer on a plain TCP socket -------------------------------------------

MPA_REQUEST = w.build_startup(True, w.FLAG_C, 2, 16, 16, w.IRD_P2P, w.ORD_RTR_WRITE)


def fpdu_send(payload: bytes, msn: int) -> bytes:
    """An untagged Send FPDU (queue 0) with its CRC."""
    head = w.untagged_head(True, Op.SEND, 0, msn, 0, len(payload))
    return head + payload + w.fpdu_tail(head, payload, True)


def rtr() -> bytes:
    head = w.tagged_head(True, Op.WRITE, 0, 0, 0)
    return head + w.fpdu_tail(head, b"", True)


async def mpa_peer(host: str, port: int, local: str | None = None):
    """TCP connect, MPA Request/Reply with CRCs, RTR: (reader, writer) of a ready stream."""
    reader, writer = await asyncio.open_connection(host, port, local_addr=(local, 0) if local else None)
    writer.write(MPA_REQUEST)
    reply = await asyncio.wait_for(reader.readexactly(20), 5)
    await asyncio.wait_for(reader.readexactly(int.from_bytes(reply[18:20], "big")), 5)
    writer.write(rtr())
    return reader, writer


async def read_fpdus(reader: asyncio.StreamReader, timeout: float,
                     limit: int | None = None) -> list[tuple[int, bytes]]:
    """(RDMAP opcode, untagged payload) of each FPDU until the stream ends, ``timeout``
    passes or ``limit`` FPDUs came."""
    out: list[tuple[int, bytes]] = []
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    try:
        while loop.time() < end and (limit is None or len(out) < limit):
            length = await asyncio.wait_for(reader.readexactly(2), end - loop.time())
            ulen = int.from_bytes(length, "big")
            rest = await asyncio.wait_for(
                reader.readexactly(ulen + FPDU_OVERHEAD - 2 + fpdu_pad_len(ulen)), 5)
            fpdu = length + rest
            out.append((fpdu[3] & 0x0F, fpdu[2 + DDP_UNTAGGED_LEN:2 + ulen]))
    except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
        pass
    return out


# -- vanished peers and their successors ---------------------------------------------

PEER = """
import asyncio, sys
from kbtp_scapy.initiator import Initiator
async def main():
    ini = await Initiator.connect(sys.argv[1], initiator_id=bytes.fromhex(sys.argv[2]),
                                  features=0, **({"local": sys.argv[4]} if sys.argv[4:] else {}))
    if sys.argv[3] == "bind":
        await ini.alloc_store(ini.target.handle_base, b"left behind", seal=True)
    print("ready", flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


def start_peer(url: str, ident: bytes, bind: bool, *extra: str, netns: str | None = None):
    """An initiator in a process of its own (to be killed), once it has had its HELLO_ACK
    (and stored a sealed block if ``bind``); ``extra``: its local address."""
    cmd = [sys.executable, "-c", PEER, url, ident.hex(), "bind" if bind else "idle", *extra]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.strip() == "ready", line + proc.stderr.read()
    return proc


#: slack for a busy 2-core machine on top of a computed bound
SLACK = 3.0


async def admitted_after(url: str, start: float, ident: bytes | None = None, **options) -> tuple:
    """HELLO again and again until one is answered OK: (seconds after ``start``, refusals
    seen, the Initiator)."""
    refusals = 0
    loop = asyncio.get_running_loop()
    while True:
        try:
            ini = await Initiator.connect(url, initiator_id=ident, features=0, **options)
            return loop.time() - start, refusals, ini
        except KbtpError as exc:
            assert exc.name in ("NO_SPACE", "ALREADY_BOUND"), exc
            refusals += 1
            assert loop.time() - start < 30, f"still refused ({exc.name}) after 30 s"
            await asyncio.sleep(0.2)
