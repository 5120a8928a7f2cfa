"""Scapy layers for MPA, DDP and RDMAP against byte layouts worked out from the RFCs."""
from __future__ import annotations

import struct

import google_crc32c
import pytest
from hypothesis import given, settings, strategies as st
from scapy.packet import Raw

from kbtp_scapy.layers.iwarp import (
    DDP,
    MPA,
    MPA_REP_KEY,
    MPA_REQ_KEY,
    RDMAP_OPCODES,
    MPAEnhanced,
    MPAReply,
    MPARequest,
    Op,
    RDMAPAtomicRequest,
    RDMAPAtomicResponse,
    RDMAPImmediate,
    RDMAPReadRequest,
    RDMAPTerminate,
    crc32c,
)

KBTP_VECTOR = bytes.fromhex(
    "01120001000000000000000700000000000040010000000000000000000000000000000000000008"
) + b"KVBLOCK!"


def fpdu_bytes(ulpdu: bytes) -> bytes:
    """An FPDU by RFC 5044 s4 by hand: length, ULPDU, zero pad to 4, CRC32c LSB first."""
    body = struct.pack("!H", len(ulpdu)) + ulpdu + b"\0" * (-(2 + len(ulpdu)) % 4)
    return body + google_crc32c.value(body).to_bytes(4, "little")


def untagged(ctrl_rdmap: int, qn: int, msn: int, mo: int, inv: int = 0, last: bool = True) -> bytes:
    """DDP untagged header (RFC 5041 s4.3): T=0, L, DV=1, RsvdULP = RDMAP ctrl + 32 bits."""
    return bytes([0x41 if last else 0x01, ctrl_rdmap]) + struct.pack("!IIII", inv, qn, msn, mo)


def tagged(ctrl_rdmap: int, stag: int, to: int, last: bool = True) -> bytes:
    """DDP tagged header (RFC 5041 s4.2): T=1, L, DV=1, RDMAP ctrl, STag, TO."""
    return bytes([0xC1 if last else 0x81, ctrl_rdmap]) + struct.pack("!IQ", stag, to)


# --- CRC32c ----------------------------------------------------------------------------

@pytest.mark.parametrize("data, value", [
    (b"123456789", 0xE3069283),                      # the CRC-32C check value
    (bytes(32), 0x8A9136AA),                         # RFC 3720 B.4 test vectors
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
    (bytes.fromhex("01c00000 00000000 00000000 00000000 14000000 00000400"      # SCSI Read
                   "00000014 00000018 28000000 00000000 02000000 00000000"), 0xD9963A56),
])
def test_crc32c_check_values(data, value):
    assert crc32c(data) == value


# --- MPA FPDU --------------------------------------------------------------------------

def test_send_fpdu_layout():
    ulpdu = untagged(0x43, qn=0, msn=1, mo=0) + b"abc"
    pkt = MPA() / DDP(opcode=Op.SEND, msn=1) / b"abc"
    assert bytes(pkt) == fpdu_bytes(ulpdu)
    assert bytes(pkt)[-4:] == crc32c(bytes(pkt)[:-4]).to_bytes(4, "little")
    dis = MPA(bytes(pkt))
    assert dis.ulpdu_len == 21 and dis.pad == b"\0" and dis.crc_ok()
    assert dis[DDP].qn == 0 and dis[Raw].load == b"abc"


def test_write_fpdu_layout_and_no_pad():
    ulpdu = tagged(0x40, stag=0x1234, to=0xAABBCCDD00) + b"0123456789AB"
    pkt = MPA() / DDP(opcode="RDMA Write", stag=0x1234, to=0xAABBCCDD00) / b"0123456789AB"
    assert bytes(pkt) == fpdu_bytes(ulpdu)
    assert MPA(bytes(pkt)).pad == b""


def test_fuzzer_values_are_kept():
    pkt = MPA(ulpdu_len=999, crc=0x01020304, pad=b"\xee") / DDP() / b"xy"
    wire = bytes(pkt)
    assert wire[:2] == struct.pack("!H", 999)
    assert wire[-5:] == b"\xee\x04\x03\x02\x01"
    assert not MPA(bytes(MPA(crc=5) / DDP())).crc_ok()


