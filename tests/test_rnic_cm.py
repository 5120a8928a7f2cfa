"""The CM MAD codec (kbtp_scapy.rnic.cm) against real Linux rxe captures and tshark 4.0.

The real MADs come from tests/data/captures/rxe_linlin_rping.pcap and rxe_linlin_rdma_cm.pcap
(github.com/linlinw5/rdma_ib_tutorial, CC BY-SA 4.0; see tests/data/captures/SOURCES.md).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st
from scapy.compat import raw
from scapy.contrib.roce import BTH
from scapy.data import DLT_EN10MB
from scapy.layers.inet import IP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Ether
from scapy.packet import Raw
from scapy.utils import PcapWriter, rdpcap

from kbtp_scapy.builders.roce import RcConnection, RoceEndpoint
from kbtp_scapy.layers.roce import DETH, OPCODES, bth_parts, icrc_ok
from kbtp_scapy.rnic.cm import (
    GSI_QKEY,
    GSI_QPN,
    MAD_SIZE,
    CmAttr,
    CmMessage,
    decode,
    encode,
    parse_rdma_cm_private_data,
    rdma_cm_flow_label,
    rdma_cm_private_data,
    rdma_cm_service_id,
)
from tests.tshark import needs_tshark, tshark_frames

DATA = Path(__file__).parent / "data" / "captures"
RPING = DATA / "rxe_linlin_rping.pcap"
RDMA_CM = DATA / "rxe_linlin_rdma_cm.pcap"
#: Frame numbers of the CM MADs in each real capture (rdma_cm.pcap: two connections, both
#: sides sending DREQ at once at the end).
CM_FRAMES = {RPING: [1, 2, 3, 64, 65], RDMA_CM: [1, 2, 3, 24, 25, 30, 91, 92, 93, 94, 95, 96]}
UD_SEND_ONLY = OPCODES["UD_SEND_ONLY"]


def cm_mads(pcap: Path) -> dict[int, bytes]:
    """The MAD of every UD SEND ONLY to QP1, by frame number (ICRC checked)."""
    mads = {}
    for number, frame in enumerate(rdpcap(str(pcap)), 1):
        pkt = Ether(raw(frame))
        if BTH in pkt and pkt[BTH].opcode == UD_SEND_ONLY and pkt[BTH].dqpn == GSI_QPN:
            headers, payload = bth_parts(pkt)
            assert headers[DETH].qkey == GSI_QKEY and headers[DETH].srcqp == GSI_QPN
            assert icrc_ok(pkt) and len(payload) == MAD_SIZE
            mads[number] = payload
    return mads


# --- real captures ----------------------------------------------------------------------

@pytest.mark.parametrize("pcap", [RPING, RDMA_CM], ids=lambda p: p.stem)
def test_every_real_cm_mad_decodes_and_reencodes_byte_identical(pcap):
    mads = cm_mads(pcap)
    assert sorted(mads) == CM_FRAMES[pcap]
    for number, mad in mads.items():
        msg = decode(mad)
        assert msg is not None, number
        assert encode(msg) == mad, number


def _colon_hex(data: bytes) -> str:
    return ":".join(f"{b:02x}" for b in data)


#: tshark 4.0 field name -> CmMessage attribute, per message. Not compared: the REQ primary
#: flow label and packet rate, which tshark 4.0 reads from a 3-octet item under 32-bit masks
#: (the real rping REQ, flow label 0x70bbd and rate 0, shows as 0x70b and 0x30).
TSHARK_FIELDS = {
    CmAttr.REQ: {
        "infiniband.cm.req": "local_comm_id", "infiniband.cm.req.serviceid": "service_id",
        "infiniband.cm.req.localcaguid": "local_ca_guid", "infiniband.cm.req.localqpn": "local_qpn",
        "infiniband.cm.req.responderres": "responder_resources",
        "infiniband.cm.req.initdepth": "initiator_depth",
        "infiniband.cm.req.remoteresptout": "remote_cm_response_timeout",
        "infiniband.cm.req.transpsvctype": "transport_type",
        "infiniband.cm.req.e2eflowctrl": "flow_control",
        "infiniband.cm.req.startpsn": "starting_psn",
        "infiniband.cm.req.localresptout": "local_cm_response_timeout",
        "infiniband.cm.req.retrcount": "retry_count", "infiniband.cm.req.pkey": "pkey",
        "infiniband.cm.req.rnrretrcount": "rnr_retry_count",
        "infiniband.cm.req.maxcmretr": "max_cm_retries", "infiniband.cm.req.srq": "srq",
        "infiniband.cm.req.prim_locallid": "local_lid",
        "infiniband.cm.req.prim_remotelid": "remote_lid",
        "infiniband.cm.req.prim_tfcclass": "traffic_class",
        "infiniband.cm.req.prim_hoplim": "hop_limit", "infiniband.cm.req.prim_sl": "sl",
        "infiniband.cm.req.prim_subnetlocal": "subnet_local",
        "infiniband.cm.req.prim_localacktout": "local_ack_timeout",
    },
    CmAttr.REP: {
        "infiniband.cm.rep": "local_comm_id", "infiniband.cm.rep.remotecommid": "remote_comm_id",
        "infiniband.cm.rep.localqpn": "local_qpn", "infiniband.cm.rep.startpsn": "starting_psn",
        "infiniband.cm.rep.respres": "responder_resources",
        "infiniband.cm.rep.initdepth": "initiator_depth",
        "infiniband.cm.rep.tgtackdelay": "target_ack_delay",
        "infiniband.cm.rep.failoveracc": "failover_accepted",
        "infiniband.cm.rep.e2eflowctrl": "flow_control",
        "infiniband.cm.rep.rnrretrcount": "rnr_retry_count", "infiniband.cm.rep.srq": "srq",
        "infiniband.cm.rep.localcaguid": "local_ca_guid",
        "infiniband.cm.rep.private": "private_data",
    },
    CmAttr.RTU: {"infiniband.cm.rtu.localcommid": "local_comm_id",
                 "infiniband.cm.rtu.remotecommid": "remote_comm_id",
                 "infiniband.cm.rtu.private": "private_data"},
    CmAttr.REJ: {"infiniband.cm.rej.localcommid": "local_comm_id",
                 "infiniband.cm.rej.remotecommid": "remote_comm_id",
                 "infiniband.cm.rej.msgrej": "message", "infiniband.cm.rej.reason": "reject_reason",
                 "infiniband.cm.rej.private": "private_data"},
    CmAttr.DREQ: {"infiniband.cm.dreq.localcommid": "local_comm_id",
                  "infiniband.cm.dreq.remotecommid": "remote_comm_id",
                  "infiniband.cm.req.remoteqpneecn": "remote_qpn",  # sic: tshark's name
                  "infiniband.cm.dreq.private": "private_data"},
    CmAttr.DREP: {"infiniband.cm.drsp.localcommid": "local_comm_id",
                  "infiniband.cm.drsp.remotecommid": "remote_comm_id",
                  "infiniband.cm.drsp.private": "private_data"},
}


def expected_tshark(msg: CmMessage, mad: bytes) -> dict[str, str]:
    """What tshark 4.0 shows for a CM MAD, as comparable strings."""
    out = {"infiniband.mad": _colon_hex(mad),
           "infiniband.mad.transactionid": str(msg.transaction_id),
           "infiniband.mad.attributeid": str(int(msg.attr))}
    for name, attr in TSHARK_FIELDS[msg.attr].items():
        value = getattr(msg, attr)
        out[name] = _colon_hex(value) if isinstance(value, bytes) else str(int(value))
    if msg.attr == CmAttr.REQ:
        out["infiniband.cm.req.pppmtu"] = str(msg.path_mtu.bit_length() - 8)  # 1024 -> 3
        v4 = "." in msg.local_gid
        suffix = "_ipv4" if v4 else ""
        out[f"infiniband.cm.req.prim_localgid{suffix}"] = msg.local_gid
        out[f"infiniband.cm.req.prim_remotegid{suffix}"] = msg.remote_gid
        src, dst, port = parse_rdma_cm_private_data(msg.private_data)
        out["infiniband.cm.req.ip_cm.ipv"] = "4" if v4 else "6"
        out["infiniband.cm.req.ip_cm.sport"] = str(port)
        out["infiniband.cm.req.ip_cm.sip4" if v4 else "infiniband.cm.req.ip_cm.sip6"] = src
        out["infiniband.cm.req.ip_cm.dip4" if v4 else "infiniband.cm.req.ip_cm.dip6"] = dst
    return out


def _as_compared(name: str, value: str) -> str:
    """tshark's JSON value in the form expected_tshark uses (integers in decimal)."""
    try:
        return str(int(value, 0))
    except ValueError:
        return value


