"""Frames from our layers, segmenter and RC connection builder, read back by tshark 4.0:
no malformed frame, no expert info, and tshark's header values equal to the Scapy layers'.
All frames go into one pcap per tshark run."""
from __future__ import annotations

import pytest
from scapy.compat import raw
from scapy.contrib.roce import BTH, cnp
from scapy.layers.inet import IP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Ether
from scapy.utils import wrpcap

from kbtp_scapy.builders.roce import RcConnection, RoceEndpoint, segment_message
from kbtp_scapy.layers.roce import HEADERS, OPCODES, BTHPad, bth_parts
from tests.test_roce_captures import assert_matches_tshark
from tests.test_roce_layers import NO_PAYLOAD, TEXT, cases, frame
from tests.tshark import needs_tshark, tshark_frames

#: Empty packets that tshark 4.0 payload heuristics read past the end of (tshark bugs):
#: RPC-over-RDMA on RC Send Last/Only, Mellanox EoIB on UD Send Only. RPC-over-RDMA also
#: throws on the last packet of a Send whose PSNs wrap around 2**24.
EMPTY_BREAKS_HEURISTIC = {
    **{OPCODES[f"RC_SEND_{op}"]: "rpcrdma_infiniband"
       for op in ("LAST", "ONLY", "LAST_WITH_INVALIDATE", "ONLY_WITH_INVALIDATE")},
    **{OPCODES[f"UD_SEND_{op}"]: "mellanox_eoib" for op in ("ONLY", "ONLY_WITH_IMMEDIATE")},
}


def _conversation(v6: bool) -> list:
    """An RC conversation with messages around the path MTU (256) in both directions; the
    PSNs of "a" wrap inside an RDMA Write."""
    ip = ("fd00::a", "fd00::b") if v6 else ("192.0.2.1", "192.0.2.2")
    conn = RcConnection(RoceEndpoint(ip[0], "02:00:00:00:00:0a", 0x000111, psn=0xFFFFF2),
                        RoceEndpoint(ip[1], "02:00:00:00:00:0b", 0x000222, psn=7), mtu=256)
    text = TEXT * 8
    for size in (255, 256, 257, 511, 513, 700):
        conn.send("a", text[:size], ack=size != 255)
    conn.send("b", text[:300], imm=0x01020304, solicited=True)
    conn.send("b", text[:20], inv_rkey=0xFEDC)
    conn.send("b", text[:520], inv_rkey=0xFEDC)
    wrapping = conn.write("a", text[:600], va=0x7F0000001000, rkey=0x1234)
    assert [f[BTH].psn for f in wrapping] == [0xFFFFFE, 0xFFFFFF, 0, 0]  # FIRST..LAST, ACK
    conn.write("a", text[:17], va=0x7F0000002000, rkey=0x1234, imm=5)
    conn.write("b", text[:900], va=0x7F0000003000, rkey=0x4321, imm=6)
    conn.write("b", b"", va=0x7F0000004000, rkey=0x4321)
    conn.read("a", text[:1000], va=0x7F0000005000, rkey=0x99)
    conn.read("b", text[:18], va=0x7F0000006000, rkey=0x98)
    conn.read("a", b"", va=0x7F0000007000, rkey=0x97)
    conn.fetch_add("a", va=0x7F0000008000, rkey=0x96, add=1 << 32, original=7 << 32)
    conn.compare_swap("b", va=0x7F0000008000, rkey=0x96, compare=7 << 32, swap=1,
                      original=7 << 32)
    conn.ack("a")
    return conn.frames


def _uc_messages(v6: bool) -> list:
    """UC Sends and Writes (no ACKs, no AckReq) segmented at MTU 256."""
    if v6:
        net = IPv6(src="fd00::c", dst="fd00::d") / UDP(sport=50000, dport=4791)
    else:
        net = (IP(src="192.0.2.3", dst="192.0.2.4", flags="DF")
               / UDP(sport=50000, dport=4791, chksum=0))
    stacks: list = []
    for kind, extra in (("send", {}), ("send", {"imm": 1}), ("write", {"va": 0x10, "rkey": 2}),
                        ("write_imm", {"va": 0x10, "rkey": 2, "imm": 3})):
        stacks += segment_message(kind, TEXT * 3, dqpn=0x333, psn=40 + len(stacks), mtu=256,
                                  service="UC", **extra)
    assert not any(s[BTH].ackreq for s in stacks)
    return [Ether(src="02:00:00:00:00:0c", dst="02:00:00:00:00:0d") / net / s for s in stacks]


def _built_frames() -> list:
    frames = [frame(opcode, payload, v6=v6) for opcode, payload, v6 in cases()]
    frames += [frame(op) for op in sorted(HEADERS)
               if op not in NO_PAYLOAD and op not in EMPTY_BREAKS_HEURISTIC]
    eth = Ether(src="02:00:00:00:00:0e", dst="02:00:00:00:00:0f")
    frames += [eth / IP(src="192.0.2.5", dst="192.0.2.6") / UDP(sport=49152, dport=4791, chksum=0)
               / cnp(0x456),
               eth / IPv6(src="fd00::e", dst="fd00::f") / UDP(sport=49152, dport=4791) / cnp(0x456)]
    for v6 in (False, True):
        frames += _conversation(v6) + _uc_messages(v6)
    return [Ether(raw(f)) for f in frames]


def _check(packets, tframes) -> None:
    assert len(tframes) == len(packets)
    for number, (pkt, tframe) in enumerate(zip(packets, tframes), 1):
        assert "_ws.malformed" not in tframe, number
        assert not [k for k in tframe if k.startswith("_ws.expert")], number
        assert "infiniband.bth.opcode" in tframe, number
        assert_matches_tshark(pkt, tframe, number)
        if pkt[BTH].opcode in HEADERS:
            body = bth_parts(pkt)[1] + (pkt[BTHPad].pad if BTHPad in pkt else b"")
            assert ("data.data" in tframe) == bool(body), number


@pytest.mark.slow
@needs_tshark
def test_built_frames_read_back_by_tshark(tmp_path):
    packets = _built_frames()
    ops = {p[BTH].opcode for p in packets}
    assert set(HEADERS) <= ops and {p[BTH].padcount for p in packets} == {0, 1, 2, 3}
    assert {IP, IPv6} <= {p[UDP].underlayer.__class__ for p in packets}
    path = tmp_path / "built.pcap"
    wrpcap(str(path), packets)
    _check(packets, tshark_frames(path))


@needs_tshark
def test_frames_tripping_tshark_heuristics_are_well_formed_without_them(tmp_path):
    """Empty packets, and a Send whose PSNs wrap: with the heuristics that throw on them
    disabled, tshark finds nothing wrong with the frames."""
    packets = [Ether(raw(frame(op, v6=v6))) for op in sorted(EMPTY_BREAKS_HEURISTIC)
               for v6 in (False, True)]
    conn = RcConnection(RoceEndpoint("192.0.2.1", "02:00:00:00:00:0a", 0x111, psn=0xFFFFFF),
                        RoceEndpoint("192.0.2.2", "02:00:00:00:00:0b", 0x222), mtu=256)
    packets += conn.send("a", TEXT * 2)
    assert [p[BTH].psn for p in packets[-3:]] == [0xFFFFFF, 0, 0]
    path = tmp_path / "tripping.pcap"
    wrpcap(str(path), packets)
    disable = [a for h in sorted(set(EMPTY_BREAKS_HEURISTIC.values()))
               for a in ("--disable-heuristic", h)]
    _check(packets, tshark_frames(path, *disable))
