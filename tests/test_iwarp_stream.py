"""iWARP stream helpers: markers, segmentation, the conversation builder and the decoder."""
from __future__ import annotations

import random
import struct

import pytest
from hypothesis import given, settings, strategies as st
from scapy.layers.inet import IP, TCP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Ether
from scapy.packet import Raw
from scapy.utils import rdpcap

from kbtp_scapy.builders.iwarp import (
    MULPDU,
    IwarpConversation,
    iter_rdma_messages,
    mulpdu,
    reassemble,
    segment_message,
)
from kbtp_scapy.layers.iwarp import (
    DDP,
    MPA,
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
from kbtp_scapy.wire.mpa_markers import insert_markers, marker, strip_markers

A, B = ("10.1.0.1", 49200), ("10.1.0.2", 7471)


# --- Markers ---------------------------------------------------------------------------

def test_markers_every_512_octets_point_back_to_the_fpdu():
    first, second = bytes(range(256)) * 4, b"\xab" * 100       # 1024 and 100 octets
    w1 = insert_markers(first, 0, fix_crc=False)
    # markers at stream positions 0 and 512 (the second one after 508 FPDU octets)
    assert w1 == marker(0) + first[:508] + marker(512) + first[508:1016] + \
        marker(1024) + first[1016:]
    assert marker(512) == b"\x00\x00\x02\x00"
    w2 = insert_markers(second, len(w1), fix_crc=False)     # starts at 1036: next at 1536
    assert w2 == second
    w3 = insert_markers(second, 1500, fix_crc=False)        # marker 36 octets in
    assert w3 == second[:36] + marker(36) + second[36:]
    clean, found = strip_markers(w1 + w2)
    assert clean == first + second
    assert found == [(0, marker(0)), (508, marker(512)), (1016, marker(1024))]


def test_marker_inside_an_fpdu_is_covered_by_its_crc():
    fpdu = bytes(MPA() / DDP(opcode=Op.SEND) / (b"z" * 600))
    wire = insert_markers(fpdu, 100)
    assert len(wire) == len(fpdu) + 4
    assert wire[-4:] == crc32c(wire[:-4]).to_bytes(4, "little")
    assert strip_markers(wire, 100)[0][:-4] == fpdu[:-4]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 1500), min_size=1, max_size=8), st.integers(0, 4000))
def test_marker_insert_strip_round_trip(sizes, start):
    rng = random.Random(sum(sizes) + start)
    fpdus = [bytes(rng.getrandbits(8) for _ in range(n)) for n in sizes]
    wire, pos, starts = b"", start, []
    for f in fpdus:
        starts.append(pos)
        w = insert_markers(f, pos, fix_crc=False)
        wire += w
        pos += len(w)
    clean, found = strip_markers(wire, start)
    assert clean == b"".join(fpdus)
    assert len(wire) == len(clean) + 4 * len(found)
    for k, (_, m) in enumerate(found):
        # the k-th marker sits at the k-th multiple of 512 at or after ``start``
        at = -(-start // 512) * 512 + 512 * k
        owner = max(s for s in starts if s <= at)
        assert m == marker(at - owner)


# --- Segmentation ----------------------------------------------------------------------

def test_mulpdu_follows_the_mss():
    assert MULPDU == mulpdu(1460) == 1454
    assert mulpdu(1460, markers=True) == 1442
    assert mulpdu(9000) == 8994


def test_send_segments_by_mo_with_last_flag():
    data = bytes(range(256)) * 12                                        # 3072 octets
    fpdus = segment_message("Send", data, msn=7)
    ddps = [MPA(bytes(f))[DDP] for f in fpdus]
    assert [d.mo for d in ddps] == [0, 1436, 2872]
    assert [d.last for d in ddps] == [0, 0, 1]
    assert {(d.msn, d.qn, d.opcode) for d in ddps} == {(7, 0, Op.SEND)}
    assert all(MPA(bytes(f)).ulpdu_len <= MULPDU and len(bytes(f)) <= 1460 for f in fpdus)
    assert reassemble(fpdus) == data


def test_write_segments_by_tagged_offset():
    fpdus = segment_message("RDMA Write", b"w" * 3000, stag=0x99, to=0x1000)
    ddps = [MPA(bytes(f))[DDP] for f in fpdus]
    assert [d.to for d in ddps] == [0x1000, 0x1000 + 1440, 0x1000 + 2880]
    assert all(d.tagged and d.stag == 0x99 for d in ddps)
    assert [d.last for d in ddps] == [0, 0, 1]


def test_zero_length_and_body_messages_are_one_segment():
    (empty,) = segment_message(Op.SEND_SE, b"")
    assert MPA(bytes(empty))[DDP].last == 1 and len(bytes(empty)) == 24
    (rr,) = segment_message("RDMA Read Request", RDMAPReadRequest(read_size=5), msn=3)
    assert isinstance(rr[DDP].payload, RDMAPReadRequest)
    assert MPA(bytes(rr))[DDP].qn == 1


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([Op.SEND, Op.SEND_INV, Op.WRITE, Op.READ_RESPONSE]),
       st.binary(max_size=5000), st.integers(40, 2000), st.randoms())