def assert_cm_matches_tshark(frames: list[dict[str, list]], mads: dict[int, bytes]) -> None:
    for number, mad in mads.items():
        frame = frames[number - 1]
        assert frame["frame.number"] == [str(number)]
        assert not any(k.startswith(("_ws.malformed", "_ws.expert")) for k in frame), number
        for name, want in expected_tshark(decode(mad), mad).items():
            assert [_as_compared(name, v) for v in frame[name]] == [want], (number, name)


@needs_tshark
@pytest.mark.parametrize("pcap", [RPING, RDMA_CM], ids=lambda p: p.stem)
def test_real_cm_fields_match_tshark(pcap):
    assert_cm_matches_tshark(tshark_frames(pcap), cm_mads(pcap))


def test_defaults_rebuild_the_real_rping_setup():
    """Only what differs per connection is set; every other REQ/REP field comes from the
    defaults, and the MADs come out exactly as Linux sent them."""
    real = cm_mads(RPING)
    tid, active, passive = 0x000000026DC5C06E, 0x6EC0C56D, 0x9D88F456
    src, dst, cma_port, port = "10.1.16.62", "10.1.16.61", 0xBD69, 7174
    req = CmMessage(CmAttr.REQ, tid, local_comm_id=active, service_id=rdma_cm_service_id(port),
                    local_ca_guid=0x025056FFFEA77D03, local_qpn=0x2C, starting_psn=0x3DA6,
                    responder_resources=1, initiator_depth=1, local_gid=src, remote_gid=dst,
                    flow_label=rdma_cm_flow_label(cma_port, port),
                    private_data=rdma_cm_private_data(src, dst, cma_port))
    rep = CmMessage(CmAttr.REP, tid, local_comm_id=passive, remote_comm_id=active,
                    local_ca_guid=0x025056FFFEA7129F, local_qpn=0x2B, starting_psn=0xFEBD3D,
                    responder_resources=1, initiator_depth=1)
    rtu = CmMessage(CmAttr.RTU, tid, local_comm_id=active, remote_comm_id=passive)
    dreq = CmMessage(CmAttr.DREQ, tid, local_comm_id=active, remote_comm_id=passive,
                     remote_qpn=0x2B)
    drep = CmMessage(CmAttr.DREP, tid, local_comm_id=passive, remote_comm_id=active)
    assert [encode(m) for m in (req, rep, rtu, dreq, drep)] == list(real.values())


