"""``kbtp demo``: the main job on built-in defaults, a tour of the toolkit in a minute.

For each binding it starts a reference target, runs a short workload with the reference
initiator while both sides capture, decodes the capture with tshark and the KBTP
dissector, replays it against the target, fuzzes briefly and runs the conformance suite.
Every step runs the same ``kbtp`` command a user would, so the demo shows what they see.
"""
from __future__ import annotations

import asyncio
import collections
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from .. import tables as T
from ..capture import kbtp_messages, rdma_messages, read_packets
from ..samples import write_samples
from ..wire.address import ROCE_PORT
from .options import Output

KBTP = [sys.executable, "-m", "kbtp_scapy"]
#: (target, initiator) addresses: loopback, away from a ``kbtp target`` on its defaults
HOSTS = {"iwarp": ("127.0.0.1", "127.0.0.1"), "roce": ("127.74.0.1", "127.74.0.2")}


@dataclass
class Step:
    name: str
    ok: bool
    detail: str


class Progress:
    """The step under way, one line on stderr rewritten in place; only on a terminal."""

    def __init__(self) -> None:
        self.enabled, self.shown = sys.stderr.isatty(), 0

    def show(self, text: str) -> None:
        if self.enabled:
            self.clear()
            text = text[:shutil.get_terminal_size().columns - 1]    # a wrapped line stays
            click.echo(f"\r{text}", err=True, nl=False)
            self.shown = len(text)

    def clear(self) -> None:
        if self.shown:
            click.echo("\r" + " " * self.shown + "\r", err=True, nl=False)
            self.shown = 0


PROGRESS = Progress()


def result(label: str, name: str, ok: bool, detail: str) -> None:
    """A step's result, printed once on stdout when it is known."""
    PROGRESS.clear()
    click.echo(f"  {label:<6} {name:<9} {'ok' if ok else 'FAILED'}: {detail}")


@dataclass
class Binding:
    transport: str
    steps: list[Step] = field(default_factory=list)

    def add(self, name: str, ok: bool, detail: str) -> None:
        self.steps.append(Step(name, ok, detail))
        result(self.transport, name, ok, detail)

    def running(self, name: str, what: str) -> None:
        PROGRESS.show(f"  {self.transport:<6} {name:<9} {what} ...")


#: what each step does, for the progress line
STEPS = {"workload": "a session of every operation, captured on both sides",
         "decode": "decoding the capture with tshark + kbtp.lua and with kbtp decode",
         "replay": "kbtp replay of the captured session against a fresh target",
         "fuzz": "kbtp fuzz against a fresh target", "conform": "kbtp conform against a fresh target"}


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _kbtp(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*KBTP, *args], capture_output=True, text=True, timeout=timeout)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


async def _workload(url: str, local: str | None, pcap: Path) -> int:
    """A short session of every operation; returns the number of requests."""
    from ..initiator import Initiator, KbtpError
    from ..rnic.pcap import PcapSink
    sink = PcapSink(pcap)
    try:
        options: dict[str, Any] = {"local": local} if local else {}
        ini = await Initiator.connect(url, frame_listeners=[sink], **options)
        h, size = ini.target.handle_base, ini.target.block_size
        blocks = {h + i: os.urandom(size if i % 2 else 64) for i in range(8)}
        for handle, data in blocks.items():
            await ini.alloc_store(handle, data, seal=True, inline=len(data) <= 64)
        loaded = await asyncio.gather(*(ini.load(k) for k in blocks))
        assert [r.data for r in loaded] == list(blocks.values())
        await ini.alloc_store(h + 8, b"draft")
        await ini.store(h + 8, b"final", seal=True)
        await ini.load(h + 8, record=True)
        await ini.direct_load(h)
        await ini.direct_alloc(h + 9, b"one-sided")
        try:
            await ini.load(h + 10)                   # an error on purpose: NOT_VALID
        except KbtpError:
            pass
        for handle in (h, h + 1):
            await ini.free(handle)
        await ini.goodbye(release=True)
        return len(blocks) * 2 + 8
    finally:
        sink.close()


