"""The raw-socket RoCEv2 backend (``io="raw"``) between two network namespaces.

Namespace A holds a veth with no address: the target owns its IP and MAC through the raw
backend and answers ARP / neighbour solicitations itself. Namespace B's initiator talks
to it once through the kernel's UDP stack (an address configured on B's veth) and once
through the raw backend. The tests of tests/test_target_ops.py run unchanged over it.
"""
from __future__ import annotations

import asyncio
import socket
import struct
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from kbtp_scapy.initiator import Initiator
from kbtp_scapy.rnic import roce
from kbtp_scapy.rnic.pcap import PcapSink
from kbtp_scapy.rnic.roce_raw import bpf_program, parse_addr
from kbtp_scapy.target import Target, TargetConfig
from kbtp_scapy.target.audit import audit
from kbtp_scapy.wire import roce as w

from . import (
    test_target_faults as faults,
    test_target_ops as ops,
    test_target_sessions as sessions,
    test_target_storm as storm_test,
)
from .kbtp_harness import TargetThread
from .netns import Link, enter, move
from .relay import Relay
from .test_target_capture import decoded, dissected, session
from .tshark import TSHARK, needs_tshark

#: The namespaces' own networks, trusted with the direct modes (kbtp target --trust).
TRUST = ("10.99.0.0/24", "fd99::/64")
V4 = {"target": "10.99.0.1", "kernel": ["10.99.0.2/24", "10.99.0.3/24", "10.99.0.4/24",
                                        "10.99.0.5/24", "10.99.0.6/24"],   # .5 relay, .6 its back
      "raw": ["10.99.0.10", "10.99.0.11", "10.99.0.12"], "other": "10.99.0.99"}
V6 = {"target": "fd99::1", "kernel": ["fd99::2/64", "fd99::3/64", "fd99::4/64"],
      "raw": ["fd99::10", "fd99::11", "fd99::12"], "other": "fd99::99"}


class RawTarget(TargetThread):
    """The harness's target, its thread in namespace A on the raw backend; the test's
    thread is in namespace B while it runs."""

    def __init__(self, link: Link, family: dict, initiator_io: str,
                 config: TargetConfig | None = None, frame_listeners: list | None = None) -> None:
        self.link, self.family, self.initiator_io = link, family, initiator_io
        link.address_b(*family["kernel"])
        host = family["target"]
        super().__init__("roce", config, hosts=[f"[{host}]" if ":" in host else host], port=4791,
                         frame_listeners=frame_listeners, io="raw", iface=link.ifa,
                         addr=family["target"])

    async def _make(self, config: TargetConfig) -> Target:
        move(self.link.a)               # the loop's thread, for good
        return Target(config, self.transport)

    def connect_options(self, index: int = 0) -> dict:
        if self.initiator_io == "udp":
            return {"local": self.family["kernel"][index].split("/")[0]}
        return {"io": "raw", "iface": self.link.ifb, "addr": self.family["raw"][index]}

    def device(self) -> roce.Device:
        return roce._devices[(self.loop, self.family["target"], 4791)]


@pytest.fixture
def link():
    link = Link()
    try:
        with enter(link.b):
            yield link
    finally:
        link.close()


@pytest.fixture(params=[("v4", "udp"), ("v4", "raw"), ("v6", "udp"), ("v6", "raw")],
                ids="-".join)
def target(request, link):
    family, io = request.param
    config = TargetConfig(blocks=64, block_size=4096, max_initiators=4, ticket_timeout_ms=300,
                          trust=TRUST)
    t = RawTarget(link, V4 if family == "v4" else V6, io, config)
    yield t
    t.stop()


@pytest.fixture(params=[("v4", "udp"), ("v6", "raw")], ids="-".join)
def make(request, link):
    """tests/test_target_sessions.py's targets, on the raw backend in namespace A."""
    family, io = request.param

    def start(**config) -> RawTarget:
        return RawTarget(link, V4 if family == "v4" else V6, io,
                         TargetConfig(**{**sessions.BASE, "trust": TRUST, **config}))
    return start


# The session tests, unchanged, over the raw backend (they take the ``make`` above).
test_deferred_free_example = sessions.test_deferred_free_example
test_reconnect_finds_bindings_and_active_id_is_refused = \
    sessions.test_reconnect_finds_bindings_and_active_id_is_refused
test_direct_load_and_direct_alloc = sessions.test_direct_load_and_direct_alloc
test_completion_records_only_on_roce = sessions.test_completion_records_only_on_roce
test_addr_le_session_keeps_memory_little_endian = sessions.test_addr_le_session_keeps_memory_little_endian
test_isolation = sessions.test_isolation
test_bad_input_gets_malformed_and_others_are_served = \
    sessions.test_bad_input_gets_malformed_and_others_are_served