def test_flow_label_is_linux_hash_of_ports_in_every_real_req():
    reqs = [decode(mad) for pcap in (RPING, RDMA_CM) for mad in cm_mads(pcap).values()
            if decode(mad).attr == CmAttr.REQ]
    assert len(reqs) == 3
    for req in reqs:
        _, _, cma_port = parse_rdma_cm_private_data(req.private_data)
        assert req.flow_label == rdma_cm_flow_label(cma_port, req.service_id & 0xFFFF)


# --- helpers and encoder checks ---------------------------------------------------------

def test_service_id_and_cma_header():
    assert rdma_cm_service_id(7174) == 0x0000000001061C06
    v4 = rdma_cm_private_data("10.1.16.62", "10.1.16.61", 0xBD69)
    assert v4.hex() == "0040bd69" + "00" * 12 + "0a01103e" + "00" * 12 + "0a01103d"
    assert parse_rdma_cm_private_data(v4 + bytes(56)) == ("10.1.16.62", "10.1.16.61", 0xBD69)
    v6 = rdma_cm_private_data("fd00::1", "fd00::2", 18515)
    assert v6[:4] == bytes.fromhex("00604853") and len(v6) == 36
    assert parse_rdma_cm_private_data(v6) == ("fd00::1", "fd00::2", 18515)
    assert parse_rdma_cm_private_data(v6[:35]) is None
    assert parse_rdma_cm_private_data(b"\x01" + v6[1:]) is None      # CMA version 1
    assert parse_rdma_cm_private_data(v6[:1] + b"\x50" + v6[2:]) is None  # IP version 5
    with pytest.raises(ValueError):
        rdma_cm_private_data("10.0.0.1", "fd00::2", 1)
    with pytest.raises(ValueError):
        rdma_cm_service_id(65536)


