"""The committed sample captures: fresh, clean in tshark 4.0, and complete.

tshark runs with RPC-over-RDMA's heuristics disabled: without the KBTP dissector
(dissector/, a later issue) they claim KBTP Sends and mark them malformed, as
docs/WIRESHARK.md says. Everything else (MPA, DDP, RDMAP, BTH and the
extended headers) is tshark's own judgement.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kbtp_scapy import tables as T
from kbtp_scapy.capture import kbtp_messages, rdma_messages, read_packets
from kbtp_scapy.layers.kbtp import KBTP, packet_fields
from kbtp_scapy.vocab import Opcode
from tests.tshark import needs_tshark, tshark_frames, tshark_text

ROOT = Path(__file__).resolve().parent.parent
PCAPS = sorted((ROOT / "pcaps").glob("*.pcap"))
#: tools/make_pcaps.py's samples: every opcode and status, deterministic
SAMPLES = [p for p in PCAPS if "_kernel_" not in p.name]
#: real frames of Linux rxe and siw (tools/lab_captures.py, pcaps/README.md)
KERNEL = [p for p in PCAPS if "_kernel_" in p.name]
#: what tshark 4.0, which predates RFC 6581, says of every MPA revision 2 Request and
#: Reply (docs/WIRESHARK.md): siw speaks revision 2
MPA_REV2 = ("Rev field is NOT set to one", "Res field is NOT set to zero")
TSHARK_ARGS = ("-o", "tcp.try_heuristic_first:TRUE",
               "--disable-heuristic", "rpcrdma_infiniband", "--disable-heuristic", "rpcrdma_iwarp")


def test_there_are_samples_for_both_transports():
    names = {p.name for p in PCAPS}
    assert {"iwarp_session.pcap", "roce_session.pcap", "rxe_kernel_session.pcap",
            "siw_kernel_session.pcap"} <= names


@pytest.mark.slow
def test_committed_captures_are_fresh():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "make_pcaps.py"), "--check"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
@needs_tshark
@pytest.mark.parametrize("pcap", PCAPS, ids=lambda p: p.name)
def test_tshark_finds_nothing_wrong(pcap):
    text = tshark_text(pcap, *TSHARK_ARGS, "-z", "expert,warn", "-q")
    assert "Errors" not in text, text
    warned = re.findall(r"^\s+\d+\s+\S+\s+\S+\s+(.+)$", text.split("Warns", 1)[1], re.M) \
        if "Warns" in text else []
    allowed = MPA_REV2 if pcap in KERNEL else ()
    assert all(any(w in line for w in allowed) for line in warned), text
    frames = tshark_frames(pcap, *TSHARK_ARGS)
    assert not [i for i, f in enumerate(frames, 1) if "_ws.malformed" in f]
    if pcap.name.startswith("iwarp"):           # the samples negotiate CRC
        verdicts = [v for f in frames for v in f.get("iwarp_mpa.crc_check", [])]
        assert verdicts, "no MPA FPDU seen"
        labels = [line for line in tshark_text(pcap, *TSHARK_ARGS, "-V").splitlines()
                  if "CRC check:" in line]
        assert len(labels) >= len(verdicts) and all("(Good CRC32)" in line for line in labels)


@pytest.mark.parametrize("pcap", SAMPLES, ids=lambda p: p.name)
def test_every_opcode_and_status_decodes_and_matches_scapy(pcap):
    messages = rdma_messages(read_packets(pcap))
    found = list(kbtp_messages(messages))
    assert {f.fields["opcode"] for f in found} == set(T.BY_OPCODE)
    statuses = {f.fields["status"] for f in found if f.fields["opcode"] == T.BY_NAME["COMPLETION"].opcode}
    assert statuses == set(T.STATUS.by_value())
    assert [f.error for f in found if f.error] == ["inline data is 3 octets, the descriptor says 9"]
    addr_le = "addr_le" in pcap.name
    payloads = [m.payload for m in messages if m.kind in ("send", "send_inv") and m.payload[:1] == b"\x01"]
    for fnd, payload in zip(found, payloads):
        if not fnd.error:
            assert packet_fields(KBTP(payload, addr_le=addr_le)) == fnd.fields
    # The handles the session used come out right only if ADDR_LE was followed.
    alloc_store = T.BY_NAME["ALLOC_STORE"].opcode
    assert {f.fields["handle"] for f in found if f.fields["opcode"] == alloc_store} >= {0x4001, 0x4002}


@needs_tshark
@pytest.mark.parametrize("pcap", [p for p in PCAPS if p.name.startswith("roce")], ids=lambda p: p.name)
def test_roce_sample_headers_equal_tshark(pcap):
    """Every frame's BTH and extended headers as tshark reads them equal the Scapy layers'."""
    from scapy.layers.l2 import Ether

    from tests.test_roce_captures import assert_matches_tshark
    frames = tshark_frames(pcap, *TSHARK_ARGS)
    packets = read_packets(pcap)
    assert len(frames) == len(packets)
    for number, (pkt, tframe) in enumerate(zip(packets, frames), 1):
        assert_matches_tshark(Ether(bytes(pkt)), tframe, number)


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_sample_hello_acks_describe_a_possible_ring(path):
    """The samples' DIRECT_ALLOC descriptors obey the spec's Free-Block Ring (N a power of
    two not smaller than the Partition's blocks), so the project's own initiator can replay
    them: one sample granted 8 blocks on 4 slots, and replay's FetchAdd step refused it."""
    acks = [f.fields for f in kbtp_messages(rdma_messages(read_packets(path)))
            if f.fields.get("opcode") == Opcode.HELLO_ACK and "hello_ack.ring.count" in f.fields]
    assert acks
    for ack in acks:
        slots, blocks = ack["hello_ack.ring.count"], ack["hello_ack.partition.count"]
        assert slots & (slots - 1) == 0 and slots >= blocks > 0, ack