def test_crc_check_detects_a_flipped_bit():
    wire = bytearray(bytes(MPA() / DDP(opcode=Op.SEND_SE) / b"payload"))
    assert MPA(bytes(wire)).crc_ok()
    wire[10] ^= 0x10
    assert not MPA(bytes(wire)).crc_ok()


def test_several_fpdus_leave_the_rest_as_padding():
    one, two = fpdu_bytes(untagged(0x43, 0, 1, 0) + b"a"), fpdu_bytes(untagged(0x43, 0, 2, 0))
    pkt = MPA(one + two)
    assert pkt[DDP].msn == 1 and pkt.load == b"a"
    assert bytes(pkt) == one + two


# --- MPA startup frames ----------------------------------------------------------------

def test_mpa_request_rev2_enhanced_layout():
    pkt = MPARequest(flags="C+S") / MPAEnhanced(p2p=1, ird=5, rtr_write=1, ord=7) / b"hi"
    # key, M C R S = 0101, Res 0, Rev 2, PD_Length 6, then A B IRD(14) C D ORD(14)
    assert bytes(pkt) == MPA_REQ_KEY + bytes([0x50, 2, 0, 6, 0x80, 5, 0x80, 7]) + b"hi"
    dis = MPA(bytes(pkt))
    assert isinstance(dis, MPARequest)
    assert (dis.ird, dis.ord, dis.p2p) == (5, 7, 1)
    assert (dis.rtr_write, dis.rtr_read, dis.rtr_send) == (1, 0, 0)
    assert dis[Raw].load == b"hi"


def test_mpa_reply_rev1_reject_keeps_private_data_raw():
    wire = MPA_REP_KEY + bytes([0xE0, 1, 0, 3]) + b"no!"
    dis = MPA(wire)
    assert isinstance(dis, MPAReply)
    assert dis.flags.M and dis.flags.C and dis.flags.R and not dis.flags.S
    assert dis.rev == 1 and dis[Raw].load == b"no!" and MPAEnhanced not in dis
    assert bytes(dis) == wire
    assert bytes(MPAReply(flags="M+C+R", rev=1) / b"no!") == wire


# --- DDP and RDMAP ---------------------------------------------------------------------

@pytest.mark.parametrize("op", list(Op))
def test_every_opcode_is_named_and_queued(op):
    pkt = DDP(bytes(DDP(opcode=op)))
    assert RDMAP_OPCODES[op] in pkt.show(dump=True)
    assert pkt.tagged == (op in (Op.WRITE, Op.READ_RESPONSE))
    if not pkt.tagged:
        assert pkt.qn == {Op.READ_REQUEST: 1, Op.ATOMIC_REQUEST: 1, Op.TERMINATE: 2,
                          Op.ATOMIC_RESPONSE: 3}.get(op, 0)


def test_read_request_layout():
    body = struct.pack("!IQIIQ", 0x11, 0x2222, 4096, 0x33, 0x4444)
    wire = fpdu_bytes(untagged(0x41, qn=1, msn=7, mo=0) + body)
    pkt = MPA() / DDP(opcode=Op.READ_REQUEST, msn=7) / RDMAPReadRequest(
        sink_stag=0x11, sink_to=0x2222, read_size=4096, src_stag=0x33, src_to=0x4444)
    assert bytes(pkt) == wire
    rr = MPA(wire)[RDMAPReadRequest]
    assert (rr.sink_stag, rr.sink_to, rr.read_size, rr.src_stag, rr.src_to) == \
        (0x11, 0x2222, 4096, 0x33, 0x4444)


def test_send_with_invalidate_carries_the_stag():
    wire = fpdu_bytes(untagged(0x46, qn=0, msn=3, mo=0, inv=0xCAFE0001) + b"done")
    pkt = MPA(wire)
    assert pkt[DDP].opcode == Op.SEND_SE_INV and pkt[DDP].inv_stag == 0xCAFE0001
    assert bytes(MPA() / DDP(opcode=Op.SEND_SE_INV, msn=3, inv_stag=0xCAFE0001) / b"done") == wire