@pytest.mark.slow
def test_lossy_path_every_operation_completes(link):
    """The lossy relay of tests/relay.py in namespace B, between the initiator and the raw
    target: 5% of the datagrams lost, 10% reordered, and every operation completes."""
    t = RawTarget(link, V4, "udp", replace(faults.LOSSY_CONFIG, trust=TRUST))
    relay_host = V4["kernel"][3].split("/")[0]

    async def main():
        relay = Relay((relay_host, 4791), (V4["target"], 4791), loss=0.05, reorder=0.1,
                      seed=11).start()
        try:
            # the relay hides the veth from the initiator's route: give it the veth's MTU
            await faults.mixed_workload(f"roce://{relay_host}", mtu=1024, **t.connect_options(0))
            assert relay.stats["lost"] > 20 and relay.stats["delayed"] > 20, relay.stats
        finally:
            relay.close()
    try:
        asyncio.run(asyncio.wait_for(main(), 150))
        assert t.run(lambda: audit(t.target)) == []
    finally:
        t.stop()


@pytest.mark.slow
def test_allocation_storm_over_the_raw_backend(link):
    """Four initiator processes in namespace B (kernel UDP) against the raw target in A."""
    t = RawTarget(link, V4, "udp", storm_test.CONFIG)
    try:
        storm_test.storm(t, [a.split("/")[0] for a in V4["kernel"][:storm_test.WORKERS]])
    finally:
        t.stop()


@pytest.mark.slow
def test_every_operation_and_status(target):
    ops.test_every_operation_and_status(target)
    assert target.run(lambda: target.device().stats.get("tx_unresolved", 0)) == 0


def test_invalidate_and_clearing(target):
    ops.test_invalidate_and_clearing(target)


def test_bpf_program_shape():
    """Small enough for the kernel (4096 instructions), jumps resolved."""
    for ip in ("10.1.2.3", "fd00::1"):
        program = bpf_program(socket.inet_pton(socket.AF_INET6 if ":" in ip else socket.AF_INET,
                                               ip), 4791)
        assert len(program) % 8 == 0 and len(program) // 8 < 64
        assert struct.unpack_from("HBBI", program, len(program) - 8) == (6, 0, 0, 0)


def test_addresses_parse_and_derive_a_local_mac():
    assert parse_addr("10.0.0.1") == ("10.0.0.1", bytes.fromhex("02000a000001"))
    assert parse_addr("fd00::1/02:11:22:33:44:55")[1] == bytes.fromhex("021122334455")
    for bad in ("127.0.0.1", "10.0.0.1/01:00:00:00:00:01", "nonsense", "10.0.0.1/zz"):
        with pytest.raises(ValueError):
            parse_addr(bad)


def _frames(pcap: Path) -> list[bytes]:
    """RoCEv2 frames (UDP 4791) of a pcap, as bytes."""
    from scapy.utils import rdpcap
    out = []
    for pkt in rdpcap(str(pcap)):
        raw = bytes(pkt)
        if raw[12:14] == b"\x08\x00" and raw[23] == 17 and raw[36:38] == b"\x12\xb7":
            out.append(raw)
    return out


