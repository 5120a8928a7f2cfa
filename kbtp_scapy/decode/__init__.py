"""The streaming capture decoder: pcap or pcapng octets to RDMA messages, no Scapy.

``pcapfile`` reads records as they arrive, ``frames`` finds each frame's RoCE or TCP
payload, ``roce`` puts RoCE Sends together by PSN (``connections`` ties the QPs of each
RoCEv2 connection's two directions) and ``iwarp`` reassembles TCP, MPA and DDP per
connection, each in bounded memory. ``rdma_messages`` runs them over one capture
and yields messages as their last frame is read; ``capture.kbtp_messages`` decodes the
KBTP ones with the codec. This is what ``kbtp decode`` uses; the Scapy layers stay the
way to inspect single packets.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..wire.message import RdmaMessage
from ..words import count
from .frames import ROCE, SUPPORTED, TCP, locate
from .iwarp import IwarpStreams
from .pcapfile import CaptureError, Reader, capture_files
from .roce import RoceOperations, RoceSends

__all__ = ["CaptureError", "Reader", "Stats", "capture_files", "rdma_messages", "rdma_operations"]


@dataclass
class Stats:
    """What a decoder run saw besides messages: ``unsupported`` counts frames by link
    type that cannot be read, ``cut`` frames shorter than their IP datagram (snap length)."""

    frames: int = 0
    first_time: float | None = None
    unsupported: Counter = field(default_factory=Counter)
    cut: int = 0

    def cut_note(self) -> str:
        """``; N frames cut short by the capture's snap length``, or "" when none was: what
        every summary of a run adds (``kbtp decode``, ``kbtp analyze``)."""
        return f"; {count(self.cut, 'frame')} cut short by the capture's snap length" if self.cut else ""


def rdma_messages(reader: Reader, stats: Stats | None = None) -> Iterator[RdmaMessage]:
    """RoCE Sends that carry KBTP and every iWARP Send, as their last frame is read
    (messages left incomplete come out at the end)."""
    return _messages(reader, stats, RoceSends(), IwarpStreams(sends_only=True))


def rdma_operations(reader: Reader, stats: Stats | None = None) -> Iterator[RdmaMessage]:
    """The Sends (RoCE's that carry KBTP, as ``rdma_messages`` gives them; every iWARP
    RDMAP message), and every RDMA Write, Read Request, Read Response, Atomic and its
    answer beside them, with their STags, offsets, lengths and operands
    (``RoceOperations``, ``IwarpStreams(sends_only=False)``): the one-sided traffic
    ``kbtp analyze`` follows (DIRECT_LOAD, DIRECT_ALLOC, the data of requests)."""
    return _messages(reader, stats, RoceOperations(), IwarpStreams(sends_only=False))


def _messages(reader: Reader, stats: Stats | None, roce: RoceSends, iwarp: IwarpStreams
              ) -> Iterator[RdmaMessage]:
    stats = stats if stats is not None else Stats()
    unsupported = stats.unsupported
    for number, time, linktype, data in reader:
        stats.frames = number
        if number == 1:
            stats.first_time = time
        if linktype not in SUPPORTED:
            unsupported[linktype] += 1
            continue
        where = locate(linktype, data)
        if where is None:
            continue
        kind = where[0]
        if kind == ROCE:
            done = roce.packet(number, time, where[1], where[2], data, where[3], where[4], where[5])
        elif kind == TCP:
            _, src, dst, sport, dport, seq, ack, flags, start, end = where
            done = iwarp.segment(number, time, src, dst, sport, dport, seq, ack, flags, data, start, end)
        else:
            stats.cut += 1
            continue
        if done:
            yield from done
    yield from roce.flush()
    yield from iwarp.flush()