def test_reassemble_round_trip_in_any_order(op, data, mul, rnd):
    fpdus = segment_message(op, data, mulpdu=mul, stag=5, to=1 << 40)
    assert all(MPA(bytes(f)).ulpdu_len <= mul for f in fpdus)
    rnd.shuffle(fpdus)
    assert reassemble(fpdus) == data


def test_reassemble_rejects_a_missing_segment():
    fpdus = segment_message("Send", b"x" * 4000)
    with pytest.raises(ValueError):
        reassemble(fpdus[:1] + fpdus[2:])


# --- Conversation builder --------------------------------------------------------------

def _check_tcp_bookkeeping(packets):
    """Sequence numbers run on without gaps and every ACK acknowledges all received."""
    nxt, received = {}, {}
    times = [float(p.time) for p in packets]
    assert times == sorted(times) and len(set(times)) == len(times)
    for p in packets:
        net, tcp = p[1], p[TCP]
        me, peer = (net.src, tcp.sport), (net.dst, tcp.dport)
        if tcp.flags.S:
            nxt[me] = tcp.seq
        assert tcp.seq == nxt[me]
        if tcp.flags.A:
            assert tcp.ack == received[me]
        data = len(p[Raw].load) if Raw in p else 0
        nxt[me] = (tcp.seq + data + tcp.flags.S + tcp.flags.F) & 0xFFFFFFFF
        received[peer] = nxt[me]


def test_conversation_handshake_startup_and_close():
    conv = IwarpConversation(A, B, ird=4, ord=8, private_data=b"pd")
    conv.send_message("Send", b"hi")
    conv.close()
    pkts = conv.packets
    assert [str(p[TCP].flags) for p in pkts[:3]] == ["S", "SA", "A"]
    assert pkts[0][TCP].options == [("MSS", 1460)]
    req, rep = MPA(pkts[3][Raw].load), MPA(pkts[4][Raw].load)
    assert isinstance(req, MPARequest) and isinstance(rep, MPAReply)
    assert req.rev == 2 and req.flags == "C+S" and not req.flags.M
    assert (req[MPAEnhanced].ird, req[MPAEnhanced].ord, req[Raw].load) == (4, 8, b"pd")
    assert [str(p[TCP].flags) for p in pkts[-3:]] == ["FA", "FA", "A"]
    _check_tcp_bookkeeping(pkts)


def test_conversation_acks_every_second_segment_and_each_burst():
    conv = IwarpConversation(A, B)
    start = len(conv.packets)
    conv.send_message("RDMA Write", b"d" * 5000, stag=1)                  # 4 FPDUs
    flow = [(p[IP].src, len(p[Raw].load) if Raw in p else 0) for p in conv.packets[start:]]
    assert [(src == A[0], n > 0) for src, n in flow] == [
        (True, True), (True, True), (False, False),
        (True, True), (True, True), (False, False)]
    _check_tcp_bookkeeping(conv.packets)


def test_conversation_packs_and_splits_fpdus():
    conv = IwarpConversation(("fd00::1", 1000), ("fd00::2", 2000))
    small = [f for m in range(3) for f in segment_message("Send", b"m" * 10, msn=m + 1)]
    start = len(conv.packets)
    conv.send_fpdus(small, per_segment=3)
    assert bytes(conv.packets[start][Raw].load) == b"".join(bytes(f) for f in small)
    assert IPv6 in conv.packets[start]
    big = segment_message("Send", b"q" * 2000, msn=4)
    start = len(conv.packets)
    conv.send_fpdus(big, split_at=[7, 1500])
    sizes = [len(p[Raw].load) for p in conv.packets[start:] if Raw in p]
    assert sizes == [7, 1460, 33, sum(len(bytes(f)) for f in big) - 1500]
    _check_tcp_bookkeeping(conv.packets)


