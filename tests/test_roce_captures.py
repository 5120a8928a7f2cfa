"""The RoCE layers against real captures (Linux rxe, ConnectX): tshark 4.0 is the oracle for
every header field, and every stored ICRC must recompute."""
from __future__ import annotations

from ipaddress import IPv6Address
from pathlib import Path

import pytest
from scapy.compat import raw
from scapy.contrib.roce import AETH, BTH, GRH
from scapy.utils import rdpcap

from kbtp_scapy.builders.roce import iter_rdma_messages
from kbtp_scapy.layers.roce import (
    DETH,
    HEADERS,
    IETH,
    RETH,
    AtomicAckETH,
    AtomicETH,
    BTHPad,
    ImmDt,
    bth_parts,
    icrc_ok,
)
from tests.tshark import needs_tshark, tshark_frames

CAPTURES = sorted((Path(__file__).parent / "data" / "captures").glob("*.pcap"))
CX4 = Path(__file__).parent / "data" / "captures" / "hexvec_scapy_roce_uts_cx4.pcap"

#: The tshark item that stands for each header.
HEADER_ITEMS = {GRH: "infiniband.grh", RETH: "infiniband.reth", DETH: "infiniband.deth",
                AETH: "infiniband.aeth", AtomicETH: "infiniband.atomiceth",
                AtomicAckETH: "infiniband.atomicacketh", ImmDt: "infiniband.immdt",
                IETH: "infiniband.ieth"}


def _colon_hex(data: bytes) -> str:
    return ":".join(f"{b:02x}" for b in data)


def expected_tshark(pkt) -> dict[str, list[str]]:
    """tshark 4.0's field values for the RoCE headers of a Scapy packet, as tshark prints
    them (AtomicETH VA and R_Key reuse the RETH fields; ImmDt and IETH are byte strings)."""
    bth = pkt[BTH]
    out = {
        "infiniband.bth.opcode": [str(bth.opcode)], "infiniband.bth.se": [str(bth.solicited)],
        "infiniband.bth.m": [str(bth.migreq)], "infiniband.bth.padcnt": [str(bth.padcount)],
        "infiniband.bth.tver": [str(bth.version)], "infiniband.bth.p_key": [str(bth.pkey)],
        "infiniband.reserved": [f"{bth.fecn << 7 | bth.becn << 6 | bth.resv6:02x}"],
        "infiniband.bth.destqp": [f"0x{bth.dqpn:06x}"], "infiniband.bth.a": [str(bth.ackreq)],
        "infiniband.bth.reserved7": [str(bth.resv7)], "infiniband.bth.psn": [str(bth.psn)],
    }
    if GRH in pkt:
        grh = pkt[GRH]
        out.update({
            "infiniband.grh.ipver": [str(grh.ipver)], "infiniband.grh.tclass": [str(grh.tclass)],
            "infiniband.grh.flowlabel": [str(grh.flowlabel)],
            "infiniband.grh.paylen": [str(grh.paylen)], "infiniband.grh.nxthdr": [str(grh.nexthdr)],
            "infiniband.grh.hoplmt": [str(grh.hoplmt)],
            "infiniband.grh.sgid": [str(IPv6Address(grh.sgid))],
            "infiniband.grh.dgid": [str(IPv6Address(grh.dgid))],
        })
    if bth.opcode not in HEADERS:  # CNP: tshark shows the rest as vendor data
        return out
    headers, _ = bth_parts(pkt)
    for cls, h in headers.items():
        if cls is RETH:
            out.update({"infiniband.reth.va": [f"0x{h.va:016x}"],
                        "infiniband.reth.r_key": [f"0x{h.rkey:08x}"],
                        "infiniband.reth.dmalen": [str(h.dlen)]})
        elif cls is DETH:
            out.update({"infiniband.deth.q_key": [f"0x{h.qkey:016x}"],
                        "infiniband.deth.srcqp": [f"0x{h.srcqp:08x}"]})
            out["infiniband.reserved"].append(f"{h.reserved:02x}")
        elif cls is AETH:
            out.update({"infiniband.aeth.syndrome": [str(h.syndrome)],
                        "infiniband.aeth.msn": [str(h.msn)]})
        elif cls is AtomicETH:
            out.update({"infiniband.reth.va": [f"0x{h.va:016x}"],
                        "infiniband.reth.r_key": [f"0x{h.rkey:08x}"],
                        "infiniband.atomiceth.swapdt": [str(h.swap_add)],
                        "infiniband.atomiceth.cmpdt": [str(h.compare)]})
        elif cls is AtomicAckETH:
            out["infiniband.atomicacketh.origremdt"] = [str(h.orig_data)]
        elif cls is ImmDt:
            out["infiniband.immdt"] = [_colon_hex(h.imm.to_bytes(4, "big"))]
        elif cls is IETH:
            out["infiniband.ieth"] = [_colon_hex(h.rkey.to_bytes(4, "big"))]
    out["infiniband.invariant.crc"] = [f"0x{bth.icrc:08x}"]
    return out