@pytest.mark.parametrize("msg", [
    CmMessage(CmAttr.REQ, 1 << 63, local_comm_id=0xFFFFFFFF, service_id=rdma_cm_service_id(1),
              local_qpn=0xFFFFFF, starting_psn=0xFFFFFF, path_mtu=4096, responder_resources=16,
              initiator_depth=16, local_gid="fd00::a", remote_gid="fd00::b",
              private_data=rdma_cm_private_data("fd00::a", "fd00::b", 1).ljust(92, b"x"),
              local_ca_guid=0x0102030405060708, remote_cm_response_timeout=31,
              local_cm_response_timeout=1, transport_type=1, flow_control=True, retry_count=3,
              rnr_retry_count=6, max_cm_retries=5, srq=True, pkey=0x8001, local_lid=1,
              remote_lid=2, flow_label=0xFFFFF, packet_rate=0x3F, traffic_class=0xB8,
              hop_limit=1, sl=15, subnet_local=True, local_ack_timeout=31),
    CmMessage(CmAttr.REP, 7, local_comm_id=1, remote_comm_id=2, local_qpn=0x123456,
              starting_psn=0x654321, responder_resources=4, initiator_depth=5,
              private_data=bytes(range(196)), local_ca_guid=9, flow_control=True,
              rnr_retry_count=1, srq=True, target_ack_delay=31, failover_accepted=2),
    CmMessage(CmAttr.REJ, 8, local_comm_id=3, remote_comm_id=4, reject_reason=28, message=1,
              reject_info=b"why", private_data=bytes(range(148))),
    CmMessage(CmAttr.MRA, 9, local_comm_id=5, remote_comm_id=6, message=2, service_timeout=31,
              private_data=bytes(222)),
    CmMessage(CmAttr.DREQ, 10, local_comm_id=7, remote_comm_id=8, remote_qpn=0xABCDEF,
              private_data=b"\xff" * 220),
], ids=lambda m: m.attr.name)
def test_every_field_survives_a_round_trip(msg):
    mad = encode(msg)
    assert len(mad) == MAD_SIZE and mad[:4] == bytes([1, 0x07, 2, 0x03])
    assert decode(mad) == msg


def test_private_data_is_padded_or_cut_to_the_message_size():
    assert decode(encode(CmMessage(CmAttr.RTU, 1, private_data=b"hi"))).private_data == (
        b"hi" + bytes(222))
    assert decode(encode(CmMessage(CmAttr.DREQ, 1, private_data=bytes(300)))).private_data == (
        bytes(220))