def _tshark_messages(pcap: Path) -> collections.Counter | None:
    tshark = shutil.which("tshark")
    if tshark is None:
        return None
    from .dissector import _lua_path
    proc = subprocess.run([tshark, "-n", "-r", str(pcap), "-X", f"lua_script:{_lua_path()}",
                           "-o", "tcp.try_heuristic_first:TRUE", "-Y", "kbtp.opcode",
                           "-T", "fields", "-E", "occurrence=l", "-e", "kbtp.opcode"],
                          capture_output=True, text=True, timeout=120)
    return collections.Counter(T.OPCODES.describe(int(v, 0))
                               for v in proc.stdout.split() if v)


class _Target:
    """``kbtp target`` in a subprocess for one step: started fresh, stopped with Ctrl-C."""

    def __init__(self, transport: str, pcap: Path | None = None) -> None:
        host = HOSTS[transport][0]
        port = _free_port(host) if transport == "iwarp" else ROCE_PORT
        self.url = f"{transport}://{host}:{port}"
        args = ["--pcap", str(pcap)] if pcap else []
        self.proc = subprocess.Popen([*KBTP, "target", "--transport", transport, "--listen",
                                      f"{host}:{port}", "--blocks", "512", "--ticket-timeout", "500",
                                      "--duration", "600", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None      # stdout=PIPE
        self.banner = self.proc.stdout.readline().strip()

    @property
    def up(self) -> bool:
        return "listening" in self.banner

    def stop(self) -> str:
        """Stop it; returns what went wrong if it did not start."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return _last_line(err)


def _with_target(b: Binding, name: str, run, pcap: Path | None = None) -> None:
    """Run one step against a fresh target, so no step sees what another left behind."""
    b.running(name, "starting a fresh reference target")
    t = _Target(b.transport, pcap)
    b.running(name, STEPS[name])
    try:
        if not t.up:
            b.add(name, False, f"the target did not start: {t.stop() or t.banner}")
            return
        run(t.url)
    finally:
        t.stop()


def _took(seconds: float) -> str:
    """``38 ms`` or ``1.4 s``: never "in 0.0 s"."""
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def _run_binding(transport: str, outdir: Path, fuzz_cases: int) -> Binding:
    b = Binding(transport)
    local = HOSTS[transport][1]
    local_args = ["--local", local] if transport == "roce" else []
    session = outdir / f"{transport}_session.pcap"

    def workload(url: str) -> None:
        started = time.monotonic()
        try:
            n = asyncio.run(asyncio.wait_for(
                _workload(url, local if transport == "roce" else None, session), 60))
        except Exception as exc:              # shown, not raised: the summary says what failed
            b.add("workload", False, f"{type(exc).__name__}: {exc}")
            return
        b.add("workload", True, f"{n} requests against {url} in "
                                f"{_took(time.monotonic() - started)}, captured in {session.name}")

    def replay(url: str) -> None:
        r = _kbtp("replay", str(session), "--target", url, *local_args)
        b.add("replay", r.returncode == 0, _last_line(r.stdout) or _last_line(r.stderr))

    def fuzz(url: str) -> None:
        f = _kbtp("fuzz", "--target", url, "--cases", str(fuzz_cases), "--seed", "1",
                  "--out", str(outdir / f"{transport}_fuzz"), *local_args)
        first = f.stdout.strip().splitlines()[0] if f.stdout.strip() else _last_line(f.stderr)
        b.add("fuzz", f.returncode == 0, f"{first.split(': ', 1)[-1]}, "
                                         f"{_last_line(f.stdout).strip('()') or 'see the output'}")

    def conform(url: str) -> None:
        c = _kbtp("conform", "--target", url, "-q", "--quick",      # the tour skips the slow case
                  "--junit", str(outdir / f"{transport}_conform.xml"),
                  "--pcap-dir", str(outdir / f"{transport}_conform_failed"), *local_args)
        b.add("conform", c.returncode == 0, _last_line(c.stdout) or _last_line(c.stderr))

    _with_target(b, "workload", workload, outdir / f"{transport}_target.pcap")
    if not session.exists():
        return b
    b.running("decode", STEPS["decode"])
    ours = collections.Counter(T.OPCODES.describe(f.fields.get("opcode", -1))
                               for f in kbtp_messages(rdma_messages(read_packets(session))))
    theirs = _tshark_messages(session)
    if theirs is None:
        b.add("decode", True, f"{sum(ours.values())} KBTP messages (tshark not installed)")
    else:
        b.add("decode", theirs == ours,
              f"tshark + kbtp.lua and kbtp decode agree on {sum(theirs.values())} messages: "
              + ", ".join(f"{n} {op}" for op, n in sorted(theirs.items())))
    for name, step in (("replay", replay), ("fuzz", fuzz), ("conform", conform)):
        _with_target(b, name, step)
    return b


def _crafted(outdir: Path) -> Step:
    """Crafted captures of every message and status code, decoded back."""
    problems, total = 0, 0
    for path in write_samples(outdir):
        found = list(kbtp_messages(rdma_messages(read_packets(path))))
        total += len(found)
        ops = {f.fields.get("opcode") for f in found}
        statuses = {f.fields["status"] for f in found
                    if f.fields.get("opcode") == T.BY_NAME["COMPLETION"].opcode}
        problems += (set(T.OPCODES.by_value()) - ops != set()) + (set(T.STATUS.by_value()) - statuses != set())
    return Step("crafted", not problems, f"{total} KBTP messages of every opcode and status "
                                         f"in 4 captures (iWARP, RoCEv2; IPv4, IPv6 ADDR_LE)")


@click.command()
@click.option("--out", type=Output(folder=True), default=None,
              help="Folder for the captures and reports (default: a new temporary folder).")
@click.option("--fuzz-cases", type=click.IntRange(0), default=200, show_default=True,
              help="Fuzz cases per binding.")
@click.option("--transport", "transports", multiple=True, type=click.Choice(["iwarp", "roce"]),
              help="Only this binding (repeatable; default both).")
def demo(out: str | None, fuzz_cases: int, transports: tuple[str, ...]) -> None:
    """Run the reference target on each binding, talk to it with the reference initiator
    while capturing, decode the capture with tshark and the KBTP dissector, replay it,
    fuzz the target briefly and run the conformance suite; then print one summary.

    Everything stays on loopback (127.0.0.1; RoCEv2 on 127.74.0.1 and 127.74.0.2). The
    captures open in Wireshark. Each step's result is printed once, when it is known; on a
    terminal a progress line on stderr shows the step under way.

    \b
    Examples:
      kbtp demo                                # both bindings, 200 fuzz cases each
      kbtp demo --transport roce --fuzz-cases 50 --out demo/
    """
    outdir = Path(out or tempfile.mkdtemp(prefix="kbtp-demo-"))
    outdir.mkdir(parents=True, exist_ok=True)
    click.echo(f"KBTP demo: captures and reports go to {outdir}")
    PROGRESS.show(f"  {'both':<6} {'crafted':<9} captures of every message and status code ...")
    crafted = _crafted(outdir / "crafted")
    result("both", crafted.name, crafted.ok, crafted.detail)
    results = [_run_binding(transport, outdir, fuzz_cases)
               for transport in transports or ("iwarp", "roce")]
    PROGRESS.clear()
    failed = [f"{b.transport} {s.name}" for b in results for s in b.steps if not s.ok]
    failed += [] if crafted.ok else ["crafted captures"]
    click.echo("\nOpen in Wireshark (tshark -X lua_script:$(kbtp dissector path) -r FILE):")
    for b in results:
        click.echo(f"  {outdir / f'{b.transport}_session.pcap'}   (initiator side; target side: "
                   f"{b.transport}_target.pcap)")
    click.echo(f"  {outdir / 'crafted'}/*.pcap   (every message and status code)")
    reports = [outdir / f"{b.transport}_conform.xml" for b in results]
    if any(r.exists() for r in reports):
        click.echo("\nJUnit reports of the conformance runs (for CI):")
        for junit in (r for r in reports if r.exists()):
            click.echo(f"  {junit}")
    if failed:
        raise click.ClickException(f"demo steps failed: {', '.join(failed)}")
