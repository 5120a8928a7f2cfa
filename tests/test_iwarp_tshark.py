"""The iWARP layers and the conversation builder against real tshark 4.0.

One capture holds three connections (IPv4, IPv6, and IPv4 with markers both ways) with
every RDMAP message in both directions, several FPDUs in one TCP segment and FPDUs split
across segments.  tshark reads it twice (JSON fields, and -V text for the CRC verdict,
which exists only as label text); every frame's MPA/DDP/RDMAP values must equal those of
the Scapy layers.  RFC 7306 fields tshark 4.0 misdecodes (Swap, Immediate Data) are
checked against the RFC layout in test_iwarp_layers.py instead.
"""
from __future__ import annotations

import re
from collections import defaultdict

import google_crc32c
import pytest
from scapy.layers.inet import TCP
from scapy.packet import Raw
from scapy.utils import wrpcap

from kbtp_scapy.builders.iwarp import (
    IwarpConversation,
    iter_rdma_messages,
    segment_message,
)
from kbtp_scapy.layers.iwarp import (
    DDP,
    MPA,
    MPA_REQ_KEY,
    RDMAP_OPCODES,
    Op,
    RDMAPAtomicRequest,
    RDMAPAtomicResponse,
    RDMAPImmediate,
    RDMAPReadRequest,
    RDMAPTerminate,
)
from kbtp_scapy.wire.mpa_markers import strip_markers
from tests.tshark import needs_tshark, tshark_frames, tshark_text

pytestmark = needs_tshark

# MPA is found heuristically; rpcordma's heuristic claims arbitrary Send payloads and
# then reports them malformed, so it is switched off (it is not what is tested here).
OPTS = ("-o", "tcp.try_heuristic_first:TRUE", "--disable-protocol", "rpcordma")
KBTP_VECTOR = bytes.fromhex(
    "01120001000000000000000700000000000040010000000000000000000000000000000000000008"
) + b"KVBLOCK!"
PI_ERROR = "8388608"


def _hex(data: bytes) -> str:
    return ":".join(f"{b:02x}" for b in data)


def _traffic(conv: IwarpConversation, split: bool) -> None:
    """Every RDMAP message both ways; with ``split``, packed and split FPDUs too."""
    conv.send_message("Send", KBTP_VECTOR)
    conv.send_message("RDMA Write", bytes(range(256)) * 9, from_initiator=False,
                      stag=0x1234ABCD, to=0x7F0000001000)
    conv.send_message("RDMA Read Request", RDMAPReadRequest(
        sink_stag=0x11, sink_to=0x2000, read_size=3000, src_stag=0x22, src_to=0x3000))
    conv.send_message("RDMA Read Response", b"R" * 3000, from_initiator=False,
                      stag=0x11, to=0x2000)
    conv.send_message("Send with Solicited Event", b"\x05" * 33, from_initiator=False)
    conv.send_message("Send with Invalidate", b"\x06" * 7, inv_stag=0xABCDEF01)
    conv.send_message("Send with Solicited Event and Invalidate", b"\x07" * 2,
                      from_initiator=False, inv_stag=0x42)
    conv.send_message("Atomic Request", RDMAPAtomicRequest(
        aopcode="FetchAdd", req_id=0x2A, remote_stag=0x100, remote_to=0x8000,
        data=0x0000000100000010, mask=(1 << 63) | (1 << 31) | (1 << 7)))
    conv.send_message("Atomic Response", RDMAPAtomicResponse(
        orig_req_id=0x2A, orig_data=0x0000000300000030), from_initiator=False)
    conv.send_message("Atomic Request", RDMAPAtomicRequest(
        aopcode="CmpSwap", req_id=0x2B, remote_stag=0x100, remote_to=0x8008,
        data=0x55, mask=0xFF, compare_data=0x44, compare_mask=0xFF))
    conv.send_message("Immediate Data", RDMAPImmediate(imm=0x0102030405060708))
    conv.send_message("Terminate", RDMAPTerminate(
        layer=1, etype=2, errcode=2, hdrct_m=1, hdrct_d=1, ddp_seg_len=22,
        ddp_hdr=DDP(opcode=Op.SEND, msn=9)), from_initiator=False)
    conv.send_message("Terminate", RDMAPTerminate(
        layer=0, etype=1, errcode=0, hdrct_d=1, hdrct_r=1, ddp_seg_len=46,
        ddp_hdr=DDP(opcode=Op.READ_REQUEST, msn=2),
        rdmap_hdr=RDMAPReadRequest(sink_stag=1, read_size=2, src_stag=3)))
    conv.send_message("Terminate", RDMAPTerminate(layer=2, etype=0, errcode=2),
                      from_initiator=False)
    if split:
        packed = [f for m in range(3) for f in segment_message("Send", bytes([m]) * (5 + m),
                                                               msn=10 + m)]
        conv.send_fpdus(packed, per_segment=3)
        big = segment_message("Send", b"S" * 2500, msn=13)
        tail = segment_message("Send", b"t", msn=14)
        conv.send_fpdus(big + tail, split_at=[8, 700, 1470, 2000])
        conv.send_message("RDMA Write", b"W" * 4000, stag=7, split_at=[1000, 1460, 3000])
        conv.send_fpdus([MPA(crc=0x12345678) / DDP(opcode=Op.SEND, msn=15) / b"bad crc"])