def test_send_message_counts_msn_per_queue_and_direction():
    conv = IwarpConversation(A, B)
    assert conv.send_message("Send", b"a")[0][DDP].msn == 1
    assert conv.send_message("Send with Solicited Event", b"b")[0][DDP].msn == 2
    assert conv.send_message("RDMA Read Request", RDMAPReadRequest())[0][DDP].msn == 1
    assert conv.send_message("Send", b"c", from_initiator=False)[0][DDP].msn == 1
    assert conv.send_message("Atomic Request", RDMAPAtomicRequest())[0][DDP].msn == 2


# --- Decoding --------------------------------------------------------------------------

def _sample_conversation(markers=False, ends=(A, B)):
    conv = IwarpConversation(*ends, markers=markers)
    sent = []

    def send(op, payload=b"", initiator=True, **kw):
        conv.send_message(op, payload, from_initiator=initiator, **kw)
        sent.append((op, bytes(payload), initiator, kw))

    send("Send", b"hello")
    send("RDMA Write", bytes(range(256)) * 20, initiator=False, stag=0x77, to=0x5000)
    send("RDMA Read Request", RDMAPReadRequest(sink_stag=1, sink_to=2, read_size=4000,
                                               src_stag=3, src_to=4))
    send("RDMA Read Response", b"r" * 4000, initiator=False, stag=1, to=2)
    send("Send with Invalidate", b"inv", initiator=False, inv_stag=0xAB)
    send("Atomic Request", RDMAPAtomicRequest(req_id=7, remote_stag=9, data=1, mask=1 << 31))
    send("Atomic Response", RDMAPAtomicResponse(orig_req_id=7, orig_data=5), initiator=False)
    send("Immediate Data with Solicited Event", RDMAPImmediate(imm=0x1122))
    send("Terminate", RDMAPTerminate(layer=2, etype=0, errcode=2), initiator=False)
    conv.close()
    return conv, sent


def _check_decoded(msgs, sent, ends=(A, B)):
    kinds = {Op.SEND: "send", Op.WRITE: "write", Op.READ_REQUEST: "read_request",
             Op.READ_RESPONSE: "read_response", Op.SEND_INV: "send_inv",
             Op.ATOMIC_REQUEST: "atomic_request", Op.ATOMIC_RESPONSE: "atomic_response",
             Op.IMMEDIATE_SE: "immediate", Op.TERMINATE: "terminate"}
    assert len(msgs) == len(sent)
    names = {name: op for op, name in RDMAP_OPCODES.items()}
    for msg, (op, payload, initiator, kw) in zip(msgs, sent, strict=True):
        assert msg.transport == "iwarp" and msg.kind == kinds[names[op]]
        assert msg.conn == (ends if initiator else ends[::-1])
        assert msg.info["opcode"] == op and msg.info["complete"] and msg.info["crc_ok"]
        if msg.kind in ("send", "send_inv", "write", "read_response"):
            assert msg.payload == payload
        for key in ("stag", "to", "inv_stag"):
            if key in kw:
                assert msg.info[key] == kw[key]
    return {m.kind: m for m in msgs}


def test_decoder_finds_every_message():
    conv, sent = _sample_conversation()
    msgs = list(iter_rdma_messages(conv.packets))
    by_kind = _check_decoded(msgs, sent)
    assert by_kind["read_request"].info["read_size"] == 4000
    assert by_kind["atomic_request"].info["mask"] == 1 << 31
    assert by_kind["atomic_response"].info["orig_data"] == 5
    assert by_kind["immediate"].info["imm"] == 0x1122 and by_kind["immediate"].info["solicited"]
    assert by_kind["terminate"].info["errcode"] == 2
    write = by_kind["write"]
    frames = [n for n, p in enumerate(conv.packets, 1)
              if Raw in p and p[IP].src == B[0] and n > 7][:4]
    assert write.frames == frames and write.info["segments"] == 4
    assert by_kind["send"].info["msn"] == 1 and by_kind["send"].info["qn"] == 0


def test_decoder_reads_pcap_files_with_link_padding(tmp_path):
    conv, sent = _sample_conversation(ends=(("fd00::a", 5000), ("fd00::b", 6000)))
    conv.write(tmp_path / "v6.pcap")
    _check_decoded(list(iter_rdma_messages(rdpcap(str(tmp_path / "v6.pcap")))), sent,
                   ends=(("fd00::a", 5000), ("fd00::b", 6000)))
    conv, sent = _sample_conversation()
    conv.write(tmp_path / "v4.pcap")
    _check_decoded(list(iter_rdma_messages(rdpcap(str(tmp_path / "v4.pcap")))), sent)


