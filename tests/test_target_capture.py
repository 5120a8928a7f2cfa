"""What target and initiator put on the wire decodes as KBTP: their own pcaps (--pcap)
and a real tshark capture on lo, read by tshark with the KBTP dissector and by the
project's decoder, give the same KBTP messages."""
from __future__ import annotations

import asyncio

import pytest

from kbtp_scapy.capture import kbtp_messages, rdma_messages, read_packets
from kbtp_scapy.initiator import Initiator, KbtpError
from kbtp_scapy.rnic.pcap import PcapSink
from kbtp_scapy.target import TargetConfig
from kbtp_scapy.vocab import Opcode

from .kbtp_harness import TargetThread, fresh_hosts
from .live_capture import LiveCapture, free_port, tcp_probe, udp_probe
from .test_dissector import fields
from .tshark import needs_tshark

pytestmark = needs_tshark


async def session(t: TargetThread, sink: PcapSink) -> None:
    ini = await Initiator.connect(t.url, frame_listeners=[sink], **t.connect_options(0))
    h = ini.target.handle_base
    await ini.alloc_store(h, b"inline block", seal=True)
    await ini.alloc_store(h + 1, bytes(range(200)) * 20, seal=True, inline=False)  # RDMA Read
    await ini.load(h + 1)                                                           # RDMA Write
    await ini.load(h, record=t.transport == "roce")
    with pytest.raises(KbtpError):
        await ini.load(h + 2)
    await ini.direct_load(h)
    await ini.direct_alloc(h + 3, b"direct")
    await ini.free(h)
    await ini.goodbye(release=True)


def decoded(pcap) -> list[tuple[int, int, int]]:
    return [(f.fields["opcode"], f.fields.get("request_id", 0), f.fields.get("status", 0))
            for f in kbtp_messages(rdma_messages(read_packets(pcap)))]


def dissected(pcap) -> list[tuple[int, int, int]]:
    rows = fields(pcap, ["opcode", "request_id", "status"])
    return [(int(r["kbtp.opcode"], 0), int(r.get("kbtp.request_id", "0"), 0),
             int(r.get("kbtp.status", "0"), 0)) for _, r in sorted(rows.items())]


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["iwarp", "roce"])
def test_pcaps_and_live_capture_decode_alike(transport, tmp_path):
    host, ini_host, *rest = fresh_hosts(6)
    if transport == "iwarp":
        port = free_port(host)
        capture = LiveCapture(tmp_path / "live.pcap", f"tcp port {port} and host {host}",
                              tcp_probe(host, port))
    else:
        port = 4791
        capture = LiveCapture(tmp_path / "live.pcap", f"udp port 4791 and host {host}",
                              udp_probe(host, 4791, ini_host))
    target_sink, ini_sink = PcapSink(tmp_path / "target.pcap"), PcapSink(tmp_path / "initiator.pcap")
    with capture:
        t = TargetThread(transport, TargetConfig(blocks=64, max_initiators=4),
                         hosts=[host, ini_host, *rest], port=port, frame_listeners=[target_sink])
        try:
            asyncio.run(asyncio.wait_for(session(t, ini_sink), 60))
        finally:
            t.stop()
    target_sink.close()
    ini_sink.close()
    ours = decoded(tmp_path / "target.pcap")
    opcodes = {op for op, _, _ in ours}
    assert {Opcode[n] for n in ("HELLO", "HELLO_ACK", "ALLOC_STORE", "LOAD", "FREE", "BIND",
                            "COMPLETION", "GOODBYE")} <= opcodes
    assert decoded(tmp_path / "initiator.pcap") == ours
    assert decoded(tmp_path / "live.pcap") == ours
    for name in ("target.pcap", "initiator.pcap", "live.pcap"):
        assert dissected(tmp_path / name) == ours, name