def _capture(tmp_path):
    v4 = IwarpConversation(("192.0.2.1", 40001), ("192.0.2.2", 7471), start=1.0e9)
    _traffic(v4, split=True)
    v4.close()
    v6 = IwarpConversation(("2001:db8::1", 40002), ("2001:db8::2", 7471), start=1.0e9 + 10)
    _traffic(v6, split=True)
    v6.close()
    mk = IwarpConversation(("192.0.2.3", 40003), ("192.0.2.4", 7471), markers=True,
                           start=1.0e9 + 20)
    _traffic(mk, split=False)
    for n in range(1, 5):
        mk.send_message("Send", bytes(range(256)) * n, from_initiator=n % 2 == 0)
    mk.close()
    packets = v4.packets + v6.packets + mk.packets
    path = tmp_path / "iwarp.pcap"
    wrpcap(str(path), packets)
    return path, packets


def _expected(packets):
    """Per frame: the MPA startup frame, or the FPDUs that end in it, with their stream
    positions when markers are on (tshark shows an FPDU in the frame that completes it).
    Found by reading each direction's byte stream, apart from the decoder under test."""
    streams = defaultdict(bytes)
    startup, markers, done = {}, {}, defaultdict(int)
    out = {}
    for n, pkt in enumerate(packets, 1):
        if Raw not in pkt:
            continue
        net, tcp = pkt[1], pkt[TCP]
        key, back = ((net.src, tcp.sport), (net.dst, tcp.dport)), \
            ((net.dst, tcp.dport), (net.src, tcp.sport))
        load = pkt[Raw].load
        if key not in startup:
            startup[key] = MPA(load)
            out[n] = startup[key]
            continue
        # the M flag in the frame a side received asks it to send markers
        markers[key] = bool(startup[back].flags.M)
        streams[key] += load
        wire = streams[key]
        clean, found = strip_markers(wire) if markers[key] else (wire, [])
        fpdus = out.setdefault(n, [])
        c = done[key]
        while c + 2 <= len(clean):
            ulen = int.from_bytes(clean[c:c + 2], "big")
            total = 2 + ulen + (-(2 + ulen) % 4) + 4
            if c + total > len(clean):
                break
            before = sum(1 for p, _ in found if p < c)
            inside = sum(1 for p, _ in found if c <= p < c + total)
            w0 = c + 4 * before
            w1 = w0 + total + 4 * inside
            fpdus.append((MPA(clean[c:c + total]), (w0, w1) if markers[key] else None,
                          wire[w0:w1]))
            c += total
        done[key] = c
    return out


def _startup_fields(pkt) -> dict[str, list[str]]:
    key = "iwarp_mpa.key.req" if pkt.key == MPA_REQ_KEY else "iwarp_mpa.key.rep"
    flags = pkt.flags
    return {key: [_hex(pkt.key)], "iwarp_mpa.marker_flag": [str(int(flags.M))],
            "iwarp_mpa.crc_flag": [str(int(flags.C))], "iwarp_mpa.rej_flag": [str(int(flags.R))],
            "iwarp_mpa.res": [f"0x{int(flags.S) << 4 | pkt.res:02x}"],
            "iwarp_mpa.rev": [str(pkt.rev)], "iwarp_mpa.pdlength": [str(pkt.pd_length)],
            "iwarp_mpa.privatedata": [_hex(bytes(pkt.payload))]}