def test_decoder_with_markers_both_ways():
    conv, sent = _sample_conversation(markers=True)
    _check_decoded(list(iter_rdma_messages(conv.packets)), sent)


def test_decoder_tolerates_retransmissions_and_reordering():
    conv, sent = _sample_conversation()
    pkts = list(conv.packets)
    data = [i for i, p in enumerate(pkts) if Raw in p and i > 5]
    partial = pkts[data[5]].copy()                              # overlapping resend
    partial[Raw].load = partial[Raw].load[:50]
    pkts.append(partial)
    pkts[data[1]], pkts[data[2]] = pkts[data[2]], pkts[data[1]]  # out of order
    pkts.insert(data[3] + 1, pkts[data[3]].copy())            # a retransmission
    _check_decoded(list(iter_rdma_messages(pkts)), sent)


def test_decoder_follows_fpdus_cut_anywhere():
    conv = IwarpConversation(A, B, markers=True)
    fpdus = [f for m in range(1, 4) for f in segment_message("Send", bytes([m]) * 900, msn=m)]
    conv.send_fpdus(fpdus, split_at=[1, 2, 3, 950, 951, 1900])
    msgs = list(iter_rdma_messages(conv.packets))
    assert [m.payload for m in msgs] == [bytes([m]) * 900 for m in range(1, 4)]
    data = [n for n, p in enumerate(conv.packets, 1) if Raw in p and n > 6]
    assert msgs[0].frames == data[:4] and msgs[1].frames == data[3:6]
    assert all(m.info["crc_ok"] for m in msgs)


def test_decoder_reads_raw_ip_and_ignores_other_tcp():
    conv, sent = _sample_conversation()
    bare = [p[IP] for p in conv.packets]
    other = Ether() / IP(src="1.1.1.1", dst="2.2.2.2") / TCP(sport=1, dport=2) / b"GET /"
    _check_decoded(list(iter_rdma_messages([*bare, other])), sent)


def test_decoder_flags_bad_crc_and_cut_messages():
    conv, _ = _sample_conversation()
    pkts = [p.copy() for p in conv.packets]
    hello = next(i for i, p in enumerate(pkts) if Raw in p and b"hello" in p[Raw].load)
    load = bytearray(pkts[hello][Raw].load)
    load[-6] ^= 1
    pkts[hello][Raw].load = bytes(load)
    write_frames = [i for i, p in enumerate(pkts) if Raw in p and p[IP].src == B[0]][1:5]
    del pkts[write_frames[3]:]                                # capture ends mid-Write
    msgs = list(iter_rdma_messages(pkts))
    assert msgs[0].kind == "send" and msgs[0].info["crc_ok"] is False
    assert msgs[1].kind == "write" and not msgs[1].info["complete"]
    assert len(msgs[1].payload) == 3 * 1440


def test_rejected_connection_and_no_crc():
    conv = IwarpConversation(A, B, crc=False)
    conv.send_message("Send", b"x")
    assert list(iter_rdma_messages(conv.packets))[0].info["crc_ok"] is None
    pkts = list(conv.packets)
    rep = bytearray(pkts[4][Raw].load)
    rep[16] |= 0x20
    pkts[4] = pkts[4].copy()
    pkts[4][Raw].load = bytes(rep)
    assert list(iter_rdma_messages(pkts)) == []


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=6), st.integers(0, 2**32 - 1))
def test_decoder_survives_garbage(chunks, seq):
    conv = IwarpConversation(A, B)
    pkts = list(conv.packets)
    for k, chunk in enumerate(chunks):
        pkts.append(Ether() / IP(src=A[0], dst=B[0]) / TCP(
            sport=A[1], dport=B[1], seq=(seq + 97 * k) % 2**32, flags="PA") / chunk)
        pkts.append(Ether(bytes(Ether(type=0x800)) + chunk))
        pkts.append(IP(src=B[0], dst=A[0]) /
                    TCP(sport=B[1], dport=A[1], seq=0x20000019 + k * 8) / chunk)
    for msg in iter_rdma_messages(pkts):
        assert msg.transport == "iwarp"


def test_decoder_survives_a_garbage_stream_after_startup():
    rng = random.Random(5)
    for _ in range(30):
        conv = IwarpConversation(A, B, markers=rng.random() < 0.5)
        conv.send_fpdus([bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 3000)))])
        conv.send_fpdus([struct.pack("!H", rng.randint(0, 65535)) + bytes(40)],
                        from_initiator=False)
        list(iter_rdma_messages(conv.packets))
    assert MPA_REQ_KEY in bytes(conv.packets[3])
