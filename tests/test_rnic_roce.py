"""The RoCEv2 binding of the soft RNIC over real UDP sockets on loopback.

Each test uses its own loopback addresses (127.3.N.x) so tests never share a device.
Scapy (``kbtp_scapy.layers.roce``, ``iter_rdma_messages``) and tshark are the oracles
for what goes on the wire; the binding itself builds no Scapy objects.
"""
from __future__ import annotations

import asyncio
import os
import random
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from scapy.utils import rdpcap

from kbtp_scapy import rnic
from kbtp_scapy.builders.roce import iter_rdma_messages
from kbtp_scapy.layers.roce import icrc_ok
from kbtp_scapy.rnic import Access, ConnectionLost, MemoryTable, RemoteError
from kbtp_scapy.rnic.pcap import PcapSink
from kbtp_scapy.wire import roce as w

from .kbtp_harness import deaf_roce
from .relay import Relay
from .tshark import TSHARK, needs_tshark, tshark_frames, tshark_text

ALL = Access.REMOTE_READ | Access.REMOTE_WRITE | Access.REMOTE_ATOMIC
# rpcordma's heuristic claims short Sends and calls them malformed (docs/WIRESHARK.md)
TSHARK_OPTS = ("--disable-protocol", "rpcordma")


def run(coro, timeout: float = 20.0):
    """Run one test body in a fresh event loop, bounded in time."""
    async def bounded():
        async with asyncio.timeout(timeout):
            return await coro
    return asyncio.run(bounded())


class Pair:
    """A target (listener) and an initiator QP connected over loopback."""

    async def open(self, net: int, *, via: Relay | None = None, target_opts: dict | None = None,
                   recv: int = 64, **initiator_opts) -> Pair:
        self.target_ip, self.initiator_ip = f"127.3.{net}.1", f"127.3.{net}.2"
        self.tmem, self.imem = MemoryTable(), MemoryTable()
        self.tbuf = bytearray(1 << 20)
        self.region = self.tmem.register(self.tbuf, ALL)
        self.accepted: asyncio.Queue = asyncio.Queue()

        async def on_connect(qp):
            qp.post_recv(recv)
            await self.accepted.put(qp)

        opts = dict(recv_size=1 << 18, **(target_opts or {}))
        self.listener = await rnic.listen(f"roce://{self.target_ip}", self.tmem, on_connect,
                                          **opts)
        host = via.address[0] if via is not None else self.target_ip
        self.iqp = await rnic.connect(f"roce://{host}", self.imem, local=self.initiator_ip,
                                      **initiator_opts)
        self.tqp = await asyncio.wait_for(self.accepted.get(), 5)
        return self

    async def close(self) -> None:
        await self.iqp.close()
        self.listener.close()
        await asyncio.wait_for(self.tqp.wait_closed(), 5)


def u64(buf: bytearray, offset: int) -> int:
    return int.from_bytes(buf[offset:offset + 8], "little")


# --- verbs ---------------------------------------------------------------------------------

def test_all_operations_complete_in_order_with_the_right_data():
    async def body():
        p = await Pair().open(1)
        inv = p.tmem.register(bytearray(64), Access.REMOTE_READ)
        big = os.urandom(100 * 1024)
        pattern = bytes(range(256)) * 256
        p.tbuf[8:16] = (41).to_bytes(8, "little")
        order: list[int] = []
        futures = [
            p.iqp.send(b"hi"),
            p.iqp.send(big, solicited=True),
            p.iqp.send(b"inv", invalidate=inv.stag),
            p.iqp.send(b"imm", imm=0xABCD0123),
            p.iqp.write(p.region.stag, 0x10000, pattern),
            p.iqp.write(p.region.stag, 0x30000, b"tail", imm=7),
            p.iqp.read(p.region.stag, 0x10000, 64 * 1024),
            p.iqp.fetch_add(p.region.stag, 8, 1),
            p.iqp.compare_swap(p.region.stag, 8, 42, 1000),
            p.iqp.compare_swap(p.region.stag, 8, 42, 5),
        ]
        for i, f in enumerate(futures):
            f.add_done_callback(lambda _f, i=i: order.append(i))
        results = await asyncio.gather(*futures)
        assert order == list(range(len(futures)))
        assert results[6] == pattern and results[7:] == [41, 42, 1000]
        assert u64(p.tbuf, 8) == 1000 and p.tbuf[0x30000:0x30004] == b"tail"
        got = [await asyncio.wait_for(p.tqp.recv(), 2) for _ in range(5)]
        assert [g.payload for g in got[:4]] == [b"hi", big, b"inv", b"imm"]
        assert got[1].solicited and got[2].invalidated == inv.stag and not inv.valid
        assert got[3].imm == 0xABCD0123
        assert got[4].write_imm and got[4].imm == 7
        # multi-packet messages went out at the path MTU (4096 on lo): 25 Send packets, 16 Writes
        assert p.iqp.mtu == 4096
        assert p.iqp.stats["frames_tx"] >= 25 + 16 + 8
        await p.close()
    run(body())


