"""Verdicts that need no request of the case: HELLO_ACKs, a fresh HELLO after each case,
and with DIRECT_LOAD the table and the rings held to the model.

Every completion is judged by ``model``; this module covers what is read rather than
answered.
"""
from __future__ import annotations

import asyncio
import secrets
from collections import Counter
from typing import TYPE_CHECKING

from .. import codec
from ..harness import HarnessError
from ..initiator import KbtpError
from ..tables import memory as M
from ..tables.enums import OPCODES, STATUS
from ..vocab import AnyMessage, AnyStruct, EntryFlag, Feature, Opcode
from .findings import Finding
from .model import is_block
from .tally import NO_HELLO_FLAGS, NO_TICKETS, REFUSED_HELLO, Tally
from .trouble import TRANSPORT_ERRORS, describe

if TYPE_CHECKING:
    from .state import World


def status_known(status: int) -> bool:
    lo, hi = STATUS.private_range
    return status in {v.value for v in STATUS.values} or lo <= status <= hi


def check_hello_ack(raw: bytes, transport: str, requested: int, tally: Tally) -> list[Finding]:
    """The HELLO_ACK's header ("Request ID, Block Handle, Generation, and Status are
    zero", Status reporting an error) and what the text fixes of a granted body; what
    only later answers can hold to it (Block Size, Max Inline, the quota, the handle
    range, the Ticket Timeout, the descriptors) is counted as judged here and held by the
    model and the table and ring reads."""
    if not raw:
        return []
    try:
        ack = codec.decode(raw)
    except codec.Malformed as bad:
        return [Finding("hello-ack", f"the answer to HELLO cannot be parsed: {bad}", evidence={"answer": raw.hex()})]
    ev = {"hello_ack": raw.hex()}
    if ack["opcode"] != Opcode.HELLO_ACK:
        return [Finding("hello-ack", f"HELLO was answered by {OPCODES.describe(ack['opcode'])}", evidence=ev)]
    tally.judge(*(f"hello_ack.{k}" for k in ("version", "opcode", "request_id", "handle", "generation", "status")))
    tally.cannot(NO_HELLO_FLAGS, "hello_ack.flags")
    problems = [f"{name} 0x{value:x}" for value, name in ((ack["request_id"], "Request ID"),
                                                          (ack["handle"], "Block Handle"),
                                                          (ack["generation"], "Generation")) if value]
    out = [Finding("hello-ack", "the HELLO_ACK header carries " + ", ".join(problems) + " (zero in HELLO_ACK)",
                   evidence=ev)] if problems else []
    if not status_known(ack["status"]):
        out.append(Finding("hello-ack", f"HELLO_ACK Status {ack['status']} is neither assigned nor Private Use",
                           evidence=ev))
    if ack["status"]:
        tally.cannot(REFUSED_HELLO, "hello_ack.body")
        return out
    wrong = _body(ack, transport, requested, tally)
    if wrong:
        out.append(Finding("hello-ack", "HELLO_ACK: " + "; ".join(wrong), evidence=ev))
    return out


def _body(f: AnyMessage, transport: str, requested: int, tally: Tally) -> list[str]:
    """What a granted HELLO_ACK's body breaks of the text, each field counted."""
    features, wrong = f["hello_ack.features"], []
    untimed = not features & Feature.DIRECT_ALLOC
    tally.judge(*(k for k in f if k.startswith("hello_ack.") and not (untimed and k == "hello_ack.ticket_timeout")))
    if untimed:
        tally.cannot(NO_TICKETS, "hello_ack.ticket_timeout")
    if transport == "iwarp" and features & Feature.RECORD_COMPLETION:
        wrong.append("RECORD_COMPLETION granted in the RDMAP binding")
    if features & ~requested & ~Feature.ADDR_LE:
        wrong.append(f"Features 0x{features:04x} grant more than the requested 0x{requested:04x} (and ADDR_LE)")
    if f["hello_ack.handle_base"] + f["hello_ack.handle_count"] > 1 << 64:
        wrong.append(f"the handle range 0x{f['hello_ack.handle_base']:x}+{f['hello_ack.handle_count']} "
                     "passes 2^64")
    if features & Feature.DIRECT_LOAD:
        if f["hello_ack.reserved"]:
            wrong.append(f"the reserved octets after the Table Base Handle are 0x{f['hello_ack.reserved']:016x}")
        if f["hello_ack.allocation_quota"] > f["hello_ack.pool.count"]:
            wrong.append(f"Allocation Quota {f['hello_ack.allocation_quota']} exceeds the pool's "
                         f"{f['hello_ack.pool.count']} blocks")
    if features & Feature.DIRECT_ALLOC:
        wrong += _alloc_descriptors(f, features)
    return wrong


