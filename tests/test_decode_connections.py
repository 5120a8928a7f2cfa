"""RoCEv2 connections in ``kbtp decode``: two RC connections between the same two hosts
are told apart by their pair of QPs (the CM's REQ and REP, else the PSNs the RC transport
answers, else the address pair), each with its own number and ADDR_LE choice; the compiled
core numbers them as the Python decoder does."""
from __future__ import annotations

import json
import random
import secrets
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from kbtp_scapy import codec
from kbtp_scapy.builders.roce import RcConnection, RoceEndpoint
from kbtp_scapy.capture import kbtp_messages, rdma_messages, read_packets, to_json
from kbtp_scapy.decode import core
from kbtp_scapy.rnic import cm
from kbtp_scapy.target import TargetConfig
from kbtp_scapy.vocab import Feature, Opcode
from kbtp_scapy.wire import roce as W
from kbtp_scapy.wire.address import ROCE_PORT
from tests.kbtp_harness import TargetThread
from tests.test_decode import kbtp, write_pcap

A, B = "10.7.0.1", "10.7.0.2"
QPS = ((0x51463F, 0x0A0001), (0x283824, 0x0A0002))      # (A's QP, B's QP) of each connection


def _cm_frame(src: str, dst: str, msg: cm.CmMessage) -> bytes:
    """A CM MAD in a UD SEND ONLY to QP1, as librdmacm sends it (ICRC not checked here)."""
    head = W.BTH_DETH.pack(W.UD_SEND_ONLY, 0, W.DEFAULT_PKEY, W.CM_QPN, 0, W.CM_QKEY, W.CM_QPN)
    return bytes(Ether(src="02:00:00:00:07:01", dst="02:00:00:00:07:02") / IP(src=src, dst=dst)
                 / UDP(sport=0xC000, dport=ROCE_PORT, chksum=0)
                 / Raw(head + cm.encode(msg) + bytes(4)))


def two_connections(path: Path, *, with_cm: bool, acks: bool, crossed: bool) -> Path:
    """Two RC connections from A to B, the second ADDR_LE: HELLO, HELLO_ACK, a LOAD and its
    COMPLETION on each. ``crossed``: both HELLOs before the HELLO_ACKs, the second
    connection's answered first, so that neither the order nor the addresses tell which
    HELLO_ACK belongs to which HELLO; only the CM (``with_cm``) or the ACKs (``acks``) do."""
    conns = [RcConnection(RoceEndpoint(A, "02:00:00:00:07:01", qpn=qa, psn=100 + 50 * i, udp_sport=0xC001 + i),
                          RoceEndpoint(B, "02:00:00:00:07:02", qpn=qb, psn=7000 + 50 * i, udp_sport=0xD001 + i))
             for i, (qa, qb) in enumerate(QPS)]
    frames: list[bytes] = []
    if with_cm:
        for i, (qa, qb) in enumerate(QPS):
            frames.append(_cm_frame(A, B, cm.CmMessage(cm.CmAttr.REQ, 9 + i, local_comm_id=0x1000 + i,
                                                       local_qpn=qa, starting_psn=100 + 50 * i)))
            frames.append(_cm_frame(B, A, cm.CmMessage(cm.CmAttr.REP, 9 + i, local_comm_id=0x2000 + i,
                                                       remote_comm_id=0x1000 + i, local_qpn=qb,
                                                       starting_psn=7000 + 50 * i)))

    def send(i: int, side: str, fields: dict, le: bool = False) -> None:
        frames.extend(bytes(f.original) for f in conns[i].send(side, codec.encode(fields, le), ack=acks))

    def hello_ack(i: int) -> None:
        send(i, "b", {"opcode": Opcode.HELLO_ACK, "hello_ack.features": Feature.ADDR_LE if i else 0,
                      "hello_ack.request_credits": 8, "hello_ack.block_size": 4096,
                      "hello_ack.handle_base": 0x4000, "hello_ack.handle_count": 64})

    for i in (0, 1):
        send(i, "a", {"opcode": Opcode.HELLO, "hello.requested_features": Feature.ADDR_LE if i else 0})
        if not crossed:
            hello_ack(i)
    if crossed:
        hello_ack(1)
        hello_ack(0)
    for i in (0, 1):
        send(i, "a", {"opcode": Opcode.LOAD, "request_id": 7, "handle": 0x4001, "dd.stag": 0x77,
                      "dd.offset": 0x1000, "dd.length": 3000}, le=bool(i))
        send(i, "b", {"opcode": Opcode.COMPLETION, "request_id": 7, "handle": 0x4001,
                      "completion.data_length": 3000}, le=bool(i))
    return write_pcap(path, [(1_700_000_000.0 + 1e-5 * n, f) for n, f in enumerate(frames)])