def _terminate_fields(t: RDMAPTerminate, add) -> None:
    """tshark names the Error Code field after the layer and EType it decoded."""
    add("iwarp_rdma.term_layer", f"0x{t.layer:02x}")
    etype = {0: "term_etype_rdma", 1: "term_etype_ddp", 2: "term_etype_llp"}[t.layer]
    add(f"iwarp_rdma.{etype}", f"0x{t.etype:02x}")
    if t.layer == 0:
        code = "term_errcode_rdma" if t.etype else "term_errcode"
    elif t.layer == 1:
        code = {1: "term_errcode_ddp_tagged", 2: "term_errcode_ddp_untagged"}.get(
            t.etype, "term_errcode")
    else:
        code = "term_errcode" if t.etype else "term_errcode_llp"
    add(f"iwarp_rdma.{code}", f"0x{t.errcode:02x}")
    add("iwarp_rdma.term_hdrct_m", str(t.hdrct_m))
    add("iwarp_rdma.hdrct_d", str(t.hdrct_d))
    add("iwarp_rdma.hdrct_r", str(t.hdrct_r))
    # tshark 4.0 sizes the copied DDP header by EType (1: 14 octets, else 18) whatever
    # the layer, not by the copied header's own T flag (RFC 5040 s4): an RDMAP Remote
    # Protection Error about an untagged Read Request is cut 4 octets short.
    copied = bytes(t)[6:]
    size = 14 if t.etype == 1 else 18
    if t.hdrct_d:
        add("iwarp_rdma.term_ddp_seg_len", _hex(t.ddp_seg_len.to_bytes(2, "big")))
        add("iwarp_rdma.term_ddp_h", _hex(copied[:size]))
    if t.hdrct_r:
        add("iwarp_rdma.term_rdma_h", _hex(copied[size if t.hdrct_d else 0:][:28]))


