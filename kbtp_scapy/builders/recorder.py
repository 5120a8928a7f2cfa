"""Record KBTP exchanges as the frames an RNIC puts on the wire, over either binding.

One interface (``Recorder``) over the iWARP conversation builder and the RoCEv2 RC
connection builder, so captures, ``kbtp craft -o`` and the demo describe a session once
and get it over both transports (docs/NOTES.md section 3 maps each KBTP use to RDMA messages).
Addresses are from the documentation ranges (RFC 5737, RFC 3849): these are files, not
traffic.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ..layers.iwarp import Op, RDMAPAtomicRequest, RDMAPAtomicResponse, RDMAPReadRequest
from ..wire.address import IWARP_PORT
from .iwarp import IwarpConversation
from .roce import RcConnection, RoceEndpoint

INITIATOR_V4, TARGET_V4 = "192.0.2.1", "192.0.2.2"
INITIATOR_V6, TARGET_V6 = "2001:db8::1", "2001:db8::2"
START = 1_700_000_000.0
TRANSPORTS = ("iwarp", "roce")


class Recorder:
    """One initiator-target connection. ``by_initiator`` says who issues each operation."""

    def send(self, by_initiator: bool, payload: bytes, invalidate: int | None = None) -> None:
        raise NotImplementedError

    def write(self, by_initiator: bool, data: bytes, stag: int, offset: int,
              imm: int | None = None) -> None:
        raise NotImplementedError

    def read(self, by_initiator: bool, data: bytes, stag: int, offset: int,
             sink_stag: int, sink_offset: int) -> None:
        """An RDMA Read of ``data`` at (stag, offset) into the reader's (sink_stag, sink_offset)."""
        raise NotImplementedError

    def fetch_add(self, by_initiator: bool, stag: int, offset: int, add: int, mask: int,
                  original: int) -> None:
        raise NotImplementedError

    def write_pcap(self, path: str | Path) -> None:
        raise NotImplementedError


class IwarpRecorder(Recorder):
    """TCP handshake, MPA set-up, then FPDUs; FIN on ``write_pcap``.

    Revision 1 by default: tshark 4.0 predates RFC 6581 and flags revision 2 frames
    with expert warnings, which the sample captures must not carry.
    """

    def __init__(self, ipv6: bool = False, markers: bool = False, revision: int = 1) -> None:
        ini, tgt = (INITIATOR_V6, TARGET_V6) if ipv6 else (INITIATOR_V4, TARGET_V4)
        self.conv = IwarpConversation((ini, 49152), (tgt, IWARP_PORT), markers=markers,
                                      revision=revision, start=START)
        self._atomic_id = 0

    def send(self, by_initiator, payload, invalidate=None):
        op = Op.SEND if invalidate is None else Op.SEND_INV
        self.conv.send_message(op, payload, from_initiator=by_initiator, inv_stag=invalidate or 0)

    def write(self, by_initiator, data, stag, offset, imm=None):
        if imm is not None:
            raise ValueError("RDMAP has no RDMA Write with Immediate")
        self.conv.send_message(Op.WRITE, data, from_initiator=by_initiator, stag=stag, to=offset)

    def read(self, by_initiator, data, stag, offset, sink_stag, sink_offset):
        request = RDMAPReadRequest(sink_stag=sink_stag, sink_to=sink_offset, read_size=len(data),
                                   src_stag=stag, src_to=offset)
        self.conv.send_message(Op.READ_REQUEST, request, from_initiator=by_initiator)
        self.conv.send_message(Op.READ_RESPONSE, data, from_initiator=not by_initiator,
                               stag=sink_stag, to=sink_offset)

    def fetch_add(self, by_initiator, stag, offset, add, mask, original):
        self._atomic_id += 1
        request = RDMAPAtomicRequest(aopcode=0, req_id=self._atomic_id, remote_stag=stag,
                                     remote_to=offset, data=add, mask=mask)
        self.conv.send_message(Op.ATOMIC_REQUEST, request, from_initiator=by_initiator)
        self.conv.send_message(Op.ATOMIC_RESPONSE,
                               RDMAPAtomicResponse(orig_req_id=self._atomic_id, orig_data=original),
                               from_initiator=not by_initiator)

    def write_pcap(self, path):
        self.conv.close()
        self.conv.write(str(path))


class RoceRecorder(Recorder):
    """An RC connection; the initiator is side "a". Fetch and Add is unmasked (IB)."""

    def __init__(self, ipv6: bool = False, mtu: int = 1024) -> None:
        ini, tgt = (INITIATOR_V6, TARGET_V6) if ipv6 else (INITIATOR_V4, TARGET_V4)
        self.conn = RcConnection(RoceEndpoint(ini, "02:00:00:00:00:01", qpn=0x11, psn=100),
                                 RoceEndpoint(tgt, "02:00:00:00:00:02", qpn=0x22, psn=5000),
                                 mtu=mtu, start=START)

    @staticmethod
    def _side(by_initiator: bool) -> str:
        return "a" if by_initiator else "b"

    def send(self, by_initiator, payload, invalidate=None):
        self.conn.send(self._side(by_initiator), payload, inv_rkey=invalidate)

    def write(self, by_initiator, data, stag, offset, imm=None):
        self.conn.write(self._side(by_initiator), data, va=offset, rkey=stag, imm=imm)

    def read(self, by_initiator, data, stag, offset, sink_stag, sink_offset):
        self.conn.read(self._side(by_initiator), data, va=offset, rkey=stag)

    def fetch_add(self, by_initiator, stag, offset, add, mask, original):
        self.conn.fetch_add(self._side(by_initiator), va=offset, rkey=stag, add=add,
                            original=original)

    def write_pcap(self, path):
        self.conn.write_pcap(str(path))


def recorder(transport: str, ipv6: bool = False) -> Recorder:
    """A fresh connection recorder for ``transport`` ("iwarp" or "roce")."""
    if transport == "iwarp":
        return IwarpRecorder(ipv6=ipv6)
    if transport == "roce":
        return RoceRecorder(ipv6=ipv6)
    raise ValueError(f"unknown transport {transport!r}: use one of {', '.join(TRANSPORTS)}")


def write_pcap(path: str | Path, transport: str, messages: Iterable[tuple[str, bytes]]) -> None:
    """A capture of KBTP messages, each ("request", bytes) from the initiator or
    ("response", bytes) from the target, carried in Sends."""
    rec = recorder(transport)
    for direction, payload in messages:
        rec.send(direction == "request", payload)
    rec.write_pcap(path)
