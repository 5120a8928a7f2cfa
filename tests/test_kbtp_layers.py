"""Behaviour of the KBTP Scapy layers a user relies on: naming, auto-fill versus
explicit lies, ADDR_LE switches, request/response matching, and bad input."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st
from scapy.config import conf
from scapy.packet import Raw, fuzz

from kbtp_scapy import codec, tables as T
from kbtp_scapy.layers.kbtp import (
    BODY_CLASSES,
    KBTP,
    KBTPCompletion,
    KBTPCompletionDescriptor,
    KBTPDataDescriptor,
    KBTPHelloAck,
    KBTPLoad,
    KBTPStore,
    KBTPTableEntry,
    looks_like_kbtp,
)
from kbtp_scapy.vocab import RequestFlag


def test_show_names_flags_enumerations_and_private_use():
    text = (KBTP(opcode="LOAD", flags="RECORD+ALLOW_UNSEALED") / KBTPLoad()).show(dump=True)
    assert "LOAD" in text and "RECORD+ALLOW_UNSEALED" in text
    assert "RELEASE" in KBTP(opcode="GOODBYE", flags="RELEASE").show(dump=True)
    assert "NOT_SEALED" in KBTP(opcode="COMPLETION", status=7).show(dump=True)
    assert "Private Use (0xc000)" in KBTP(opcode="COMPLETION", status=0xC000).show(dump=True)
    assert "Private Use (0xc5)" in KBTP(opcode=0xC5).show(dump=True)
    assert "Unknown (0x50)" in KBTP(opcode=0x50).show(dump=True)
    assert "VALID+SEALED" in KBTPTableEntry(flags=3).show(dump=True)
    assert "DIRECT_LOAD" in KBTPHelloAck(features=1).show(dump=True)


def test_flags_and_length_filled_in_when_unset():
    pkt = KBTP(opcode="STORE") / KBTPStore(cd=KBTPCompletionDescriptor(stag=1), inline_data=b"abcd")
    got = KBTP(bytes(pkt))
    assert int(got.flags) == RequestFlag.INLINE | RequestFlag.RECORD
    assert got[KBTPStore].dd.length == 4 and got[KBTPStore].cd.stag == 1


def test_explicit_values_are_kept_so_a_fuzzer_can_lie():
    lie = KBTP(opcode="STORE", flags="INLINE") / KBTPStore(dd=KBTPDataDescriptor(length=4096),
                                                          inline_data=b"xy")
    wire = bytes(lie)
    assert KBTP(wire)[KBTPStore].dd.length == 4096
    with pytest.raises(codec.Malformed, match="inline data is 2 octets"):
        codec.decode(wire)
    # RECORD claimed with no descriptor given: the descriptor goes out as zeros.
    wire = bytes(KBTP(opcode="LOAD", flags="RECORD") / KBTPLoad())
    assert len(wire) == codec.message_length(0x10, RequestFlag.RECORD)


def test_addr_le_conf_default_and_per_packet_override():
    pkt = KBTP(opcode="LOAD", handle=0x0102) / KBTPLoad(dd=KBTPDataDescriptor(stag=0x0A0B))
    assert bytes(pkt)[12:20] == (0x0102).to_bytes(8, "big")
    old = conf.contribs["kbtp"]["addr_le"]
    try:
        conf.contribs["kbtp"]["addr_le"] = True
        assert bytes(pkt)[12:20] == (0x0102).to_bytes(8, "little")
        assert bytes(pkt)[24:28] == (0x0A0B).to_bytes(4, "little")
        pkt.addr_le = False
        assert bytes(pkt)[12:20] == (0x0102).to_bytes(8, "big")
    finally:
        conf.contribs["kbtp"]["addr_le"] = old
    le = KBTP(opcode="LOAD", handle=0x0102, addr_le=True) / KBTPLoad()
    assert KBTP(bytes(le), addr_le=True).handle == 0x0102
    assert KBTP(bytes(le)).handle == 0x0201 << 48
    assert le.copy().addr_le is True


def test_hello_and_hello_ack_stay_in_network_order_in_addr_le_sessions():
    ack = KBTP(opcode="HELLO_ACK", handle=1, addr_le=True) / KBTPHelloAck(handle_base=0x4000)
    assert bytes(ack) == bytes(KBTP(opcode="HELLO_ACK", handle=1) / KBTPHelloAck(handle_base=0x4000))


def test_completion_answers_its_request_only():
    req = KBTP(opcode="LOAD", request_id=9) / KBTPLoad()
    ok = KBTP(opcode="COMPLETION", request_id=9) / KBTPCompletion()
    other = KBTP(opcode="COMPLETION", request_id=10) / KBTPCompletion()
    assert ok.answers(req) and not other.answers(req) and not req.answers(ok)
    assert KBTP(opcode="HELLO_ACK").answers(KBTP(opcode="HELLO"))
    assert "COMPLETION rid=9" in ok.summary()


def test_memory_structures_decode_what_direct_load_reads():
    entry = KBTPTableEntry(bytes.fromhex("0003 0005 00000008 0000000000150000"))
    assert entry.generation == 5 and entry.data_length == 8 and entry.block_offset == 0x150000


@pytest.mark.slow
@settings(max_examples=1500, deadline=None)
@given(st.binary(max_size=200), st.booleans())
def test_random_bytes_never_raise(data, addr_le):
    pkt = KBTP(data, addr_le=addr_le)
    bytes(pkt)
    pkt.summary()
    try:
        codec.decode(data, addr_le=addr_le)
    except codec.Malformed as exc:
        assert exc.reason


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.data())
def test_every_truncation_decodes_as_far_as_it_can(data):
    opcode = data.draw(st.sampled_from(sorted(T.BY_OPCODE)))
    wire = bytes(fuzz(KBTP(opcode=opcode, version=1) / BODY_CLASSES[opcode]()))
    cut = data.draw(st.integers(1, len(wire) - 1))
    pkt = KBTP(wire[:cut])
    assert bytes(pkt) == wire[:cut]          # nothing is lost
    pkt.summary()
    if cut >= 2:
        assert pkt.opcode == opcode
    with pytest.raises(codec.Malformed):
        codec.decode(wire[:cut])


def test_recognition_is_strict_about_version_and_opcode():
    good = bytes(KBTP(opcode="GOODBYE"))
    assert looks_like_kbtp(good)
    assert looks_like_kbtp(bytes(KBTP(opcode=0xC1)))
    assert not looks_like_kbtp(bytes(KBTP(opcode=0x50)))
    assert not looks_like_kbtp(b"\x02" + good[1:])
    assert not looks_like_kbtp(good[:23])
    assert isinstance(KBTP(bytes(KBTP(opcode=0x50)) + b"zz").payload, Raw)
    assert isinstance(KBTP(bytes(KBTP(opcode="LOAD") / KBTPLoad())).payload, KBTPLoad)