@pytest.mark.parametrize("mtu", [256, 4096])
def test_path_mtu_of_the_req_rules_both_ends(mtu):
    async def body():
        p = await Pair().open(2 if mtu == 256 else 3, mtu=mtu, target_opts={"mtu": 1024})
        assert p.iqp.mtu == p.tqp.mtu == mtu
        data = os.urandom(10_000)
        await p.iqp.write(p.region.stag, 0, data)
        assert await p.iqp.read(p.region.stag, 0, 10_000) == data
        assert p.iqp.stats["frames_rx"] >= -(-10_000 // p.iqp.mtu)
        await p.close()
    run(body())


def test_ipv6_loopback_with_distinct_ports():
    """One address for both ends: the devices need UDP ports of their own, and each must be
    told the other's (on a network both are 4791); the rdma_cm port is apart from both."""
    async def body():
        mem = MemoryTable()
        buf = bytearray(4096)
        region = mem.register(buf, ALL)
        accepted = asyncio.get_running_loop().create_future()

        async def on_connect(qp):
            qp.post_recv(1)
            accepted.set_result(qp)
        listener = await rnic.listen("roce://[::1]:7174", mem, on_connect, udp_port=4795,
                                     peer_udp_port=4796)
        qp = await rnic.connect("roce://[::1]:7174", MemoryTable(), udp_port=4796,
                                peer_udp_port=4795)
        assert qp.local == ("::1", 4796) and qp.remote == ("::1", 4795)
        tqp = await asyncio.wait_for(accepted, 5)
        await qp.send(b"v6")
        await qp.write(region.stag, 0, b"x" * 3000)
        assert (await tqp.recv()).payload == b"v6" and buf[:3000] == b"x" * 3000
        await qp.close()
        listener.close()
    run(body())


# --- refusals ------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["unknown_stag", "bounds", "no_right", "atomic_no_right",
                                  "misaligned"])
def test_refused_access_is_a_nak_and_nothing_happens(case):
    async def body():
        p = await Pair().open(10 + ["unknown_stag", "bounds", "no_right", "atomic_no_right",
                                    "misaligned"].index(case))
        ro = p.tmem.register(bytearray(b"\x07" * 64), Access.REMOTE_READ)
        before = bytes(p.tbuf)
        if case == "unknown_stag":
            future = p.iqp.write(p.region.stag ^ 0x5A5A5A5A, 0, b"x" * 100)
        elif case == "bounds":
            future = p.iqp.read(p.region.stag, len(p.tbuf) - 10, 20)
        elif case == "no_right":
            future = p.iqp.write(ro.stag, 0, b"x" * 8)
        elif case == "atomic_no_right":
            future = p.iqp.fetch_add(ro.stag, 0, 1)
        else:
            future = p.iqp.fetch_add(p.region.stag, 4, 1)
        later = p.iqp.send(b"after")
        with pytest.raises(RemoteError, match="invalid request" if case == "misaligned"
                           else "remote access error"):
            await future
        with pytest.raises(ConnectionLost):       # the QP is in the error state (IB 10.3.1)
            await later
        assert bytes(p.tbuf) == before and bytes(ro.view) == b"\x07" * 64
        assert p.tqp.stats["naks_sent"] == 1
        await asyncio.wait_for(p.tqp.wait_closed(), 5)   # the responder too, then DREQ
        assert "responder error" in str(p.tqp.error)
        p.listener.close()
    run(body())