def decoded(path: Path) -> list[dict]:
    return [json.loads(line) for line in kbtp("decode", "--json", "-q", str(path)).stdout.splitlines()]


def qp_pairs(objs: list[dict]) -> dict[int, set[int]]:
    """Connection number -> the destination QPs of its messages."""
    out: dict[int, set[int]] = {}
    for o in objs:
        out.setdefault(o["conn"], set()).add(o["dst_qp"])
    return out


@pytest.mark.parametrize("with_cm, acks, crossed", [(True, False, True), (False, True, True), (False, False, False)],
                         ids=["cm", "acks", "neither"])
def test_two_connections_between_two_hosts_are_told_apart(tmp_path, with_cm, acks, crossed):
    """Each connection is its two QPs, with its own number and ADDR_LE: the LOAD of the
    ADDR_LE one decodes its little-endian handle and STag, the other's in network order."""
    pcap = two_connections(tmp_path / "two.pcap", with_cm=with_cm, acks=acks, crossed=crossed)
    objs = decoded(pcap)
    assert sorted(map(sorted, qp_pairs(objs).values())) == sorted(sorted(pair) for pair in QPS)
    loads = [o for o in objs if o["kbtp.opcode"] == Opcode.LOAD]
    assert [(o["dst_qp"], o["kbtp.handle"], o["kbtp.dd.stag"]) for o in loads] == \
        [(QPS[0][1], 0x4001, 0x77), (QPS[1][1], 0x4001, 0x77)]
    assert kbtp("decode", "-q", str(pcap)).stderr.decode().endswith("2 connections\n")


@pytest.mark.parametrize("with_cm, acks, crossed", [(True, False, True), (False, True, True), (False, False, False)],
                         ids=["cm", "acks", "neither"])
def test_the_scapy_path_ties_connections_as_the_decoder(tmp_path, with_cm, acks, crossed):
    """``kbtp replay`` and the demo read captures through Scapy (``capture.rdma_messages``):
    they number connections and keep ADDR_LE per connection as ``kbtp decode`` does (they
    merged every RoCEv2 connection between two hosts, so a -q 2 capture replayed as one)."""
    pcap = two_connections(tmp_path / "two.pcap", with_cm=with_cm, acks=acks, crossed=crossed)
    scapy = [to_json(f) for f in kbtp_messages(rdma_messages(read_packets(pcap)))]
    assert [(o["conn"], o["dst_qp"], o.get("kbtp.handle")) for o in scapy] == \
        [(o["conn"], o["dst_qp"], o.get("kbtp.handle")) for o in decoded(pcap)]
    assert len({o["conn"] for o in scapy}) == 2


def test_the_address_pair_is_the_last_resort(tmp_path):
    """With neither the CM nor the transport's answers in the capture, and the HELLO_ACKs
    crossed, nothing says which is which: each HELLO_ACK joins the oldest connection that
    waits for its other direction (documented in docs/DECISIONS.md)."""
    objs = decoded(two_connections(tmp_path / "blind.pcap", with_cm=False, acks=False, crossed=True))
    pairs = qp_pairs(objs)
    assert len(pairs) == 2 and {QPS[0][1], QPS[1][0]} in pairs.values()