@pytest.mark.parametrize("bad", [
    CmMessage(CmAttr.REQ, 1, local_qpn=1 << 24), CmMessage(CmAttr.REQ, 1, path_mtu=1500),
    CmMessage(CmAttr.REQ, 1, flow_label=1 << 20), CmMessage(CmAttr.REP, 1, starting_psn=-1),
    CmMessage(CmAttr.REJ, 1, reject_info=bytes(73)), CmMessage(CmAttr.DREQ, 1, remote_qpn=1 << 24),
    CmMessage(CmAttr.REQ, 1, local_gid="not an address"),
    CmMessage(CmAttr.REP, 1, responder_resources=256), CmMessage(CmAttr.RTU, -1),
    CmMessage(CmAttr.REQ, 1, responder_resources=256),
])
def test_encode_refuses_values_that_do_not_fit(bad):
    with pytest.raises(ValueError):
        encode(bad)


def test_decode_refuses_what_is_not_a_known_cm_mad():
    mad = encode(CmMessage(CmAttr.RTU, 1))
    assert decode(mad[:-1]) is None and decode(mad + b"\0") is None
    for index, value in ((0, 2), (1, 0x81), (2, 1), (3, 0x81)):   # version, class, method
        assert decode(mad[:index] + bytes([value]) + mad[index + 1:]) is None
    assert decode(mad[:16] + b"\x00\x17" + mad[18:]) is None       # SIDR_REQ: not ours
    req = encode(CmMessage(CmAttr.REQ, 1))
    assert decode(req[:74] + bytes([0x07]) + req[75:]) is None     # path MTU code 0


# --- decode never raises ----------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_decode_never_raises_on_garbage(data):
    assert decode(data) is None or len(data) == MAD_SIZE


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(list(CmAttr)), st.binary(min_size=232, max_size=232),
       st.integers(0, MAD_SIZE))
def test_decode_of_any_cm_body_is_stable(attr, body, cut):
    """A well-formed header with any body: decode never raises, what it returns encodes to
    a MAD that decodes to the same message, and any truncation is refused."""
    mad = encode(CmMessage(attr, 0x1234))[:24] + body
    msg = decode(mad)
    if msg is not None:
        assert decode(encode(msg)) == msg
    assert decode(mad[:cut]) is None or cut == MAD_SIZE


# --- a generated connection, read by tshark ---------------------------------------------

#: A Lua postdissector that shows the ports the InfiniBand dissector left in pinfo.
PORT_PROBE = """
local opcode = Field.new("infiniband.bth.opcode")
local probe = Proto("cmprobe", "pinfo ports after InfiniBand")
local src = ProtoField.uint32("cmprobe.src_port", "src_port", base.HEX)
local dst = ProtoField.uint32("cmprobe.dst_port", "dst_port", base.HEX)
probe.fields = {src, dst}
function probe.dissector(tvb, pinfo, tree)
  if opcode() then
    local t = tree:add(probe)
    t:add(src, pinfo.src_port)
    t:add(dst, pinfo.dst_port)
  end
end
register_postdissector(probe)
"""
NO_SOURCE_QP = 0xFFFFFFFF
ACKNOWLEDGE = OPCODES["RC_ACKNOWLEDGE"]


def mad_frame(src: RoceEndpoint, dst: RoceEndpoint, msg: CmMessage, psn: int) -> Ether:
    """A CM MAD as rxe sends it: UD SEND ONLY from QP1 to QP1 with the GSI Q_Key."""
    if ":" in src.ip:
        net = IPv6(src=src.ip, dst=dst.ip, hlim=64) / UDP(sport=src.udp_sport, dport=4791)
    else:
        net = (IP(src=src.ip, dst=dst.ip, flags="DF", ttl=64)
               / UDP(sport=src.udp_sport, dport=4791, chksum=0))
    return Ether(raw(Ether(src=src.mac, dst=dst.mac) / net
                     / BTH(opcode=UD_SEND_ONLY, dqpn=GSI_QPN, psn=psn, ackreq=1)
                     / DETH(qkey=GSI_QKEY, srcqp=GSI_QPN) / Raw(encode(msg))))