def test_send_without_receive_gets_rnr_nak_then_goes_through():
    async def body():
        p = await Pair().open(20, recv=0)
        future = p.iqp.send(b"x" * 5000)
        deadline = time.monotonic() + 5
        while p.tqp.stats.get("rnr_naks_sent", 0) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert p.tqp.stats["rnr_naks_sent"] >= 3 and not future.done()
        assert p.tqp.stats.get("recv", 0) == 0
        p.tqp.post_recv(1)
        await asyncio.wait_for(future, 2)
        assert (await p.tqp.recv()).payload == b"x" * 5000
        assert p.iqp.stats["rnr_naks"] >= 3
        await p.close()
    run(body())


def test_rnr_retry_count_exhausted_fails_the_send():
    async def body():
        p = await Pair().open(21, recv=0, rnr_retry=2)
        with pytest.raises(RemoteError, match="RNR retry"):
            await p.iqp.send(b"nobody posted a receive")
        assert p.tqp.stats["rnr_naks_sent"] == 3
        p.listener.close()
    run(body())


def test_connect_to_a_port_without_listener_is_rejected():
    async def body():
        p = await Pair().open(22)     # the initiator's device now owns 127.3.22.2:4791
        with pytest.raises(ConnectionRefusedError):
            await rnic.connect("roce://127.3.22.2", MemoryTable(), local="127.3.22.3")
        await p.close()
    run(body())


def test_connect_to_a_deaf_host_times_out():
    async def body():
        with pytest.raises(TimeoutError):
            await rnic.connect(url, MemoryTable(), local="127.3.23.2", connect_timeout=0.5)
    with deaf_roce("127.3.23.1") as url:
        run(body())


def test_connect_to_nothing_is_refused_at_once():
    """Nothing owns UDP 4791 at the host: the ICMP port unreachable the REQ draws ends the
    connect long before its 300 s (the test's own bound is 60 s). IPv4 only: see
    ``UdpIO.report_refusals``."""
    async def body():
        with pytest.raises(ConnectionRefusedError, match="ICMP port unreachable"):
            await rnic.connect("roce://127.3.23.3", MemoryTable(), local="127.3.23.4",
                               connect_timeout=300)
    run(body(), timeout=60)


# --- loss, reordering, duplicates ------------------------------------------------------------

def test_a_connect_under_way_keeps_the_device_its_last_connection_leaves():
    """The initiator's device loses its last QP (the peer's DREQ) while a second connect
    on it waits: the connect still gets its REP (once, the device closed under it)."""
    async def body():
        p = await Pair().open(24)
        second = asyncio.ensure_future(rnic.connect(
            f"roce://{p.target_ip}", p.imem, local=p.initiator_ip, connect_timeout=3))
        await asyncio.sleep(0)          # the second connect holds the device and waits
        p.iqp.peer_closed()             # as on the target's DREQ: the first QP lets go
        qp = await second
        assert qp.established
        tqp = await asyncio.wait_for(p.accepted.get(), 5)
        p.tbuf[:8] = b"answered"
        assert await qp.read(p.region.stag, 0, 8) == b"answered"
        await qp.close()
        p.listener.close()
        await asyncio.wait_for(tqp.wait_closed(), 5)
    run(body())


def test_dreqs_that_cross_end_both_sides_at_once():
    """Both ends close at the same moment (a refused HELLO does this): each takes the
    other's DREQ as the end of its own wait for DREP and sends its DREQ once, not again
    on every CM timeout because the peer had forgotten the connection."""
    from scapy.layers.l2 import Ether

    from kbtp_scapy.layers.roce import bth_parts
    from kbtp_scapy.rnic.cm import CmAttr, decode

    async def body():
        p = await Pair().open(25)
        sent = {"initiator": [], "target": []}
        for side, qp in (("initiator", p.iqp), ("target", p.tqp)):
            def listener(direction, frame, ns, side=side):
                msg = decode(bth_parts(Ether(frame))[1])
                if direction == "tx" and msg is not None:
                    sent[side].append(msg.attr)
            qp.frame_listeners.append(listener)
        await asyncio.gather(p.iqp.close(), p.tqp.close())
        p.listener.close()
        assert sent["initiator"].count(CmAttr.DREQ) == 1, sent
        assert sent["target"].count(CmAttr.DREQ) == 1, sent
    run(body())