def test_terminate_with_copied_headers():
    copied_ddp = untagged(0x43, qn=0, msn=9, mo=0)
    copied_rdmap = struct.pack("!IQIIQ", 1, 2, 3, 4, 5)
    # Layer DDP (1), EType Untagged Buffer Error (2), Error Code Invalid MSN (2), M D R
    body = bytes([0x12, 0x02, 0xE0, 0x00]) + struct.pack("!H", 40) + copied_ddp + copied_rdmap
    wire = fpdu_bytes(untagged(0x47, qn=2, msn=1, mo=0) + body)
    term = MPA(wire)[RDMAPTerminate]
    assert (term.layer, term.etype, term.errcode) == (1, 2, 2)
    assert (term.hdrct_m, term.hdrct_d, term.hdrct_r, term.ddp_seg_len) == (1, 1, 1, 40)
    assert term.ddp_hdr.msn == 9 and term.rdmap_hdr.src_to == 5
    text = term.show(dump=True)
    for name in ("DDP", "Untagged Buffer Error", "Invalid MSN - no buffer available"):
        assert name in text
    built = MPA() / DDP(opcode="Terminate") / RDMAPTerminate(
        layer=1, etype=2, errcode=2, hdrct_m=1, hdrct_d=1, hdrct_r=1, ddp_seg_len=40,
        ddp_hdr=DDP(opcode=Op.SEND, msn=9), rdmap_hdr=RDMAPReadRequest(
            sink_stag=1, sink_to=2, read_size=3, src_stag=4, src_to=5))
    assert bytes(built) == wire


def test_terminate_tagged_copy_is_14_octets_and_names_follow_layer():
    copied = tagged(0x40, stag=0xBAD, to=0)
    wire = bytes([0x11, 0x00, 0x40, 0x00]) + struct.pack("!H", 14) + copied
    term = RDMAPTerminate(wire)
    assert term.ddp_hdr.stag == 0xBAD and "Tagged Buffer Error" in term.show(dump=True)
    assert "Invalid STag" in term.show(dump=True)
    mpa_err = RDMAPTerminate(bytes([0x20, 0x02, 0, 0]))
    assert "MPA CRC Error" in mpa_err.show(dump=True)
    assert "No Matching RTR Option" in RDMAPTerminate(bytes([0x20, 0x07, 0, 0])).show(dump=True)


def test_masked_fetchadd_layout():
    # RFC 7306 Atomic Request: Reserved(28) AOpCode(4), Request Identifier, Remote STag,
    # Remote TO, Add Data, Add Mask, Compare Data, Compare Mask.  The ring counter of
    # the KBTP notes (n = 4): add 0x0000000100000010, mask bit 63 | bit 31 | bit 7.
    body = bytes.fromhex(
        "00000000" "0000002a" "00000100" "0000000000002000"
        "0000000100000010" "8000000080000080" "0000000000000000" "0000000000000000")
    wire = fpdu_bytes(untagged(0x4A, qn=1, msn=2, mo=0) + body)
    pkt = MPA() / DDP(opcode=Op.ATOMIC_REQUEST, msn=2) / RDMAPAtomicRequest(
        aopcode="FetchAdd", req_id=42, remote_stag=0x100, remote_to=0x2000,
        data=0x0000000100000010, mask=(1 << 63) | (1 << 31) | (1 << 7))
    assert bytes(pkt) == wire
    req = MPA(wire)[RDMAPAtomicRequest]
    assert req.aopcode == 0 and req.mask == 0x8000000080000080
    assert "FetchAdd" in req.show(dump=True)
    swap = RDMAPAtomicRequest(bytes.fromhex("00000002") + bytes(48))
    assert "CmpSwap" in swap.show(dump=True)


def test_swap_layout():
    # RFC 7306 Swap (AOpCode 0001b): Swap Data and Swap Mask in the Add/Swap fields,
    # compare fields present but unused; tshark 4.0 decodes these fields 16 octets early.
    body = bytes.fromhex(
        "00000001" "00000005" "0000abcd" "0000000000000040"
        "1111111111111111" "ffffffff00000000" "0000000000000000" "0000000000000000")
    pkt = MPA(fpdu_bytes(untagged(0x4A, qn=1, msn=1, mo=0) + body))[RDMAPAtomicRequest]
    assert (pkt.aopcode, pkt.req_id, pkt.remote_stag, pkt.remote_to) == (1, 5, 0xABCD, 0x40)
    assert (pkt.data, pkt.mask) == (0x1111111111111111, 0xFFFFFFFF00000000)
    assert "Swap" in pkt.show(dump=True)
    assert bytes(RDMAPAtomicRequest(aopcode="Swap", req_id=5, remote_stag=0xABCD, remote_to=0x40,
                                    data=0x1111111111111111, mask=0xFFFFFFFF00000000)) == body