@pytest.mark.slow
def test_a_bench_of_two_sessions_is_two_connections(tmp_path):
    """``kbtp bench roce://... -q 2 --pcap``: two RC connections between the same two hosts
    (iWARP -q 3 gives three by their TCP ports), recorded by the real target's RNIC: two
    numbers, and ``--conn 1`` lists the messages of the second connection's two QPs only."""
    net = f"127.51.{secrets.randbelow(250) + 1}"
    target = TargetThread("roce", TargetConfig(blocks=64, block_size=4096, max_initiators=8),
                          hosts=[f"{net}.{i}" for i in range(1, 4)])
    pcap = tmp_path / "q2.pcap"
    try:
        proc = subprocess.run([sys.executable, "-m", "kbtp_scapy", "bench", target.url, "--local",
                               target.initiator_hosts[0], "-q", "2", "-n", "4", "-s", "512", "--pcap", str(pcap)],
                              capture_output=True, text=True, timeout=120)
    finally:
        target.stop()
    assert proc.returncode == 0, proc.stderr
    objs = decoded(pcap)
    pairs = qp_pairs(objs)
    assert len(pairs) == 2 and all(len(qps) == 2 for qps in pairs.values())
    assert not pairs[0] & pairs[1]
    hellos = [o["conn"] for o in objs if o["kbtp.opcode"] in (Opcode.HELLO, Opcode.HELLO_ACK)]
    assert sorted(hellos) == [0, 0, 1, 1]
    second = [json.loads(line) for line in
              kbtp("decode", "--json", "-q", "--conn", "1", str(pcap)).stdout.splitlines()]
    assert second and {o["dst_qp"] for o in second} == pairs[1]
    if core.BUILT:
        from tests.test_decode_core import identical  # it builds this module's captures
        identical(pcap)


@pytest.mark.slow
def test_a_qp_selects_its_connection_at_either_end(tmp_path):
    """--qp names a QP at either end of a connection: the listing and --stats have the
    connection's requests (to B's QP) and their answers (to A's QP) alike, whichever is named."""
    pcap = two_connections(tmp_path / "two.pcap", with_cm=True, acks=True, crossed=True)
    every = decoded(pcap)
    for i, qps in enumerate(QPS):
        want = [o["frame"] for o in every if o["dst_qp"] in qps]
        for qp in qps:
            listed = kbtp("decode", "--json", "-q", "--qp", hex(qp), str(pcap)).stdout.splitlines()
            assert [json.loads(line)["frame"] for line in listed] == want, (i, hex(qp))
            stats = json.loads(kbtp("decode", "--stats", "--json", "-q", "--qp", hex(qp), str(pcap)).stdout)
            assert {op: s["calls"] for op, s in stats["by_opcode"].items()} == {"HELLO": 1, "LOAD": 1}
            assert stats["unanswered"] == 0
    text = kbtp("decode", "--stats", "-q", "--qp", hex(QPS[0][0]), str(pcap)).stdout.decode()
    assert text.splitlines()[-1] == "2 requests answered, 0 unanswered"


@pytest.mark.slow
def test_an_address_or_a_network_matches_either_end(tmp_path):
    """--addr takes an address or a network (as Wireshark's ip.addr == 192.0.2.0/24), IPv4
    or IPv6, and matches the source or the destination."""
    pcap = two_connections(tmp_path / "two.pcap", with_cm=False, acks=True, crossed=False)
    every = [o["frame"] for o in decoded(pcap)]

    def frames(path: Path, *args: str) -> list[int]:
        out = kbtp("decode", "--json", "-q", *args, str(path)).stdout.splitlines()
        return [json.loads(line)["frame"] for line in out]
    assert frames(pcap, "--addr", B) == frames(pcap, "--addr", A) == frames(pcap, "--addr", "10.7.0.0/24") == every
    assert frames(pcap, "--addr", "10.7.0.2/31") == every and frames(pcap, "--addr", "10.8.0.0/16") == []
    v6 = Path(__file__).resolve().parent.parent / "pcaps" / "roce_addr_le_ipv6_session.pcap"
    all_v6 = [o["frame"] for o in decoded(v6)]
    src = decoded(v6)[0]["src"]
    assert all_v6 and frames(v6, "--addr", f"{src}/64") == all_v6 and frames(v6, "--addr", "10.7.0.0/16") == []


@pytest.mark.parametrize("args, says", [
    (("--from", "0.0002", "--to", "0.0001"), "--from 0.0002 is after --to 0.0001"),
    (("--from", "-1"), "-1 is not a time in the capture"),
    (("--to", "nan"), "nan is not a time in the capture"),
    (("--addr", "192.0.2.0/33"), "is not an IP address or network"),
])
def test_filters_that_can_match_nothing_are_usage_errors(args, says):
    pcap = Path(__file__).resolve().parent.parent / "pcaps" / "roce_session.pcap"
    proc = kbtp("decode", *args, str(pcap), check=False)
    assert proc.returncode == 2 and proc.stdout == b""
    assert len(proc.stderr.splitlines()) == 1 and says in proc.stderr.decode(), proc.stderr