def test_mixed_operations_through_a_lossy_reordering_relay():
    """Writes go to one area and Reads read another: a Read retried after a loss is
    executed again (IB 9.7.5.2.2), so without a fence it may see Writes posted after it."""
    async def body():
        relay = Relay(("127.3.30.9", 4791), ("127.3.30.1", 4791), loss=0.05, reorder=0.05,
                      seed=7).start()
        p = await Pair().open(30, via=relay, recv=400)
        rng = random.Random(1)
        write_area, read_area, counter_at = 0, 1 << 19, 0xF0000
        p.tbuf[read_area:read_area + (1 << 18)] = rng.randbytes(1 << 18)
        shadow = bytearray(1 << 18)
        counter = 0
        sent: list[bytes] = []
        checks = []
        for i in range(320):
            kind = i % 5
            if kind == 0:
                payload = rng.randbytes(rng.choice((10, 1500, 5000)))
                sent.append(payload)
                checks.append((p.iqp.send(payload), None))
            elif kind == 1:
                offset, data = rng.randrange(0, 1 << 17), rng.randbytes(rng.choice((8, 3000)))
                shadow[offset:offset + len(data)] = data
                checks.append((p.iqp.write(p.region.stag, write_area + offset, data), None))
            elif kind == 2:
                offset = read_area + rng.randrange(0, 1 << 17)
                length = rng.choice((1, 2048, 9000))
                checks.append((p.iqp.read(p.region.stag, offset, length),
                               bytes(p.tbuf[offset:offset + length])))
            elif kind == 3:
                checks.append((p.iqp.fetch_add(p.region.stag, counter_at, 3), counter))
                counter += 3
            else:
                checks.append((p.iqp.compare_swap(p.region.stag, counter_at, counter,
                                                  counter + 1), counter))
                counter += 1
        for future, expected in checks:
            result = await future
            assert expected is None or result == expected
        got = [(await asyncio.wait_for(p.tqp.recv(), 5)).payload for _ in sent]
        assert got == sent
        assert p.tbuf[write_area:write_area + len(shadow)] == shadow
        assert await p.iqp.read(p.region.stag, write_area, len(shadow)) == shadow
        assert u64(p.tbuf, counter_at) == counter
        assert relay.stats["lost"] > 20 and relay.stats["delayed"] > 20
        assert p.iqp.stats["retransmits"] > 0
        await p.close()
        relay.close()
    run(body(), 60)


def test_fetch_add_whose_ack_is_lost_is_not_executed_twice():
    async def body():
        dropped = []

        def drop(direction: str, datagram: bytes) -> bool:
            if direction == "down" and datagram[0] == w.ATOMIC_ACKNOWLEDGE and not dropped:
                dropped.append(datagram)
                return True
            return False
        relay = Relay(("127.3.31.9", 4791), ("127.3.31.1", 4791), drop=drop).start()
        p = await Pair().open(31, via=relay)
        p.tbuf[64:72] = (100).to_bytes(8, "little")
        assert await p.iqp.fetch_add(p.region.stag, 64, 5) == 100
        assert dropped and u64(p.tbuf, 64) == 105
        assert p.iqp.stats["retransmits"] >= 1 and p.tqp.stats["duplicates"] >= 1
        assert await p.iqp.fetch_add(p.region.stag, 64, 5) == 105
        assert u64(p.tbuf, 64) == 110
        await p.close()
        relay.close()
    run(body())