def connection(v6: bool) -> tuple[list[Ether], list[Ether], RoceEndpoint, RoceEndpoint]:
    """(all frames, the RC frames alone, requester, responder) of a librdmacm-style RC
    connection: REQ, REP, RTU, traffic both ways, DREQ, DREP; then a refused REQ and its
    REJ (reason 28, consumer reject, as rdma_reject sends)."""
    ips = ("fd00::a", "fd00::b") if v6 else ("192.0.2.1", "192.0.2.2")
    a = RoceEndpoint(ips[0], "02:00:00:00:00:0a", qpn=0x000111, psn=0x123456, udp_sport=50001)
    b = RoceEndpoint(ips[1], "02:00:00:00:00:0b", qpn=0x000222, psn=0xFFFFF0, udp_sport=50002)
    port, cma_port, tid = 18515, 40000, 0x0000000200000001
    req = CmMessage(CmAttr.REQ, tid, local_comm_id=0x11111111,
                    service_id=rdma_cm_service_id(port), local_qpn=a.qpn, starting_psn=a.psn,
                    responder_resources=1, initiator_depth=1, local_gid=a.ip, remote_gid=b.ip,
                    local_ca_guid=0x0200_00FF_FE00_000A,
                    flow_label=rdma_cm_flow_label(cma_port, port),
                    private_data=rdma_cm_private_data(a.ip, b.ip, cma_port) + b"KBTP")
    rc = RcConnection(a, b, mtu=1024)
    rc.send("a", b"hello from the requester")
    rc.send("b", b"hello from the responder")
    rc.write("a", b"w" * 1500, va=0x7F0000001000, rkey=0x1234)
    rc.read("b", b"r" * 40, va=0x7F0000002000, rkey=0x4321)
    frames = [
        mad_frame(a, b, req, 0),
        mad_frame(b, a, CmMessage(CmAttr.REP, tid, local_comm_id=0x22222222,
                                  remote_comm_id=0x11111111, local_qpn=b.qpn,
                                  starting_psn=b.psn, responder_resources=1, initiator_depth=1,
                                  local_ca_guid=0x0200_00FF_FE00_000B), 0),
        mad_frame(a, b, CmMessage(CmAttr.RTU, tid, local_comm_id=0x11111111,
                                  remote_comm_id=0x22222222), 1),
        *rc.frames,
        mad_frame(a, b, CmMessage(CmAttr.DREQ, tid + 1, local_comm_id=0x11111111,
                                  remote_comm_id=0x22222222, remote_qpn=b.qpn), 2),
        mad_frame(b, a, CmMessage(CmAttr.DREP, tid + 1, local_comm_id=0x22222222,
                                  remote_comm_id=0x11111111), 1),
        mad_frame(a, b, CmMessage(CmAttr.REQ, tid + 2, local_comm_id=0x33333333,
                                  service_id=rdma_cm_service_id(port + 1), local_qpn=a.qpn + 1,
                                  starting_psn=7, local_gid=a.ip, remote_gid=b.ip,
                                  private_data=rdma_cm_private_data(a.ip, b.ip, cma_port + 1)), 3),
        mad_frame(b, a, CmMessage(CmAttr.REJ, tid + 2, remote_comm_id=0x33333333,
                                  reject_reason=28), 2),
    ]
    return frames, rc.frames, a, b


def dissect_with_probe(tmp_path: Path, name: str, frames: list[Ether]) -> list[dict[str, list]]:
    """tshark's fields for ``frames`` written to a pcap, with PORT_PROBE loaded."""
    pcap, probe = tmp_path / f"{name}.pcap", tmp_path / "probe.lua"
    probe.write_text(PORT_PROBE)
    with PcapWriter(str(pcap), linktype=DLT_EN10MB) as out:
        out.write_header(None)
        for n, frame in enumerate(frames):
            out.write_packet(frame.original, sec=n * 1e-5)
    return tshark_frames(pcap, "-X", f"lua_script:{probe}")