def assert_matches_tshark(pkt, tframe: dict[str, list[str]], number: int) -> None:
    """Every header field, the set of headers, and the payload with its pad, as tshark has
    them. tshark adds ImmDt and IETH twice, so values are compared deduplicated; it names
    every reserved field alike, so only the BTH's and DETH's (the first ones) count. When a
    payload heuristic throws, tshark stops before the ICRC and shows no data."""
    expected = expected_tshark(pkt)
    if "_ws.malformed" in tframe:
        assert tframe["frame.protocols"][-1].endswith(":infiniband:rpcordma"), number
        del expected["infiniband.invariant.crc"]
    for key, values in expected.items():
        got = tframe.get(key, [])
        if key.endswith("gid"):
            got = [str(IPv6Address(v)) for v in got]
        elif key == "infiniband.reserved":
            got = got[:len(values)]
        assert list(dict.fromkeys(got)) == list(dict.fromkeys(values)), (number, key, got, values)
    for cls, item in HEADER_ITEMS.items():
        assert (item in tframe) == (cls in pkt), (number, item)
    if "data.data" in tframe:
        _, payload = bth_parts(pkt)
        pad = pkt[BTHPad].pad if BTHPad in pkt else b""
        assert tframe["data.data"][-1] == _colon_hex(payload + pad), number


@pytest.fixture(scope="module", params=CAPTURES, ids=lambda p: p.name)
def capture(request):
    return request.param, rdpcap(str(request.param)), tshark_frames(request.param)


@needs_tshark
def test_every_rdma_frame_matches_tshark_and_its_icrc(capture):
    _, packets, tframes = capture
    assert len(packets) == len(tframes)
    rdma = 0
    for number, (pkt, tframe) in enumerate(zip(packets, tframes), 1):
        if "infiniband.bth.opcode" not in tframe:
            assert BTH not in pkt, number
            continue
        rdma += 1
        assert icrc_ok(pkt), number
        assert raw(pkt.__class__(raw(pkt))) == raw(pkt), number
        assert_matches_tshark(pkt, tframe, number)
    assert rdma


@needs_tshark
def test_messages_cover_every_rdma_frame_once(capture):
    """Each RDMA frame (CNP aside) belongs to exactly one complete message whose payload is
    the concatenation of what tshark shows per frame, less the pad."""
    _, packets, tframes = capture
    messages = list(iter_rdma_messages(packets))
    frames = sorted(n for m in messages for n in m.frames)
    assert frames == [n for n, t in enumerate(tframes, 1)
                      if int(t.get("infiniband.bth.opcode", ["256"])[-1]) in HEADERS]
    for m in messages:
        assert m.info["complete"] and m.info["icrc_ok"], m
        first = tframes[m.frames[0] - 1]
        assert m.info["psn"] == int(first["infiniband.bth.psn"][-1])
        assert m.conn[2] == int(first["infiniband.bth.destqp"][-1], 16)
        if all("data.data" in tframes[n - 1] for n in m.frames):
            parts = [bytes.fromhex(tframes[n - 1]["data.data"][-1].replace(":", ""))
                     for n in m.frames]
            pads = [int(tframes[n - 1]["infiniband.bth.padcnt"][-1]) for n in m.frames]
            assert m.payload == b"".join(p[:len(p) - c] for p, c in zip(parts, pads))
        if m.kind == "write":
            assert len(m.payload) == m.info["dma_length"]


def test_read_responses_carry_the_requested_length():
    """Read Responses travel back to the requester's QP with the PSN of its Read Request."""
    packets = rdpcap(str(CAPTURES[[p.name for p in CAPTURES].index("rxe_linlin_read_lat.pcap")]))
    messages = list(iter_rdma_messages(packets))
    requests = {(m.conn[1], m.conn[0], m.info["psn"]): m for m in messages
                if m.kind == "read_request"}
    responses = [m for m in messages if m.kind == "read_response"]
    assert responses and len(responses) == len(requests)
    for m in responses:
        request = requests[(m.conn[0], m.conn[1], m.info["psn"])]
        assert len(m.payload) == request.info["dma_length"]


def test_connectx_icrc_known_answers():
    """The ICRCs a ConnectX-4 Lx (RoCEv2 CNP) and a Mellanox RoCEv1 NIC put on the wire."""
    cnp, write, ack = rdpcap(str(CX4))
    assert cnp[BTH].icrc == 0x82FD002A
    assert cnp[BTH].compute_icrc(b"") == raw(cnp)[-4:]
    assert (write[BTH].icrc, write[BTH].padcount, write[RETH].dlen) == (0xE3D856BB, 3, 5)
    assert (ack[BTH].icrc, ack[AETH].msn) == (0x25F0C038, 5)
    assert all(icrc_ok(p) for p in (cnp, write, ack))
    assert all(icrc_ok(raw(p)) for p in (cnp, write, ack))


def _masked_v2(ip: int) -> set[int]:
    """Frame offsets the RoCEv2 ICRC masks (IPv4 TOS, TTL, checksum; UDP checksum; BTH
    reserved octet) or does not cover (Ethernet addresses)."""
    return set(range(12)) | {ip + 1, ip + 8, ip + 10, ip + 11, ip + 26, ip + 27, ip + 32}


def _masked_v1(grh: int) -> set[int]:
    """RoCEv1: GRH Traffic Class, Flow Label and Hop Limit; BTH reserved octet."""
    return set(range(12)) | {grh + 1, grh + 2, grh + 3, grh + 7, grh + 44}


@pytest.mark.parametrize("index", [0, 1])
def test_one_flipped_bit_fails_the_icrc(index):
    """Flipping any covered bit of a real frame breaks its ICRC; flipping a masked one
    (fields routers rewrite) does not. GRH byte 0's low nibble is Traffic Class: masked."""
    frame = raw(rdpcap(str(CX4))[index])
    masked = _masked_v2(14) if index == 0 else _masked_v1(14)
    for offset in range(len(frame)):
        for bit in range(8):
            flipped = bytearray(frame)
            flipped[offset] ^= 1 << bit
            keeps = offset in masked or (index == 1 and offset == 14 and bit < 4)
            assert icrc_ok(bytes(flipped)) == keeps, (offset, bit)