def test_a_qp_on_a_capture_without_rocev2_says_it_applies_to_rocev2_only():
    pcaps = Path(__file__).resolve().parent.parent / "pcaps"
    proc = kbtp("decode", "-q", "--qp", "0x22", str(pcaps / "iwarp_session.pcap"))
    assert proc.stdout == b""
    note, summary = proc.stderr.decode().splitlines()
    assert note == f"kbtp: --qp applies to RoCEv2 only, and {pcaps / 'iwarp_session.pcap'} has no RoCEv2 KBTP message"
    assert summary.endswith("0 shown")
    assert "RoCEv2 only" not in kbtp("decode", "-q", "--qp", "0x22", str(pcaps / "roce_session.pcap")).stderr.decode()


def _frame(src: str, dst: str, packet: bytes) -> bytes:
    """Ethernet, IPv4 and UDP to 4791 around a BTH packet (its ICRC zero: not looked at here)."""
    body = packet + bytes(4)
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 28 + len(body), 0, 0x4000, 64, 17, 0,
                     socket.inet_aton(src), socket.inet_aton(dst))
    udp = struct.pack("!HHHH", 0xC000, ROCE_PORT, 8 + len(body), 0)
    return b"\x02\0\0\0\0\x01\x02\0\0\0\0\x02\x08\x00" + ip + udp + body


def _tangle(rng: random.Random) -> list[bytes]:
    """RoCEv2 frames between three hosts on a few QPs with nearby PSNs: KBTP Sends (HELLO_ACKs
    with and without ADDR_LE, LOADs), ACKs, Reads, Writes and CM REQs and REPs, in any order,
    so that the CM, the transport, ambiguity and the address pair all decide somewhere."""
    hosts, qps = ("10.6.0.1", "10.6.0.2", "10.6.0.3"), (0x11, 0x12, 0x21, 0x22)
    frames = []
    for _ in range(rng.randrange(20, 80)):
        src, dst = rng.sample(hosts[:rng.choice((2, 3))], 2)
        qp, psn = rng.choice(qps), rng.randrange(100, 112)
        kind = rng.randrange(7)
        if kind == 0:
            le = rng.random() < 0.5
            fields = rng.choice([{"opcode": Opcode.HELLO_ACK, "hello_ack.features": Feature.ADDR_LE if le else 0},
                                 {"opcode": Opcode.LOAD, "request_id": 3, "handle": 0x4001, "dd.stag": 0x77,
                                  "dd.length": 64},
                                 {"opcode": Opcode.HELLO}])
            packet = W.BTH.pack(W.SEND_ONLY, 0, W.DEFAULT_PKEY, qp, psn) + codec.encode(fields, le)
        elif kind in (1, 2):
            packet = W.BTH.pack(rng.choice((W.ACKNOWLEDGE, W.READ_RESP_ONLY)), 0, W.DEFAULT_PKEY, qp, psn) + bytes(4)
        elif kind == 3:
            packet = W.BTH_RETH.pack(rng.choice((W.WRITE_ONLY, W.READ_REQUEST)), 0, W.DEFAULT_PKEY, qp, psn, 0, 7, 8)
        elif kind == 4:
            packet = W.BTH.pack(W.FETCH_ADD, 0, W.DEFAULT_PKEY, qp, psn) + bytes(28)
        else:
            attr = cm.CmAttr.REQ if kind == 5 else cm.CmAttr.REP
            msg = cm.CmMessage(attr, 1, local_comm_id=rng.randrange(3), remote_comm_id=rng.randrange(3),
                               local_qpn=rng.choice(qps))
            packet = W.BTH_DETH.pack(W.UD_SEND_ONLY, 0, W.DEFAULT_PKEY, W.CM_QPN, 0, W.CM_QKEY, 1) + cm.encode(msg)
        frames.append(_frame(src, dst, packet))
    return frames


@pytest.mark.skipif(not core.BUILT, reason="the extension is not built (pip install -e .)")
@pytest.mark.slow
def test_tangled_connections_are_numbered_alike_by_the_core(tmp_path):
    """Random tangles of QPs, PSNs, answers and CM messages: the core ties and numbers the
    connections exactly as the Python decoder does."""
    from tests.test_decode_core import identical
    rng = random.Random(34)
    many = 0
    for i in range(40):
        path = write_pcap(tmp_path / f"t{i}.pcap", [(1.0 + n * 1e-5, f) for n, f in enumerate(_tangle(rng))])
        identical(path)
        many += len({o["conn"] for o in decoded(path)}) > 2
    assert many > 10
