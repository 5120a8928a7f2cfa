"""The initiator's buffers a target may write, fenced with canary octets.

A LOAD writes Data Length octets at the start of its Data Descriptor and nothing else
("It RDMA-writes Data Length octets of the block to the Data Descriptor"); a completion
record is 24 octets at its Completion Descriptor; a refused request writes nothing ("a
failed check ... has no other effect"). So the fuzzer's LOAD buffers and record slots
sit inside regions with canary octets before and after the part a request names, at a
wide Tagged Offset, and every octet of those regions outside the part the answer allows
must read as it did before the request: a write one octet early, past Data Length, up to
the descriptor's end or beyond it shows.
"""
from __future__ import annotations

from ..rnic import Access
from ..rnic.memory import MemoryRegion, MemoryTable
from ..tables import memory as M
from ..vocab import AnyMessage, Opcode, RequestFlag, Status
from .findings import Finding
from .tally import NOT_OURS, Tally

FENCE = 32          # canary octets on each side of the named part
BASE = 1 << 40      # Tagged Offset of a fenced region's first octet: wide, and not zero
CANARY = 0xA5

Snapshot = dict[int, bytes]      # STag -> the region's octets before the request


def fenced(memory: MemoryTable, length: int) -> tuple[MemoryRegion, int]:
    """A writable region of ``length`` octets fenced on both sides, and the Tagged
    Offset of its named part."""
    region = memory.register(bytearray([CANARY]) * (FENCE + length + FENCE), Access.REMOTE_WRITE, base=BASE)
    return region, BASE + FENCE


def _named(req: AnyMessage) -> list[tuple[str, int]]:
    """The buffers ``req`` names for the target to write: a LOAD's Data Descriptor, a
    Completion Descriptor."""
    out = [("load.buffer", req["dd.stag"])] if req["opcode"] == Opcode.LOAD else []
    if req.get("flags", 0) & RequestFlag.RECORD and "cd.stag" in req:
        out.append(("record.slot", req["cd.stag"]))
    return out


def snapshot(memory: MemoryTable, req: AnyMessage | None) -> Snapshot:
    """The writable regions of the fuzzer's own that ``req`` names, as they are now."""
    out = {}
    for _, stag in _named(req) if req is not None else ():
        region = memory.get(stag)
        if region is not None and region.access & Access.REMOTE_WRITE:
            out[stag] = bytes(region.view)
    return out


def check(memory: MemoryTable, req: AnyMessage | None, c: AnyMessage, record: bool, before: Snapshot,
          what: str, tally: Tally) -> list[Finding]:
    """Octets of the named regions that changed outside what the answer ``c`` allows:
    an OK LOAD's [offset, offset + Data Length) and a completion record's 24 octets."""
    if req is None:
        return []
    allowed: dict[int, list[tuple[int, int]]] = {}
    if record:
        allowed.setdefault(req["cd.stag"], []).append((req["cd.offset"], req["cd.offset"] + M.COMPLETION_RECORD.size))
    if req["opcode"] == Opcode.LOAD and c["status"] == Status.OK:
        n = min(c["completion.data_length"], req["dd.length"])
        allowed.setdefault(req["dd.stag"], []).append((req["dd.offset"], req["dd.offset"] + n))
    out = []
    for name, stag in _named(req):
        region, old = memory.get(stag), before.get(stag)
        if region is None or old is None:
            tally.cannot(NOT_OURS, name)
            continue
        tally.judge(name)
        bad = _changed(region, old, allowed.get(stag, []))
        if bad:
            first, last = bad
            parts = ", ".join(f"0x{a:x}..0x{b - 1:x}" for a, b in allowed.get(stag, []) if b > a) or "nothing"
            out.append(Finding("canary", f"{what} (answered {'by a record' if record else 'by a Send'}, "
                               f"Status {c['status']}) changed the fuzzer's buffer STag 0x{stag:08x} at Tagged "
                               f"Offsets 0x{first:x}..0x{last:x}; the target may write {parts} of it"))
    return out


def _changed(region: MemoryRegion, old: bytes, allowed: list[tuple[int, int]]) -> tuple[int, int] | None:
    """The first and last Tagged Offsets outside ``allowed`` whose octets differ from ``old``."""
    now = bytes(region.view)
    if now == old:
        return None
    gaps, at = [], 0
    for a, b in sorted((max(0, a - region.base), min(len(now), b - region.base)) for a, b in allowed):
        if a > at:
            gaps.append((at, a))
        at = max(at, b)
    gaps.append((at, len(now)))
    diff = [i for g, h in gaps if now[g:h] != old[g:h] for i in range(g, h) if now[i] != old[i]]
    return (region.base + diff[0], region.base + diff[-1]) if diff else None
