"""Read pcap and pcapng captures incrementally, from a file or a pipe, without Scapy.

Formats: classic pcap in either byte order with microsecond or nanosecond timestamps
(draft-ietf-opsawg-pcap), and pcapng (draft-ietf-opsawg-pcapng): Section Header,
Interface Description (link type, ``if_tsresol``, ``if_tsoffset``), Enhanced, Simple and
obsolete Packet Blocks; other blocks are skipped. Memory stays at one read chunk plus one
record, whatever the size of the capture, and a pipe is read as data arrives
(``read1``), so ``tcpdump -w - | kbtp decode -`` shows messages while tcpdump runs.

A damaged capture is read past its damage: where a record or block claims a length no
capture has, the reader looks octet by octet for the next one that a second one follows
(pcap: a header of sane length and time, then another or the end; pcapng: a block whose
trailing length repeats its leading one) and goes on from there, so every record before
and after the damage is read; ``problem`` says what was skipped.
"""
from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

CHUNK = 1 << 20
MAX_RECORD = 1 << 26            # no link type has frames this large: the file is corrupt

_PCAP_MAGIC = {b"\xa1\xb2\xc3\xd4": (">", 1e-6), b"\xd4\xc3\xb2\xa1": ("<", 1e-6),
               b"\xa1\xb2\x3c\x4d": (">", 1e-9), b"\x4d\x3c\xb2\xa1": ("<", 1e-9)}
_PCAPNG_SHB = b"\x0a\x0d\x0d\x0a"
_BYTE_ORDER_MAGIC = 0x1A2B3C4D
_EPB, _SPB, _OPB, _IDB, _SHB = 6, 3, 2, 1, 0x0A0D0D0A
_OPT_TSRESOL, _OPT_TSOFFSET = 9, 14
_BLOCKS = frozenset((_IDB, _OPB, _SPB, 4, 5, _EPB, 9, 10, _SHB))    # 4 NRB, 5 ISB, 9 SJE, 10 DSB
#: seconds between a record found after damage and the last one before it, at most
_RESYNC_SPAN = 30 * 86400


#: Damage that stops a reader where it is, by kind, in the words of ``Reader.problem``; the
#: compiled core (``decode/core.py``) reports the kind and its numbers, worded here.
DAMAGE = {"record": "record {} claims {} octets",
          "section": "pcapng section at octet {} has no byte-order magic",
          "block": "pcapng block at octet {} claims {} octets"}


#: what a capture file's name ends in, for the tools that take a folder of them
SUFFIXES = (".pcap", ".pcapng", ".cap")


def capture_files(folder: Path) -> list[Path]:
    """The capture files in ``folder`` and the folders below it, in name order."""
    return sorted(p for p in folder.rglob("*") if p.suffix in SUFFIXES and p.is_file())


class CaptureError(Exception):
    """A capture that cannot be read: not pcap or pcapng, or corrupt at its start."""


