"""See the soft RNIC's frames as Scapy packets, for those who want to inspect them.

The data path never builds Scapy objects; a listener made by ``as_scapy`` does, for
every frame, so it costs about a millisecond per frame and belongs in debugging and
tests, not in benchmarks.
"""
from __future__ import annotations

from collections.abc import Callable

from scapy.layers.inet import TCP
from scapy.layers.l2 import Ether
from scapy.packet import Packet, Padding

from ..layers.iwarp import MPA
from .qp import FrameListener


class FollowingFPDUs(Padding):
    """The octets after an FPDU in the same TCP segment, dissected as the next FPDU.

    Scapy has no sibling layers: trailing octets are padding, built after the whole
    packet. This padding carries the next MPA frame as its payload and builds to it, so
    the packet still rebuilds to the segment's octets.
    """

    name = "Following FPDUs"

    def do_build(self) -> bytes:
        return b""

    def build_padding(self) -> bytes:
        return self.payload.build()


def _fpdus(data: bytes) -> Packet:
    """The MPA frames of a TCP payload, each one's successor in its trailing padding."""
    first = MPA(data)
    last = first
    while Padding in last and last[Padding].load:
        pad = last[Padding]
        holder = pad.underlayer
        holder.remove_payload()
        following = FollowingFPDUs()
        last = MPA(pad.load)
        holder.add_payload(following / last)
    return first


def as_scapy(callback: Callable[[str, Packet], None]) -> FrameListener:
    """A frame listener that calls ``callback(direction, packet)`` with a Scapy packet.

    RoCEv2 frames dissect down to KBTP by Scapy's own bindings; an iWARP segment's TCP
    payload is dissected as the MPA frames it carries (KBTP has no TCP port to bind to).
    """
    def listener(direction: str, frame: bytes, ns: int) -> None:
        pkt = Ether(frame)
        tcp = pkt.getlayer(TCP)
        if tcp is not None and len(tcp.payload):
            data = bytes(tcp.payload)
            tcp.remove_payload()
            tcp.add_payload(_fpdus(data))
        callback(direction, pkt)
    return listener