def _alloc_descriptors(f: AnyMessage, features: int) -> list[str]:
    """DIRECT_ALLOC: the Partition (Count = the quota, a part of the pool: its Block
    Offsets are the pool's), the Ring (N = 2^n, not smaller than F) and Head (Count 1,
    its offset a multiple of 8)."""
    wrong = []
    n, part, quota, size = (f["hello_ack.ring.count"], f["hello_ack.partition.count"],
                            f["hello_ack.allocation_quota"], f["hello_ack.block_size"])
    if part != quota:
        wrong.append(f"the Partition's Count {part} is not the Allocation Quota {quota}")
    if f["hello_ack.head.offset"] % 8:
        wrong.append(f"Head Tagged Offset 0x{f['hello_ack.head.offset']:x} is not a multiple of 8")
    if f["hello_ack.head.count"] != 1:
        wrong.append(f"Head Count {f['hello_ack.head.count']}, not 1")
    if n < 1 or n & (n - 1) or n < part:
        wrong.append(f"ring of {n} slots for a partition of {part} blocks (N = 2^n, not smaller than F)")
    if features & Feature.DIRECT_LOAD and size:
        rel = f["hello_ack.partition.offset"] - f["hello_ack.pool.offset"]
        if rel % size or rel < 0 or rel + part * size > f["hello_ack.pool.count"] * size:
            wrong.append(f"the Partition 0x{f['hello_ack.partition.offset']:x}+{part} blocks is not a part of "
                         f"the pool 0x{f['hello_ack.pool.offset']:x}+{f['hello_ack.pool.count']} blocks")
    return wrong


async def liveness(world: World) -> list[Finding]:
    """A fresh HELLO on a new connection must be answered, and granted a range of its own.

    NO_SPACE (or INTERNAL) is the target's right when it is full, but then the fuzzer
    cannot judge liveness: that stops the run (``HarnessError``)."""
    try:
        ini = await world.connect(secrets.token_bytes(16), features=0)
    except KbtpError as exc:
        if exc.name in ("NO_SPACE", "INTERNAL"):
            raise HarnessError(f"{world.url}: a fresh HELLO after a case: {world.refusal(exc)}") from None
        return [Finding("hello", f"a HELLO with a fresh Initiator ID was refused with {exc.name}")]
    except TRANSPORT_ERRORS as exc:
        return [Finding("liveness", f"no HELLO_ACK to a fresh HELLO: {describe(exc, world.timeout)}")]
    fresh = world.session(ini)
    world._disjoint(fresh, world.own, world.peer)
    try:
        await asyncio.wait_for(ini.goodbye(release=True), world.timeout)
    except TimeoutError:
        await ini.close()
    return []


async def table_invariants(world: World) -> list[Finding]:
    """With DIRECT_LOAD: every entry the model knows reads as known, no block is bound
    twice or outside the pool; with DIRECT_ALLOC no block is both free in the ring and bound."""
    ini, f = world.own.ini, world.own.ini.target.fields
    if "table.stag" not in f:
        return []
    raw = await ini.qp.read(f["table.stag"], f["table.offset"], f["table.count"] * M.ENTRY_SIZE)
    size, blocks, first = ini.target.block_size, f["pool.count"], f["table_base_handle"]

    def entry(handle: int) -> AnyStruct:
        at = (handle - first) * M.ENTRY_SIZE
        return codec.decode_struct(M.TABLE_ENTRY, raw[at:at + M.ENTRY_SIZE], ini.addr_le)
    where: Counter[int] = Counter()
    out = []
    known = {h for s in (world.own, world.peer) for h in s.known.entries}
    for i, low in enumerate(raw[1::M.ENTRY_SIZE]):      # Flags, network order: VALID is in the low octet
        if low & EntryFlag.VALID:
            handle = first + i
            e = entry(handle)
            off = e["entry.block_offset"]
            where[off] += 1
            if not is_block(off, f["pool.offset"], blocks, size):
                out.append(Finding("invariant", f"handle 0x{handle:x} bound to 0x{off:x}, not a block of the pool"))
            if handle not in known and world.owner(handle) is not None:
                out += _as_known(world, handle, e)       # a handle of ours that nothing bound
    for handle in sorted(known):
        if 0 <= handle - first < f["table.count"]:
            world.tally.judge("table.entry")
            out += _as_known(world, handle, entry(handle))
    for off, n in where.items():
        if n > 1:
            out.append(Finding("invariant", f"block 0x{off:x} bound by {n} table entries"))
    if "ring.stag" in f and not world.own.known.spoiled:
        out += await _ring(world, where)
    return out


