"""Helpers of the attack tests (tests/test_target_hostile*.py): a ``kbtp target`` process
with its resident memory, file descriptors and metrics, and the well-behaved clients that
must not suffer, the project's own ``Initiator``. The attackers themselves are in
``tests/attack.py``, which shares no code with the target.
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import nullcontext
from pathlib import Path

from kbtp_scapy.initiator import Initiator, KbtpError

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


PEER = [sys.executable, "-m", "tests.attack"]
ROOT = Path(__file__).resolve().parent.parent


def start_peer(url: str, ident: bytes, bind: bool, *extra: str, netns: str | None = None):
    """An attacker's session in a process of its own (to be killed or stopped), once it
    has had its HELLO_ACK (and stored a sealed block if ``bind``); ``extra``: its local
    address (needed on RoCEv2)."""
    cmd = [*PEER, url, ident.hex(), "bind" if bind else "idle", *extra]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
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