class VethCapture:
    """tshark on B's veth, started once it has seen a frame (an ARP probe of ours)."""

    def __init__(self, link: Link, path: Path) -> None:
        self.proc = subprocess.Popen(["ip", "netns", "exec", link.b, TSHARK, "-i", link.ifb,
                                      "-w", str(path)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.path = path
        deadline = time.monotonic() + 15
        line = ""
        while "Capturing on" not in line:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.skip(f"tshark cannot capture on the veth: {line}")
            line += self.proc.stderr.readline()
        with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as s:
            s.bind((link.ifb, 0))
            while not path.exists() or path.stat().st_size < 100:
                if time.monotonic() > deadline:
                    self.stop()
                    pytest.skip("tshark captured nothing on the veth")
                s.send(b"\xff" * 6 + b"\x02\0\0\0\0\x09" + b"\x88\xb5" + bytes(46))
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            time.sleep(0.3)
            self.proc.terminate()
            self.proc.wait(10)


@pytest.mark.slow
@needs_tshark
def test_cli_target_pcap_equals_the_wire_and_dissects(link, tmp_path):
    """`kbtp target --io raw` in A; a raw initiator in B with ECN bits and UDP checksums;
    the target's --pcap, the initiator's and tshark's capture on the veth agree."""
    link.address_b(V4["kernel"][0])
    capture = VethCapture(link, tmp_path / "live.pcap")
    proc = subprocess.Popen(
        ["ip", "netns", "exec", link.a, sys.executable, "-m", "kbtp_scapy", "target",
         "--transport", "roce", "--io", "raw", "--iface", link.ifa, "--addr", V4["target"],
         "--blocks", "64", "--max-initiators", "4", "--duration", "12", "--trust", TRUST[0],
         "--pcap", str(tmp_path / "target.pcap")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        head = proc.stdout.readline()
        while "listening on" not in head:
            assert proc.poll() is None, head + proc.stdout.read()
            head += proc.stdout.readline()
        ini_sink = PcapSink(tmp_path / "initiator.pcap")

        class T:
            url, transport = f"roce://{V4['target']}", "roce"

            @staticmethod
            def connect_options(index: int) -> dict:
                return {"io": "raw", "iface": link.ifb, "addr": V4["raw"][0],
                        "traffic_class": 0x02, "udp_checksum": True}
        asyncio.run(asyncio.wait_for(session(T, ini_sink), 60))
        ini_sink.close()
        proc.send_signal(2)
        out = head + proc.communicate(timeout=20)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
        capture.stop()
    assert "02:00:0a:63:00:01" in out and "GID ::ffff:10.99.0.1" in out
    ours = decoded(tmp_path / "target.pcap")
    assert decoded(tmp_path / "initiator.pcap") == ours == decoded(tmp_path / "live.pcap")
    assert dissected(tmp_path / "live.pcap") == ours
    wire, target_frames = _frames(tmp_path / "live.pcap"), _frames(tmp_path / "target.pcap")
    assert sorted(wire) == sorted(target_frames) == sorted(_frames(tmp_path / "initiator.pcap"))
    sent = [f for f in wire if f[26:30] == socket.inet_aton(V4["raw"][0])]
    assert sent and all(f[15] == 0x02 and f[40:42] != b"\0\0" for f in sent)   # ECT(0), checksum


def test_bad_icrc_dropped_and_counted_foreign_frames_ignored(link):
    t = RawTarget(link, V4, "raw", TargetConfig(blocks=16, max_initiators=2))
    try:
        frames: list[bytes] = []

        async def main():
            ini = await Initiator.connect(t.url, frame_listeners=[lambda d, f, ns: frames.append(f)
                                                                  if d == "tx" else None],
                                          **t.connect_options(0))
            h = ini.target.handle_base
            await ini.alloc_store(h, b"before", seal=True)
            return ini, h
        loop = asyncio.new_event_loop()
        ini, h = loop.run_until_complete(main())
        good = next(f for f in frames if f[42] == w.SEND_ONLY)
        with socket.socket(socket.AF_PACKET, socket.SOCK_RAW) as s:
            s.bind((link.ifb, 3))                                          # ETH_P_ALL
            s.send(good[:-5] + bytes([good[-5] ^ 1]) + good[-4:])          # bad ICRC
            s.send(good)                                                   # a duplicate
            time.sleep(0.3)
            qps = t.run(lambda: [dict(qp.stats) for qp in t.device().qps.values()])
            assert [q["icrc_errors"] for q in qps] == [1]
            assert qps[0]["duplicates"] >= 1
            before = t.run(lambda: t.device().stats["frames_in"])
            other = socket.inet_aton(V4["other"])
            s.send(good[:30] + other + good[34:])                          # another IP
            s.send(good[:36] + b"\x00\x09" + good[38:])                    # another port
            arp = bytes.fromhex("0001080006040001") + b"\x02\0\0\0\0\x42" + socket.inet_aton(
                "10.99.0.66") + bytes(6)
            s.send(b"\xff" * 6 + b"\x02\0\0\0\0\x42\x08\x06" + arp + other)  # ARP for another
            s.send(b"\xff" * 6 + b"\x02\0\0\0\0\x42\x08\x06" + arp + socket.inet_aton(V4["target"]))
            s.settimeout(2)
            while True:                                  # the target answers for its own
                reply = s.recv(100)
                if reply[12:14] == b"\x08\x06" and reply[20:22] == b"\0\x02":
                    break
            assert reply[22:28] == parse_addr(V4["target"])[1]
            assert t.run(lambda: t.device().stats["frames_in"]) == before + 1
        assert loop.run_until_complete(ini.load(h)).data == b"before"
        loop.run_until_complete(ini.goodbye())
        loop.close()
    finally:
        t.stop()


def test_busy_addresses_and_missing_interface_are_one_line_errors(link):
    t = RawTarget(link, V4, "raw", TargetConfig(blocks=16, max_initiators=2))
    try:
        async def claim(addr: str) -> str:
            with pytest.raises(OSError) as err:
                await roce.listen(addr, 4791, None, None, io="raw", iface=link.ifb, addr=addr)
            return str(err.value)
        assert "answers ARP" in asyncio.run(claim(V4["target"]))            # A owns it
        assert "configured on this host" in asyncio.run(claim("10.99.0.2"))  # B's kernel does
    finally:
        t.stop()
    cli = [sys.executable, "-m", "kbtp_scapy", "target", "--io", "raw", "--duration", "1"]
    for args, reason in ((["--iface", "nosuchif0", "--addr", "10.99.0.5"], "no such interface"),
                         (["--iface", link.ifa, "--addr", "10.99.0.2"], "is in use")):
        run = subprocess.run(["ip", "netns", "exec", link.a, *cli, *args],
                             capture_output=True, check=False, text=True, timeout=30)
        errors = [line for line in run.stderr.splitlines() if line.startswith("kbtp:")]
        assert run.returncode == 1 and len(errors) == 1 and reason in errors[0], run.stderr