@needs_tshark
@pytest.mark.parametrize("v6", [False, True], ids=["ipv4", "ipv6"])
def test_generated_setup_decodes_in_tshark_and_ties_the_rc_packets(tmp_path, v6):
    """(a) every CM MAD decodes as the CM message we encoded, with no malformed or expert
    item; (b) after REQ/REP, tshark's InfiniBand dissector sets pinfo.src_port of RC
    packets that reach payload dissection to the sending QP (it is 0xffffffff without the
    set-up, and stays so for ACKs, which tshark does not hand to payload dissection)."""
    frames, rc_frames, a, b = connection(v6)
    with_cm = dissect_with_probe(tmp_path, "with_cm", frames)
    without_cm = dissect_with_probe(tmp_path, "rc_only", rc_frames)

    mads = {n: bth_parts(f)[1] for n, f in enumerate(frames, 1)
            if f[BTH].opcode == UD_SEND_ONLY}
    assert [decode(m).attr for m in mads.values()] == [
        CmAttr.REQ, CmAttr.REP, CmAttr.RTU, CmAttr.DREQ, CmAttr.DREP, CmAttr.REQ, CmAttr.REJ]
    assert_cm_matches_tshark(with_cm, mads)
    assert not any(k.startswith(("_ws.malformed", "_ws.expert")) for f in with_cm for k in f)

    qpn = {a.ip: a.qpn, b.ip: b.qpn}
    rc_in_capture = [with_cm[n - 1] for n in range(4, 4 + len(rc_frames))]
    opcodes = set()
    for tied, alone, frame in zip(rc_in_capture, without_cm, rc_frames):
        opcode = frame[BTH].opcode
        opcodes.add(opcode)
        sender = frame[IPv6].src if v6 else frame[IP].src
        assert tied["cmprobe.dst_port"] == alone["cmprobe.dst_port"] == [f"0x{frame[BTH].dqpn:08x}"]
        assert alone["cmprobe.src_port"] == [f"0x{NO_SOURCE_QP:08x}"]
        want = NO_SOURCE_QP if opcode == ACKNOWLEDGE else qpn[sender]
        assert tied["cmprobe.src_port"] == [f"0x{want:08x}"], (frame.summary(), tied)
    assert {OPCODES[f"RC_{op}"] for op in ("SEND_ONLY", "ACKNOWLEDGE", "RDMA_WRITE_FIRST",
                                           "RDMA_WRITE_LAST", "RDMA_READ_REQUEST",
                                           "RDMA_READ_RESPONSE_ONLY")} <= opcodes


@needs_tshark
@pytest.mark.parametrize("index, changes", [(0, {"remote_gid": "192.0.2.99"}),
                                            (1, {"transaction_id": 5})],
                         ids=["req_remote_gid_is_not_the_responder", "rep_tid_is_not_the_req_tid"])
def test_tshark_ties_nothing_without_responder_gid_in_req_and_req_tid_in_rep(tmp_path, index,
                                                                             changes):
    """tshark finds the responder's side of the connection under the REQ's primary remote
    GID and matches the REP to the REQ by transaction ID (and the REQ's source address)."""
    frames, _, a, b = connection(False)
    sender, receiver = (a, b) if index == 0 else (b, a)
    msg = dataclasses.replace(decode(bth_parts(frames[index])[1]), **changes)
    frames[index] = mad_frame(sender, receiver, msg, 0)
    first_send = dissect_with_probe(tmp_path, "broken", frames)[3]   # a -> b SEND ONLY
    assert first_send["infiniband.bth.opcode"] == [str(OPCODES["RC_SEND_ONLY"])]
    assert first_send["cmprobe.src_port"] == [f"0x{NO_SOURCE_QP:08x}"]