def test_bad_icrc_is_dropped_counted_and_recovered():
    async def body():
        hit = []

        def corrupt(direction: str, datagram: bytes) -> bytes:
            if direction == "up" and datagram[0] == w.SEND_ONLY and not hit:
                hit.append(1)
                return datagram[:-5] + bytes([datagram[-5] ^ 1]) + datagram[-4:]
            return datagram
        relay = Relay(("127.3.32.9", 4791), ("127.3.32.1", 4791), corrupt=corrupt).start()
        p = await Pair().open(32, via=relay)
        await p.iqp.send(b"payload!")
        assert (await p.tqp.recv()).payload == b"payload!"
        assert hit and p.tqp.stats["icrc_errors"] == 1 and p.tqp.stats["recv"] == 1
        await p.close()
        relay.close()
    run(body())


def test_retries_exhausted_lose_the_connection():
    async def body():
        relay = Relay(("127.3.33.9", 4791), ("127.3.33.1", 4791)).start()
        p = await Pair().open(33, via=relay, ack_timeout=0.01, retry_count=2)
        relay.loss = 1.0
        started = time.monotonic()
        with pytest.raises(ConnectionLost, match="retry"):
            await p.iqp.write(p.region.stag, 0, b"lost")
        assert time.monotonic() - started < 2
        assert p.iqp.stats["retransmits"] == 2
        p.listener.close()
        relay.close()
    run(body())


# --- what the wire shows ----------------------------------------------------------------------

async def _exchange(p: Pair, inv_stag: int) -> None:
    """One of every message kind, small MTU so that messages are segmented."""
    await p.iqp.send(b"hello, target", solicited=True)
    await p.iqp.send(bytes(range(256)) * 4 + b"x", imm=0x1234)
    await p.iqp.send(b"go away", invalidate=inv_stag)
    await p.iqp.write(p.region.stag, 0, b"w" * 601)
    await p.iqp.write(p.region.stag, 0, b"imm", imm=9)
    await p.iqp.write(p.region.stag, 0, b"v" * 600, imm=10)
    await p.iqp.read(p.region.stag, 0, 1000)
    await p.iqp.read(p.region.stag, 0, 3)
    await p.iqp.fetch_add(p.region.stag, 1024, 1)
    await p.iqp.compare_swap(p.region.stag, 1024, 1, 5)


EXPECTED_OPCODES = {
    "CM: ConnectRequest", "CM: ConnectReply", "CM: ReadyToUse", "CM: DisconnectRequest",
    "CM: DisconnectReply", "RC Send Only", "RC Send First", "RC Send Middle",
    "RC Send Last Immediate", "RC Send Only Invalidate", "RC RDMA Write First",
    "RC RDMA Write Middle", "RC RDMA Write Last", "RC RDMA Write Only Immediate",
    "RC RDMA Write Last Immediate", "RC RDMA Read Request", "RC RDMA Read Response First",
    "RC RDMA Read Response Middle", "RC RDMA Read Response Last",
    "RC RDMA Read Response Only", "RC Fetch Add", "RC Atomic Acknowledge", "RC Compare Swap",
    "RC Acknowledge"}


def _check_capture(path: Path) -> None:
    """tshark names every frame right and finds nothing malformed; ICRCs verify; the RDMA
    messages decode to what ``_exchange`` sent."""
    text = tshark_text(path, *TSHARK_OPTS)
    assert "Malformed" not in text and "Expert" not in text
    infos = [line.split("RRoCE", 1)[1].split(None, 1)[1] for line in text.splitlines()
             if "RRoCE" in line]
    named = {info.split(" QP=")[0].strip() for info in infos}
    assert named == EXPECTED_OPCODES
    frames = rdpcap(str(path))
    assert frames and all(icrc_ok(bytes(frame)) for frame in frames)
    fields = tshark_frames(path, *TSHARK_OPTS)
    assert all(f.get("udp.dstport") == ["4791"] for f in fields)
    messages = [m for m in iter_rdma_messages(frames) if m.kind != "ack"
                and m.info["dqpn"] != w.CM_QPN]
    assert all(m.info["complete"] and m.info["icrc_ok"] for m in messages)
    kinds = [(m.kind, m.payload) for m in messages if m.kind in ("send", "send_inv", "write",
                                                                 "write_imm")]
    assert kinds == [("send", b"hello, target"), ("send", bytes(range(256)) * 4 + b"x"),
                     ("send_inv", b"go away"), ("write", b"w" * 601), ("write_imm", b"imm"),
                     ("write_imm", b"v" * 600)]
    reads = [m.payload for m in messages if m.kind == "read_response"]
    assert reads == [b"v" * 600 + b"w" + bytes(399), b"vvv"]
    atomics = [m.info["orig_data"] for m in messages if m.kind == "atomic_response"]
    assert atomics == [0, 1]