class Reader:
    """The records of one capture: ``for number, time, linktype, data in Reader(f)``.

    ``number`` counts records from 1, as Wireshark numbers frames. After iteration,
    ``cut_short`` is the number of a record the capture ended in the middle of (None when
    it ended cleanly) and ``problem`` says what stopped reading early. ``position`` is the
    count of octets consumed, for progress displays. ``before_wait`` is called before a
    read that may block, so that a caller can flush what it has written.
    """

    def __init__(self, stream: BinaryIO, name: str = "capture",
                 before_wait: Callable[[], None] | None = None) -> None:
        self.name = name
        self._base = 0                            # octets of the stream before self._buf
        self.cut_short: int | None = None
        self.problem: str | None = None
        self.resumed = False                      # reading went on after the damage
        self.damage: str | None = None            # the first damage, where a reader that stops stopped
        self.linktype: int | None = None          # of a classic pcap, once its header is read
        self._read = getattr(stream, "read1", stream.read)
        self._before_wait = before_wait or (lambda: None)
        self._buf = b""
        self._at = 0
        self._eof = False
        self._count = 0
        self._first: str | None = None            # the first damage met, and since then:
        self._places = self._skipped = 0          # places read past, octets skipped there
        head = self._need(4)
        if head is None:
            raise CaptureError(f"{name}: empty file, not a pcap or pcapng capture")
        self._magic = bytes(self._buf[:4])
        if self._magic not in _PCAP_MAGIC and self._magic != _PCAPNG_SHB:
            raise CaptureError(f"{name}: not a pcap or pcapng capture (it starts with "
                               f"0x{self._magic.hex()})")
        if self._magic in _PCAP_MAGIC:
            if self._need(24) is None:
                raise CaptureError(f"{name}: the pcap header is cut short")
            endian, self._unit = _PCAP_MAGIC[self._magic]
            self._rec = struct.Struct(endian + "IIII")
            self.linktype = struct.unpack_from(endian + "I", self._buf, self._at + 20)[0] & 0xFFFF
            self._snaplen = struct.unpack_from(endian + "I", self._buf, self._at + 16)[0]
            self._at += 24

    # -- buffer ------------------------------------------------------------------------------
    def _need(self, n: int) -> int | None:
        """Make ``n`` octets available at ``self._at``; None at the end of the stream."""
        while len(self._buf) - self._at < n:
            if self._eof:
                return None
            self._before_wait()
            chunk = self._read(max(CHUNK, n))
            if not chunk:
                self._eof = True
                continue
            self._buf = self._buf[self._at:] + chunk
            self._base += self._at
            self._at = 0
        return self._at

    def _cut(self) -> None:
        """The stream ended inside a record."""
        if len(self._buf) > self._at:
            self.cut_short = self._count + 1

    # -- records -----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[int, float, int, bytes]]:
        records = self._pcap() if self._magic in _PCAP_MAGIC else self._pcapng()
        for record in records:
            self._count += 1
            yield (self._count, *record)

    @property
    def position(self) -> int:
        """Octets of the capture consumed so far."""
        return self._base + self._at

    def handover(self) -> dict[str, Any]:
        """What another reader of the records after the header needs (the compiled core):
        the octets read and not consumed, their offset in the stream, the format, and for
        a classic pcap its byte order, time unit, link type and snap length."""
        pcap = self._magic in _PCAP_MAGIC
        return {"head": bytes(self._buf[self._at:]), "base": self.position, "pcapng": not pcap,
                "big": pcap and self._rec.format.startswith(">"), "unit": self._unit if pcap else 1e-6,
                "linktype": self.linktype or 0, "snaplen": self._snaplen if pcap else 0}

    def report_damage(self, first: str, last: str, skipped: int, position: int, places: int,
                      total: int, lost: bool) -> None:
        """Say what damage was met: the ``first`` and the ``last`` (``DAMAGE``'s words), the
        octets skipped at the last and the octet reading went on at, how many ``places``
        reading went on after and the octets skipped in all, and whether no record followed
        the last (``lost``). The compiled core reports through this too."""
        self.damage = f"{first}: the file is corrupt"
        self.resumed = places > 0
        if lost:
            self.problem = f"{last}: the file is corrupt, and no record follows it"
        elif places == 1:
            self.problem = (f"{last}: the file is corrupt; {skipped:,} octets skipped, reading went "
                            f"on at octet {position:,}")
        else:
            self.problem = (f"{self.damage}; {places} damaged places, {total:,} octets skipped in "
                            "all, reading went on after each")

    def _damaged(self, what: str, resync: Callable[[], bool]) -> bool:
        """Say what is wrong at the reading position, then look for the next record
        (``resync``); whether one was found and reading goes on there."""
        start = self.position
        self._first = self._first or what
        found = resync()
        if found:
            self._places += 1
            self._skipped += self.position - start
        self.report_damage(self._first, what, self.position - start, self.position, self._places,
                           self._skipped, not found)
        return found

    def _pcap(self) -> Iterator[tuple[float, int, bytes]]:
        rec, unit, linktype = self._rec, self._unit, self.linktype
        assert linktype is not None              # read with the pcap header
        last = None                              # the seconds of the last record read
        while True:
            at = self._need(16)
            if at is None:
                self._cut()
                return
            sec, frac, caplen, _wirelen = rec.unpack_from(self._buf, at)
            if caplen > MAX_RECORD:
                what = DAMAGE["record"].format(self._count + 1, caplen)
                if not self._damaged(what, lambda: self._resync_pcap(last)):
                    return
                continue
            at = self._need(16 + caplen)
            if at is None:
                self._cut()
                return
            self._at = at + 16 + caplen
            last = sec
            yield sec + frac * unit, linktype, self._buf[at + 16:at + 16 + caplen]

    def _pcap_header_ok(self, at: int, last: int | None) -> int | None:
        """The captured length of a plausible record header at ``at``, else None."""
        sec, frac, caplen, wirelen = self._rec.unpack_from(self._buf, at)
        if (caplen > MAX_RECORD or caplen > wirelen or not caplen or frac >= round(1 / self._unit)
                or (self._snaplen and caplen > self._snaplen)
                or (last is not None and abs(sec - last) > _RESYNC_SPAN)):
            return None
        return caplen

    def _resync_pcap(self, last: int | None) -> bool:
        """Move to the next record header that another one (or the end) follows."""
        while True:
            self._at += 1
            at = self._need(16)
            if at is None:
                return False
            caplen = self._pcap_header_ok(at, last)
            if caplen is None:
                continue
            follower = self._need(16 + caplen + 16)
            if follower is None:                  # the last record: it ends the file exactly
                at = self._need(16 + caplen)
                if at is not None and len(self._buf) - at == 16 + caplen:
                    return True
                continue
            sec = self._rec.unpack_from(self._buf, follower)[0]
            if self._pcap_header_ok(follower + 16 + caplen, sec) is not None:
                return True

    def _pcapng(self) -> Iterator[tuple[float, int, bytes]]:
        endian = "<"
        interfaces: list[tuple[int, float, float]] = []     # link type, time unit, offset
        while True:
            at = self._need(12)
            if at is None:
                self._cut()
                return
            buf = self._buf
            if buf[at:at + 4] == _PCAPNG_SHB:
                magic = buf[at + 8:at + 12]
                if magic not in (b"\x4d\x3c\x2b\x1a", b"\x1a\x2b\x3c\x4d"):
                    # the byte order of the section before (little-endian at first) is the
                    # likelier: a resync in the other one finds no block, or a false one
                    what = DAMAGE["section"].format(self._base + at)
                    if not self._damaged(what, lambda: self._resync_pcapng(endian)):
                        return
                    continue
                endian = "<" if magic == b"\x4d\x3c\x2b\x1a" else ">"
                interfaces = []
            kind, length = struct.unpack_from(endian + "II", buf, at)
            if length < 12 or length % 4 or length > MAX_RECORD:
                what = DAMAGE["block"].format(self._base + at, length)
                if not self._damaged(what, lambda: self._resync_pcapng(endian)):
                    return
                continue
            at = self._need(length)
            if at is None:
                self._cut()
                return
            buf = self._buf
            self._at = at + length
            body = at + 8
            if kind == _EPB or kind == _OPB:
                if kind == _EPB:
                    iface, high, low, caplen = struct.unpack_from(endian + "IIII", buf, body)
                else:
                    iface, _drops, high, low, caplen = struct.unpack_from(endian + "HHIII", buf, body)
                if iface >= len(interfaces) or 28 + caplen > length:
                    continue
                linktype, unit, offset = interfaces[iface]
                start = body + 20
                yield ((high << 32 | low) * unit + offset, linktype, buf[start:start + caplen])
            elif kind == _SPB:
                if interfaces:
                    wirelen = struct.unpack_from(endian + "I", buf, body)[0]
                    caplen = min(wirelen, length - 16)
                    yield 0.0, interfaces[0][0], buf[body + 4:body + 4 + caplen]
            elif kind == _IDB:
                interfaces.append(_interface(buf, body, at + length - 4, endian))


    def _resync_pcapng(self, endian: str) -> bool:
        """Move to the next block of a known type whose trailing length repeats its
        leading one (a Section Header also with its byte-order magic)."""
        head = struct.Struct(endian + "II")
        while True:
            self._at += 1
            at = self._need(12)
            if at is None:
                return False
            kind, length = head.unpack_from(self._buf, at)
            if kind not in _BLOCKS or length < 12 or length % 4 or length > MAX_RECORD:
                continue
            whole = self._need(length)
            if whole is None:
                continue
            if struct.unpack_from(endian + "I", self._buf, whole + length - 4)[0] != length:
                continue
            if kind != _SHB or self._buf[whole + 8:whole + 12] in (b"\x4d\x3c\x2b\x1a", b"\x1a\x2b\x3c\x4d"):
                return True


def _interface(buf: bytes, at: int, end: int, endian: str) -> tuple[int, float, float]:
    """Link type, time unit and time offset of an Interface Description Block."""
    linktype = struct.unpack_from(endian + "H", buf, at)[0]
    unit, offset = 1e-6, 0.0
    at += 8
    while at + 4 <= end:
        code, size = struct.unpack_from(endian + "HH", buf, at)
        if code == 0:
            break
        value = buf[at + 4:at + 4 + size]
        if code == _OPT_TSRESOL and size >= 1:
            unit = 2.0 ** -(value[0] & 0x7F) if value[0] & 0x80 else 10.0 ** -value[0]
        elif code == _OPT_TSOFFSET and size >= 8:
            offset = float(struct.unpack_from(endian + "q", value)[0])
        at += 4 + size + (-size % 4)
    return linktype, unit, offset
