"""Write the frames a soft RNIC sends and receives to a pcap file, as a capture on the wire.

One sink serves every connection of a process (a target writes all its sessions into one
file). Frames arrive as whole Ethernet frames from ``QueuePair.frame_listeners``; they are
written as they come, so the file is readable while the process runs.
"""
from __future__ import annotations

import os
import threading
import time

from scapy.utils import RawPcapWriter


class PcapSink:
    """A frame listener that appends every frame to ``path`` (link type Ethernet), at the
    RNIC's own stamp of it moved onto the wall clock: a frame's time in the file is the time
    the RNIC's timings (``kbtp bench``'s latencies) use, not a second reading taken later."""

    def __init__(self, path: str | os.PathLike) -> None:
        self._writer = RawPcapWriter(os.fspath(path), linktype=1, sync=True)
        self._writer.write_header(None)
        self._lock = threading.Lock()
        self._wall = time.time_ns() - time.perf_counter_ns()
        self.frames = 0

    def __call__(self, direction: str, frame: bytes, ns: int) -> None:
        sec, nsec = divmod(ns + self._wall, 1_000_000_000)
        with self._lock:
            self._writer.write_packet(frame, sec=sec, usec=nsec // 1000)
            self.frames += 1

    def close(self) -> None:
        with self._lock:
            self._writer.close()
