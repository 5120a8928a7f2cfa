"""RoCE layers and helpers on frames we build: every RC, UC and UD opcode over IPv4 and
IPv6 with every pad count, segmentation at MTU boundaries, the RC connection builder,
and garbage that must never raise."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from scapy.compat import raw
from scapy.contrib.roce import AETH, BTH
from scapy.layers.inet import IP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Ether
from scapy.packet import Packet, Raw

from kbtp_scapy.builders.roce import (
    PATH_MTUS,
    RcConnection,
    RoceEndpoint,
    iter_rdma_messages,
    reassemble,
    segment_message,
)
from kbtp_scapy.layers.roce import (
    DETH,
    HEADERS,
    IETH,
    MESSAGE_START,
    OPCODES,
    RETH,
    AtomicAckETH,
    AtomicETH,
    BTHPad,
    ImmDt,
    add_pad,
    bth_parts,
    icrc_ok,
)

HEADER_VALUES = {
    RETH: dict(va=0x1122334455667788, rkey=0xDEADBEEF, dlen=19),
    DETH: dict(qkey=0x80010000, srcqp=0x23),
    AETH: dict(syndrome=0x1F, msn=7),
    AtomicETH: dict(va=0x8877665544332211, rkey=0xABCDEF01, swap_add=0xFEDCBA9876543210,
                    compare=3),
    AtomicAckETH: dict(orig_data=0x0102030405060708),
    ImmDt: dict(imm=0xCAFEBABE),
    IETH: dict(rkey=0x12345678),
}
#: Opcodes whose packets carry no payload, only headers.
NO_PAYLOAD = {OPCODES[f"RC_{op}"] for op in ("RDMA_READ_REQUEST", "ACKNOWLEDGE",
                                              "ATOMIC_ACKNOWLEDGE", "COMPARE_SWAP", "FETCH_ADD")}
#: Payload whose pad-count variants no tshark payload heuristic claims.
TEXT = b"The quick brown fox jumps over the lazy dog. " * 4


def frame(opcode: int, payload: bytes = b"", *, v6: bool = False, values=HEADER_VALUES,
          **bth) -> Packet:
    """One complete RoCEv2 frame with the headers of ``opcode``, padded."""
    bth.setdefault("dqpn", 0x000123)
    bth.setdefault("psn", 0xABCDEF)
    stack = BTH(opcode=opcode, **bth)
    for cls in HEADERS[opcode]:
        stack /= cls(**values[cls])
    if payload:
        stack /= Raw(payload)
    if v6:
        net = IPv6(src="fd00::1", dst="fd00::2") / UDP(sport=49152, dport=4791)
    else:
        net = IP(src="10.0.0.1", dst="10.0.0.2", flags="DF") / UDP(sport=49152, dport=4791, chksum=0)
    return Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02") / net / add_pad(stack)


def cases() -> list[tuple[int, bytes, bool]]:
    """(opcode, payload, IPv6?) for every opcode, both IP versions and pad counts 0..3."""
    out = []
    for v6 in (False, True):
        for opcode in sorted(HEADERS):
            sizes = [0] if opcode in NO_PAYLOAD else [16, 17, 18, 19]
            out += [(opcode, TEXT[:n], v6) for n in sizes]
    return out


def test_opcode_table_is_rc_uc_ud_complete():
    names = {code: name for name, code in OPCODES.items()}
    assert sorted(HEADERS) == [*range(0x00, 0x15), 0x16, 0x17, *range(0x20, 0x2C), 0x64, 0x65]
    assert names[0x16] == "RC_SEND_LAST_WITH_INVALIDATE"
    assert names[0x17] == "RC_SEND_ONLY_WITH_INVALIDATE"
    assert HEADERS[0x0B] == (RETH, ImmDt) and HEADERS[0x12] == (AETH, AtomicAckETH)
    assert HEADERS[0x65] == (DETH, ImmDt) and HEADERS[0x17] == (IETH,)
    assert {0x00, 0x04, 0x05, 0x17, 0x20, 0x24, 0x25, 0x64, 0x65} == MESSAGE_START


@pytest.mark.parametrize("opcode,payload,v6", cases(),
                         ids=lambda v: ("v6" if v else "v4") if isinstance(v, bool) else
                         (f"len{len(v)}" if isinstance(v, bytes) else f"{v:#04x}"))
def test_every_opcode_builds_and_dissects(opcode, payload, v6):
    data = raw(frame(opcode, payload, v6=v6))
    pkt = Ether(data)
    assert raw(pkt) == data
    assert pkt[BTH].opcode == opcode and pkt[BTH].psn == 0xABCDEF and pkt[BTH].dqpn == 0x123
    headers, body = bth_parts(pkt)
    assert list(headers) == list(HEADERS[opcode])
    for cls, header in headers.items():
        assert header.fields == HEADER_VALUES[cls] | ({"reserved": 0} if cls is DETH else {})
    assert body == payload and (not payload or pkt[Raw].load == payload)
    pad = -len(payload) % 4
    assert pkt[BTH].padcount == pad
    assert (pkt[BTHPad].pad if pad else b"") == bytes(pad) and (BTHPad in pkt) == bool(pad)
    udp_payload = data[(34 if not v6 else 54) + 8:]
    assert (len(udp_payload) - 4) % 4 == 0
    assert icrc_ok(data) and icrc_ok(pkt)


def test_add_pad_is_idempotent_and_pad_is_before_the_icrc():
    pkt = frame(OPCODES["RC_SEND_ONLY"], b"abcde")
    again = raw(add_pad(pkt))
    assert again == raw(pkt)
    assert again[-12:-4] == b"abcde\0\0\0"
    assert Ether(again)[BTH].padcount == 3 and icrc_ok(again)


def test_icrc_ignores_the_ethernet_trailer():
    data = raw(frame(OPCODES["RC_SEND_ONLY"]))  # 58 octets: a NIC pads it to 60
    assert len(data) == 58
    padded = Ether(data + b"\0\0")
    assert icrc_ok(padded) and bth_parts(padded)[1] == b""


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(opcode=st.sampled_from(sorted(HEADERS)), payload=st.binary(max_size=80),
       v6=st.booleans(), psn=st.integers(0, 0xFFFFFF), dqpn=st.integers(2, 0xFFFFFF),
       flags=st.fixed_dictionaries({"solicited": st.integers(0, 1), "migreq": st.integers(0, 1),
                                    "ackreq": st.integers(0, 1), "fecn": st.integers(0, 1),
                                    "becn": st.integers(0, 1), "pkey": st.integers(0, 0xFFFF)}),
       words=st.lists(st.integers(0, 2**64 - 1), min_size=4, max_size=4))
def test_round_trip_build_bytes_dissect(opcode, payload, v6, psn, dqpn, flags, words):
    values = {RETH: dict(va=words[0], rkey=words[1] >> 32, dlen=words[2] >> 32),
              DETH: dict(qkey=words[0] >> 32, srcqp=words[1] >> 40),
              AETH: dict(syndrome=words[0] >> 56, msn=words[1] >> 40),
              AtomicETH: dict(va=words[0], rkey=words[1] >> 32, swap_add=words[2],
                              compare=words[3]),
              AtomicAckETH: dict(orig_data=words[3]), ImmDt: dict(imm=words[2] >> 32),
              IETH: dict(rkey=words[3] >> 32)}
    data = raw(frame(opcode, payload, v6=v6, values=values, psn=psn, dqpn=dqpn, **flags))
    pkt = Ether(data)
    assert raw(pkt) == data and icrc_ok(data)
    assert all(pkt[BTH].getfieldval(k) == v for k, v in flags.items())
    assert (pkt[BTH].psn, pkt[BTH].dqpn) == (psn, dqpn)
    headers, body = bth_parts(pkt)
    assert body == payload
    for cls, header in headers.items():
        assert all(header.getfieldval(k) == v for k, v in values[cls].items())


def _sizes(mtu: int) -> list[int]:
    return [0, 1, 3, mtu - 1, mtu, mtu + 1, 2 * mtu - 1, 2 * mtu, 2 * mtu + 1, 3 * mtu + 2]


SEGMENT_KINDS = [("send", {}), ("send", {"imm": 0x55}), ("send_inv", {"inv_rkey": 0x77}),
                 ("write", {"va": 0x1000, "rkey": 0x42}),
                 ("write_imm", {"va": 0x1000, "rkey": 0x42, "imm": 9}),
                 ("read_response", {"msn": 3})]


@pytest.mark.parametrize("mtu", PATH_MTUS)
@pytest.mark.parametrize("kind,extra", SEGMENT_KINDS,
                         ids=[k + "".join(f"-{x}" for x in e) for k, e in SEGMENT_KINDS])
def test_segmentation_at_mtu_boundaries(mtu, kind, extra):
    for size in _sizes(mtu):
        payload = bytes(i % 251 for i in range(size))
        packets = segment_message(kind, payload, dqpn=0x42, psn=0xFFFFFE, mtu=mtu, **extra)
        n = max(1, -(-size // mtu))
        assert len(packets) == n
        assert [p[BTH].psn for p in packets] == [(0xFFFFFE + i) & 0xFFFFFF for i in range(n)]
        names = [p[BTH].sprintf("%opcode%") for p in packets]
        if n == 1:
            assert "_ONLY" in names[0]
        else:
            assert "_FIRST" in names[0] and "_LAST" in names[-1]
            assert all("_MIDDLE" in x for x in names[1:-1])
        for i, p in enumerate(packets):
            chunk = len(p[Raw].load) if Raw in p else 0
            assert chunk == (mtu if i < n - 1 else size - mtu * (n - 1))
            assert p[BTH].ackreq == (kind != "read_response" and i == n - 1)
            assert (RETH in p) == (kind.startswith("write") and i == 0)
            assert (ImmDt in p) == ("imm" in extra and i == n - 1)
            assert (IETH in p) == (kind == "send_inv" and i == n - 1)
            assert (AETH in p) == (kind == "read_response" and (i in (0, n - 1)))
        if kind.startswith("write"):
            assert packets[0][RETH].dlen == size
        assert reassemble(packets) == payload


@settings(max_examples=40, deadline=None)
@given(size=st.integers(0, 5000), mtu=st.sampled_from(PATH_MTUS), v6=st.booleans())
def test_segment_reassemble_round_trip_through_frames(size, mtu, v6):
    payload = bytes((i * 7) % 256 for i in range(size))
    ip = ("fd00::1", "fd00::2") if v6 else ("10.0.0.1", "10.0.0.2")
    conn = RcConnection(RoceEndpoint(ip[0], "02:00:00:00:00:01", 0x11),
                        RoceEndpoint(ip[1], "02:00:00:00:00:02", 0x22), mtu=mtu)
    frames = conn.send("a", payload, ack=False)
    data = [raw(f) for f in frames]
    assert all(icrc_ok(d) for d in data)
    assert reassemble(Ether(d) for d in data) == payload
    (message,) = iter_rdma_messages(Ether(d) for d in data)
    assert message.payload == payload and message.frames == list(range(1, len(frames) + 1))


def test_reassemble_rejects_broken_sequences():
    packets = segment_message("send", bytes(3000), dqpn=5, psn=10, mtu=1024)
    for broken in (packets[:-1], packets[1:], [packets[0], packets[2]], packets[::-1],
                   packets + packets[-1:], []):
        with pytest.raises(ValueError):
            reassemble(broken)
    with pytest.raises(ValueError):
        segment_message("send", b"", dqpn=5, mtu=1000)
    with pytest.raises(ValueError):
        segment_message("send_inv", b"", dqpn=5, service="UC", inv_rkey=1)


@pytest.mark.parametrize("v6", [False, True], ids=["v4", "v6"])
def test_rc_connection_follows_ib_psn_and_msn_rules(v6):
    ip = ("fd00::a", "fd00::b") if v6 else ("192.0.2.1", "192.0.2.2")
    a = RoceEndpoint(ip[0], "02:00:00:00:00:0a", 0x000111, psn=0xFFFFFE)
    b = RoceEndpoint(ip[1], "02:00:00:00:00:0b", 0x000222, psn=100)
    conn = RcConnection(a, b, mtu=256, start=1000.0)
    conn.send("a", bytes(600), ack=False)          # PSNs FFFFFE, FFFFFF, 0; ACK deferred
    conn.send("a", b"x" * 5, solicited=True)        # PSN 1, one coalesced ACK for PSN 1
    conn.write("b", bytes(300), va=0x1000, rkey=7, imm=0xAB)   # b's PSNs 100, 101
    read = conn.read("a", bytes(700), va=0x2000, rkey=8)        # PSN 2, responses 2, 3, 4
    atomic = conn.fetch_add("a", va=0x3000, rkey=9, add=1 << 32, original=0x500000000)
    conn.send("b", b"bye", inv_rkey=7)
    frames = conn.frames
    times = [float(f.time) for f in frames]
    assert times == sorted(times) and len(set(times)) == len(times) and times[0] == 1000.0
    summary = [(f[BTH].sprintf("%opcode%"), f[BTH].psn, f[BTH].dqpn, f[BTH].ackreq)
               for f in frames]
    acks = [(s, f[AETH].msn) for s, f in zip(summary, frames) if s[0] == "RC_ACKNOWLEDGE"]
    assert acks == [(("RC_ACKNOWLEDGE", 1, 0x111, 0), 2), (("RC_ACKNOWLEDGE", 101, 0x222, 0), 1),
                    (("RC_ACKNOWLEDGE", 0x64 + 2, 0x222, 0), 2)]
    assert [s[1] for s in summary[:4]] == [0xFFFFFE, 0xFFFFFF, 0, 1]
    assert [s[3] for s in summary[:4]] == [0, 0, 1, 1] and frames[3][BTH].solicited == 1
    assert [(f[BTH].sprintf("%opcode%"), f[BTH].psn) for f in read] == [
        ("RC_RDMA_READ_REQUEST", 2), ("RC_RDMA_READ_RESPONSE_FIRST", 2),
        ("RC_RDMA_READ_RESPONSE_MIDDLE", 3), ("RC_RDMA_READ_RESPONSE_LAST", 4)]
    assert read[1][AETH].msn == read[3][AETH].msn == 3 and read[1][BTH].dqpn == 0x111
    assert [(f[BTH].sprintf("%opcode%"), f[BTH].psn) for f in atomic] == [
        ("RC_FETCH_ADD", 5), ("RC_ATOMIC_ACKNOWLEDGE", 5)]
    assert atomic[1][AtomicAckETH].orig_data == 0x500000000 and atomic[1][AETH].msn == 4
    for f in frames:
        assert icrc_ok(f)
        assert f[UDP].dport == 4791 and (f[UDP].chksum != 0 if v6 else f[UDP].chksum == 0)
    kinds = [(m.kind, len(m.payload), m.info["complete"]) for m in iter_rdma_messages(frames)]
    assert kinds == [("send", 600, True), ("send", 5, True), ("ack", 0, True),
                     ("write_imm", 300, True), ("ack", 0, True), ("read_request", 0, True),
                     ("read_response", 700, True), ("atomic_request", 0, True),
                     ("atomic_response", 0, True), ("send_inv", 3, True), ("ack", 0, True)]


def test_iter_reports_what_is_missing_without_raising():
    conn = RcConnection(RoceEndpoint("10.0.0.1", "02:00:00:00:00:01", 0x11),
                        RoceEndpoint("10.0.0.2", "02:00:00:00:00:02", 0x22), mtu=256)
    frames = conn.send("a", bytes(1000), ack=False)  # FIRST, MIDDLE, MIDDLE, LAST
    broken = bytearray(raw(frames[2]))
    broken[-1] ^= 1
    messages = list(iter_rdma_messages([frames[0], frames[1], Ether(bytes(broken)), frames[3]]))
    assert [m.info["complete"] for m in messages] == [True] and not messages[0].info["icrc_ok"]
    messages = list(iter_rdma_messages([frames[0], frames[1], frames[3]]))
    assert [(m.frames, m.info["complete"]) for m in messages] == [([1, 2], False), ([3], False)]


@pytest.mark.slow
def test_truncated_frames_never_raise():
    """Cut anywhere after the Ethernet header (Scapy's Ether itself raises on less)."""
    for opcode, payload, v6 in cases()[::6]:
        data = raw(frame(opcode, payload, v6=v6))
        cut = [Ether(data[:n]) for n in range(14, len(data))]
        assert not any(icrc_ok(data[:n]) for n in range(len(data)))
        for m in iter_rdma_messages(cut):
            assert not m.info["icrc_ok"]


_UDP_HEAD = raw(Ether() / IP(src="10.0.0.1", dst="10.0.0.2") / UDP(sport=1, dport=4791, chksum=0))


@settings(max_examples=200, deadline=None)
@given(garbage=st.binary(max_size=120), over_udp=st.booleans())
def test_random_bytes_never_raise(garbage, over_udp):
    data = _UDP_HEAD + garbage if over_udp else garbage
    assert isinstance(icrc_ok(data), bool)
    packets = [Raw(garbage)]
    if len(data) >= 14:
        pkt = Ether(data)
        assert isinstance(icrc_ok(pkt), bool)
        if BTH in pkt:
            bth_parts(pkt)
        packets.append(pkt)
    list(iter_rdma_messages(packets))


def test_kbtp_payload_is_dissected_as_kbtp():
    from kbtp_scapy.layers.kbtp import KBTP

    vector = bytes.fromhex("0112000100000000000000070000000000004001000000000000000000000000"
                           "000000000000000008") + b"KVBLOCK!"
    for opcode in (OPCODES["RC_SEND_ONLY"], OPCODES["RC_SEND_ONLY_WITH_INVALIDATE"],
                   OPCODES["UD_SEND_ONLY"], OPCODES["RC_SEND_FIRST"]):
        data = raw(frame(opcode, vector))
        pkt = Ether(data)
        assert KBTP in pkt and bth_parts(pkt)[1] == vector and icrc_ok(pkt)
        assert raw(pkt) == data and pkt[BTHPad].pad == b"\0\0\0"
        assert pkt[KBTP].opcode == 0x12
    for opcode in (OPCODES["RC_SEND_MIDDLE"], OPCODES["RC_SEND_LAST"],
                   OPCODES["RC_RDMA_WRITE_ONLY"]):
        pkt = Ether(raw(frame(opcode, vector)))
        assert KBTP not in pkt and pkt[Raw].load == vector