def _fpdu_fields(fpdus) -> dict[str, list[str]]:
    exp: dict[str, list[str]] = defaultdict(list)

    def add(name, value):
        exp[name].append(value)

    for fpdu, span, _ in fpdus:
        add("iwarp_mpa.ulpdulength", str(fpdu.ulpdu_len))
        if fpdu.pad:
            add("iwarp_mpa.pad", _hex(fpdu.pad))
        if span:                                   # markers every 512 octets of the stream
            for pos in range(-(-span[0] // 512) * 512, span[1], 512):
                add("iwarp_mpa.marker_fpduptr", str(pos - span[0]))
        d = fpdu[DDP]
        add("iwarp_ddp.tagged_flag", str(d.tagged))
        add("iwarp_ddp.last_flag", str(d.last))
        add("iwarp_ddp.dv", str(d.dv))
        add("iwarp_rdma.version", str(d.rv))
        add("iwarp_rdma.opcode", f"0x{d.opcode:02x}")
        if d.tagged:
            add("iwarp_ddp.stag", f"0x{d.stag:08x}")
            add("iwarp_ddp.tagged_offset", f"0x{d.to:016x}")
            continue
        add("iwarp_ddp.qn", str(d.qn))
        add("iwarp_ddp.msn", str(d.msn))
        add("iwarp_ddp.mo", str(d.mo))
        add("iwarp_ddp.rsvdulp", _hex(bytes(d)[1:6]))
        if d.opcode in (Op.SEND_INV, Op.SEND_SE_INV):
            add("iwarp_rdma.inval_stag", str(d.inv_stag))
        if RDMAPReadRequest in d and d.opcode == Op.READ_REQUEST:
            rr = d[RDMAPReadRequest]
            add("iwarp_rdma.sinkstag", f"0x{rr.sink_stag:08x}")
            add("iwarp_rdma.sinkto", f"0x{rr.sink_to:016x}")
            add("iwarp_rdma.rdmardsz", str(rr.read_size))
            add("iwarp_rdma.srcstag", f"0x{rr.src_stag:08x}")
            add("iwarp_rdma.srcto", f"0x{rr.src_to:016x}")
        if RDMAPTerminate in d:
            _terminate_fields(d[RDMAPTerminate], add)
        if RDMAPAtomicRequest in d:
            a = d[RDMAPAtomicRequest]
            add("iwarp_rdma.atomic.opcode", str(a.aopcode))
            add("iwarp_rdma.atomic.request_identifier", str(a.req_id))
            add("iwarp_rdma.atomic.remote_stag", str(a.remote_stag))
            add("iwarp_rdma.atomic.remote_tagged_offset", str(a.remote_to))
            kind = "add" if a.aopcode == 0 else "swap"
            add(f"iwarp_rdma.atomic.{kind}_data", str(a.data))
            add(f"iwarp_rdma.atomic.{kind}_mask", f"0x{a.mask:016x}")
            add("iwarp_rdma.atomic.compare_data", str(a.compare_data))
            add("iwarp_rdma.atomic.compare_mask", f"0x{a.compare_mask:016x}")
        if RDMAPAtomicResponse in d:
            r = d[RDMAPAtomicResponse]
            add("iwarp_rdma.atomic.original_request_identifier", str(r.orig_req_id))
            add("iwarp_rdma.atomic.original_remote_data_value", str(r.orig_data))
    return exp


def _wire_crc_ok(wire: bytes) -> bool:
    return google_crc32c.value(wire[:-4]).to_bytes(4, "little") == wire[-4:]


def _crc_labels(text: str) -> dict[int, list[str]]:
    """Frame number -> the CRC verdicts of its FPDUs, from tshark -V."""
    verdicts: dict[int, list[str]] = defaultdict(list)
    frame = 0
    for line in text.splitlines():
        head = re.match(r"Frame (\d+):", line)
        if head:
            frame = int(head.group(1))
        crc = re.search(r"CRC check: 0x[0-9a-f]{8} \((Good|Bad) CRC32", line)
        if crc:
            verdicts[frame].append(crc.group(1))
    return verdicts


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    path, packets = _capture(tmp_path_factory.mktemp("iwarp"))
    frames = tshark_frames(path, *OPTS, "--no-duplicate-keys")
    verdicts = _crc_labels(tshark_text(path, *OPTS, "-V"))
    expert = tshark_text(path, *OPTS, "-q", "-z", "expert")
    return packets, frames, verdicts, expert


@pytest.mark.slow
def test_capture_has_what_the_tests_need(capture):
    packets, _, _, _ = capture
    expected = _expected(packets)
    fpdus = [f for v in expected.values() if isinstance(v, list) for f in v]
    assert len(fpdus) == 2 * 27 + 21
    assert any(len(v) >= 3 for v in expected.values() if isinstance(v, list))
    raw_lens = [len(p[Raw].load) for p in packets if Raw in p]
    assert 8 in raw_lens                       # an FPDU cut in its DDP header


def test_every_frame_matches_the_scapy_layers(capture):
    packets, frames, _, _ = capture
    assert len(frames) == len(packets)
    for n, want in _expected(packets).items():
        got = frames[n - 1]
        exp = _startup_fields(want) if not isinstance(want, list) else _fpdu_fields(want)
        for name, values in exp.items():
            assert got.get(name) == values, (n, name)


def test_crc_verdicts_agree_with_scapy(capture):
    packets, _, verdicts, _ = capture
    for n, want in _expected(packets).items():
        if isinstance(want, list):
            # with markers the CRC covers those inside the FPDU (RFC 5044)
            mine = ["Good" if (_wire_crc_ok(wire) if span else f.crc_ok()) else "Bad"
                    for f, span, wire in want]
            assert verdicts.get(n, []) == mine, n
    assert sum(v.count("Bad") for v in verdicts.values()) == 2        # the fuzzed FPDUs


def test_no_malformed_frames_or_expert_errors(capture):
    _, frames, _, expert = capture
    for n, got in enumerate(frames, 1):
        assert "_ws.malformed" not in got, n
        assert PI_ERROR not in got.get("_ws.expert.severity", []), n
    assert "Errors (" not in expert and "Warns (" in expert     # Rev 2 and the S flag


def test_both_directions_and_both_ip_versions_decoded(capture):
    packets, frames, _, _ = capture
    ends = {(got.get("ip.src", got.get("ipv6.src")) or [None])[0]
            for got in frames if "iwarp_ddp.last_flag" in got}
    assert {"192.0.2.1", "192.0.2.2", "2001:db8::1", "2001:db8::2",
            "192.0.2.3", "192.0.2.4"} <= ends
    marked = {got["ip.src"][0] for got in frames if "iwarp_mpa.marker_fpduptr" in got}
    assert marked == {"192.0.2.3", "192.0.2.4"}


def test_decoder_agrees_with_tshark(capture):
    """iter_rdma_messages and tshark see the same RDMA segments in the same frames."""
    packets, frames, _, _ = capture
    msgs = list(iter_rdma_messages(packets))
    assert len(msgs) == 2 * 21 + 18               # v4, v6, the marker conversation
    opcodes = {name: op for op, name in RDMAP_OPCODES.items()}
    for msg in msgs:
        last = frames[msg.frames[-1] - 1]
        assert f"0x{opcodes[msg.info['opcode']]:02x}" in last["iwarp_rdma.opcode"]
        assert msg.info["crc_ok"] is (msg.payload != b"bad crc")
    carried = {n for msg in msgs for n in msg.frames}
    assert {n for n, got in enumerate(frames, 1) if "iwarp_ddp.last_flag" in got} <= carried