def _as_known(world: World, handle: int, e: AnyStruct) -> list[Finding]:
    """The entry against the model: VALID, SEALED, Generation, Data Length, Block Offset."""
    k = world.lookup(handle)
    flags, gen = e["entry.flags"], e["entry.generation"]
    seen = []
    if k.bound is not None and bool(flags & EntryFlag.VALID) != k.bound:
        seen.append(f"VALID {'clear' if k.bound else 'set'}")
    if k.generation is not None and gen != k.generation:
        seen.append(f"Generation {gen}, not {k.generation}")
    if k.bound and flags & EntryFlag.VALID:
        if k.sealed is not None and bool(flags & EntryFlag.SEALED) != k.sealed:
            seen.append(f"SEALED {'clear' if k.sealed else 'set'}")
        if k.length is not None and e["entry.data_length"] != k.length:
            seen.append(f"Data Length {e['entry.data_length']}, not {k.length}")
        if k.block is not None and e["entry.block_offset"] != k.block:
            seen.append(f"Block Offset 0x{e['entry.block_offset']:x}, not 0x{k.block:x}")
    if flags & EntryFlag.VALID and gen == 0:
        seen.append("Generation 0 on a bound entry")
    if not seen:
        return []
    shown = f" (the model's view comes from {k.seen})" if k.seen else ""
    kind = "block-offset" if all(s.startswith("Block Offset") for s in seen) else "invariant"
    return [Finding(kind, f"the table entry of 0x{handle:x} reads " + ", ".join(seen) + shown)]


async def _ring(world: World, bound: Counter[int]) -> list[Finding]:
    """The session's own ring against Head and the partition: Head's Slot Offset is 16
    times its Ticket modulo N with bits 31 to n+4 zero (with unmasked FetchAdd, as on
    InfiniBand, the low half is zero: docs/NOTES.md); slot s only ever holds Sequences
    congruent to s modulo N (initialisation, and Tail's ticket u writing the slot at its
    offset); its reserved octets are zero; a free block lies in the Partition (the only
    part of the pool the initiator can write), is free once, and is bound nowhere."""
    ini, f = world.own.ini, world.own.ini.target.fields
    head = await ini.qp.fetch_add(f["head.stag"], f["head.offset"], 0, 0 if ini.qp.masked_atomics else None)
    ticket, n = head >> 32, f["ring.count"]
    raw = await ini.qp.read(f["ring.stag"], f["ring.offset"], n * M.SLOT_SIZE)
    out = []
    low = M.SLOT_SIZE * (ticket % n) if ini.qp.masked_atomics else 0    # unmasked (InfiniBand): low half zero
    if head & 0xFFFFFFFF != low:
        out.append(Finding("invariant", f"Head reads 0x{head:016x}: Ticket {ticket}, low half "
                           f"0x{head & 0xFFFFFFFF:x}, not 0x{low:x}"))
    part, size = f.get("partition.offset"), ini.target.block_size
    free: Counter[int] = Counter()
    odd: list[str] = []
    for i in range(n):
        slot = codec.decode_struct(M.RING_SLOT, raw[i * M.SLOT_SIZE:(i + 1) * M.SLOT_SIZE], ini.addr_le)
        seq, off = slot["slot.sequence"], slot["slot.block_offset"]
        if seq % n != i:
            odd.append(f"slot {i} holds Sequence {seq}")
        if slot["slot.reserved"]:
            odd.append(f"slot {i}'s reserved octets are 0x{slot['slot.reserved']:08x}")
        if off != M.SLOT_CONSUMED and (seq - ticket) & 0xFFFFFFFF < n:
            free[off] += 1
            if part is not None and not is_block(off, part, f["partition.count"], size):
                odd.append(f"slot {i} offers block 0x{off:x}, outside the Partition 0x{part:x}+"
                           f"{f['partition.count']} blocks")
    world.tally.judge(*["ring.head"] + ["ring.slot"] * n)
    if odd:
        out.append(Finding("invariant", "the ring: " + "; ".join(odd[:4]) + (f" (and {len(odd) - 4} more)"
                                                                              if len(odd) > 4 else "")))
    for off, k in free.items():
        if k > 1:
            out.append(Finding("invariant", f"block 0x{off:x} free in {k} ring slots"))
        if bound[off]:
            out.append(Finding("invariant", f"block 0x{off:x} is free in the ring and bound"))
    return out