def test_atomic_response_and_immediate_layouts():
    body = bytes.fromhex("0000002a" "0000000500000070")
    resp = fpdu_bytes(untagged(0x4B, qn=3, msn=1, mo=0) + body)
    pkt = MPA(resp)[RDMAPAtomicResponse]
    assert (pkt.orig_req_id, pkt.orig_data) == (42, 0x0000000500000070)
    assert bytes(MPA() / DDP(opcode=Op.ATOMIC_RESPONSE) / RDMAPAtomicResponse(
        orig_req_id=42, orig_data=0x500000070)) == resp
    imm = fpdu_bytes(untagged(0x49, qn=0, msn=4, mo=0) + bytes.fromhex("0102030405060708"))
    assert MPA(imm)[RDMAPImmediate].imm == 0x0102030405060708
    assert MPA(imm)[DDP].opcode == Op.IMMEDIATE_SE


def test_later_segments_and_tagged_data_stay_raw():
    body = struct.pack("!IQIIQ", 1, 2, 3, 4, 5)
    later = MPA(fpdu_bytes(untagged(0x41, qn=1, msn=1, mo=28) + body))
    assert RDMAPReadRequest not in later and later.load == body
    write = MPA(fpdu_bytes(tagged(0x40, 1, 0) + body))
    assert RDMAPReadRequest not in write and write.load == body


# --- Robustness and round trips --------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_garbage_never_raises_and_rebuilds(data):
    for cls in (MPA, MPARequest, DDP, RDMAPTerminate, RDMAPAtomicRequest, RDMAPReadRequest):
        pkt = cls(data)
        pkt.show(dump=True)
        if data:
            assert bytes(pkt) == data


@settings(max_examples=150, deadline=None)
@given(st.binary(min_size=1, max_size=64), st.integers(0, 200))
def test_truncated_fpdus_never_raise(payload, cut):
    wire = bytes(MPA() / DDP(opcode=Op.SEND) / payload)
    part = wire[:max(1, len(wire) - cut)]
    pkt = MPA(part)
    assert bytes(pkt) == part
    assert pkt.crc_ok() == (part == wire)


@settings(max_examples=200, deadline=None)
@given(op=st.sampled_from(list(Op)), last=st.booleans(), stag=st.integers(0, 2**32 - 1),
       to=st.integers(0, 2**64 - 1), msn=st.integers(0, 2**32 - 1),
       mo=st.integers(0, 2**32 - 1), payload=st.binary(max_size=80))
def test_fpdu_round_trip(op, last, stag, to, msn, mo, payload):
    hdr = DDP(opcode=op, last=int(last), stag=stag, to=to, msn=msn, mo=mo, inv_stag=stag)
    wire = bytes(MPA() / hdr / payload)
    assert len(wire) % 4 == 0
    dis = MPA(wire)
    assert dis.crc_ok() and bytes(dis) == wire
    ddp = dis[DDP]
    assert (ddp.opcode, ddp.last) == (op, int(last))
    if op in (Op.WRITE, Op.READ_RESPONSE):
        assert (ddp.stag, ddp.to) == (stag, to)
    else:
        assert (ddp.msn, ddp.mo, ddp.inv_stag) == (msn, mo, stag)


def test_send_with_kbtp_payload_dissects_as_kbtp():
    kbtp = pytest.importorskip("kbtp_scapy.layers.kbtp")
    first = MPA(bytes(MPA() / DDP(opcode=Op.SEND, msn=1) / KBTP_VECTOR))
    assert kbtp.KBTP in first
    later = MPA(bytes(MPA() / DDP(opcode=Op.SEND, msn=1, mo=1436) / KBTP_VECTOR))
    assert kbtp.KBTP not in later and later.load == KBTP_VECTOR
    other = MPA(bytes(MPA() / DDP(opcode=Op.SEND_INV, msn=2) / b"not kbtp at all"))
    assert kbtp.KBTP not in other