@needs_tshark
def test_pcap_of_frame_listener_decodes_in_tshark(tmp_path):
    path = tmp_path / "roce.pcap"

    async def body():
        sink = PcapSink(path)
        p = await Pair().open(40, frame_listeners=[sink], mtu=256)
        inv = p.tmem.register(bytearray(8), Access.REMOTE_READ)
        await _exchange(p, inv.stag)
        await p.close()
        sink.close()
    run(body())
    _check_capture(path)


def _capture_on_lo(path: Path) -> subprocess.Popen:
    """tshark on lo, started and ready, or skip. "Capturing on" comes before the capture
    runs; dumpcap's "Capture started" message says it does."""
    proc = subprocess.Popen([TSHARK, "-i", "lo", "-f", "udp and net 127.3.41.0/24",
                             "-w", str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    line = ""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and proc.poll() is None:
        line = proc.stderr.readline()
        if "Capture started" in line:
            return proc
    proc.kill()
    proc.wait(5)
    pytest.skip(f"capturing on lo is not permitted here: {line.strip() or proc.returncode}")


@pytest.mark.slow
@needs_tshark
def test_real_capture_on_lo_decodes_and_icrcs_verify(tmp_path):
    if shutil.which("dumpcap") is None:
        pytest.skip("dumpcap is not installed")
    path = tmp_path / "lo.pcapng"
    proc = _capture_on_lo(path)
    try:
        async def body():
            p = await Pair().open(41, mtu=256)
            inv = p.tmem.register(bytearray(8), Access.REMOTE_READ)
            await _exchange(p, inv.stag)
            await p.close()
        run(body())
        time.sleep(0.5)            # let dumpcap write the last frames
    finally:
        proc.terminate()
        proc.wait(10)
    _check_capture(path)


def test_synthesized_frames_match_scapy_oracle():
    """Every header field the data path packs, read back by Scapy."""
    from scapy.contrib.roce import BTH
    from scapy.layers.l2 import Ether

    from kbtp_scapy.layers.roce import RETH, AtomicETH

    path = w.Path(("127.3.50.2", 4791), ("127.3.50.1", 4791))
    head = w.BTH_ATOMIC.pack(w.FETCH_ADD, 0, 0xFFFF, 0x123456, 0x80ABCDEF & 0x80FFFFFF,
                             0x1122334455667788, 0xCAFEBABE, 5, 0)
    frame = path.frame(b"".join(w.seal(path, [head], 0)))
    pkt = Ether(frame)
    assert pkt[BTH].opcode == 0x14 and pkt[BTH].dqpn == 0x123456 and pkt[BTH].ackreq == 1
    assert pkt[BTH].psn == 0xABCDEF and pkt[AtomicETH].rkey == 0xCAFEBABE
    assert pkt[AtomicETH].va == 0x1122334455667788 and pkt[AtomicETH].swap_add == 5
    assert icrc_ok(frame) and pkt["IP"].flags == "DF" and pkt["IP"].id == 0
    payload = b"abcde"
    head = w.BTH_RETH.pack(w.WRITE_ONLY, 3 << 4, 0xFFFF, 7, 1, 0x10, 0x20, 5)
    frame = path.frame(b"".join(w.seal(path, [head, payload], 3)))
    pkt = Ether(frame)
    assert pkt[BTH].padcount == 3 and pkt[RETH].dlen == 5 and icrc_ok(frame)
    assert not icrc_ok(frame[:-9] + b"E" + frame[-8:])     # "abcde" -> "abcdE"
