"""Verdicts from the wire: answers to each request, and the invariants after each case.

Refusals (any non-OK status, NAK or Terminate ending the connection) are the target's
right. A finding is what the specification forbids as far as the wire shows it: an OK
where a check had to fail, an answer to a Request ID never sent or answered twice, no
answer at all, a stored block that loads back changed, a broken DIRECT_LOAD-visible
invariant, or a target that stops answering HELLO.
"""
from __future__ import annotations

import asyncio
import secrets
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .. import codec
from ..initiator import KbtpError
from ..initiator.client import ALL_FEATURES
from ..rnic.qp import ConnectionLost, RemoteError
from ..tables import memory as M
from ..tables.enums import OPCODES, STATUS
from ..target.table import SEALED, VALID
from .state import World

OP = OPCODES.by_name()
S = STATUS.by_name()
OWN_RANGE_OPS = {OP["STORE"], OP["ALLOC_STORE"], OP["FREE"], OP["BIND"]}
LIVENESS_TIMEOUT = 5.0


@dataclass
class Finding:
    """One thing the target did that the rules forbid; ``kind`` groups findings for
    minimization (a smaller case must show the same kind)."""

    kind: str
    detail: str
    step: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "detail": self.detail, "step": self.step, "evidence": self.evidence}


def status_known(status: int) -> bool:
    lo, hi = STATUS.private_use
    return status in {v.value for v in STATUS.values} or lo <= status <= hi


def check_completion(world: World, sent: bytes, req: dict[str, Any] | None, c: dict[str, Any],
                     allowed_blocks: set[int]) -> list[Finding]:
    """Rules a completion breaks, given the octets sent (``req`` their decoding, or
    None when they cannot be parsed) and the (ticket, block) pairs the session took."""
    own, out = world.own, []
    status, rid = c["status"], c["request_id"]
    ev = {"sent": sent.hex(), "completion": {k: (v.hex() if isinstance(v, bytes) else v) for k, v in c.items()}}
    if len(sent) >= 12 and rid != int.from_bytes(sent[4:12], "big"):
        out.append(Finding("request-id", f"completion for Request ID {rid}, request carried "
                           f"{int.from_bytes(sent[4:12], 'big')}", evidence=ev))
    if not status_known(status):
        out.append(Finding("status-undefined", f"status {status} is neither assigned nor Private Use",
                           evidence=ev))
    if status != S["OK"]:
        return out
    lo, hi = OPCODES.private_use
    if len(sent) >= 2 and (sent[0] != 1 or (sent[1] not in codec.BY_OPCODE and not lo <= sent[1] <= hi)
                           or sent[1] in (OP["HELLO"], OP["HELLO_ACK"], OP["COMPLETION"])):
        out.append(Finding("ok-unparseable", f"OK for version {sent[0]} opcode 0x{sent[1]:02x}", evidence=ev))
        return out
    if req is None:
        if len(sent) < 24:
            out.append(Finding("ok-unparseable", f"OK for a {len(sent)}-octet request", evidence=ev))
        return out
    op, handle = req["opcode"], req["handle"]
    if op == OP["STORE"] and any(handle in s.guards for s in (own, world.peer)):
        out.append(Finding("ok-sealed", f"OK for STORE to sealed block 0x{handle:x}", evidence=ev))
    if op in OWN_RANGE_OPS and not own.owns(handle):
        out.append(Finding("ok-outside-range", f"OK for {OPCODES.describe(op)} on handle 0x{handle:x} "
                           f"outside the granted range 0x{own.base:x}+{own.count}", evidence=ev))
    fields = own.ini.target.fields
    if op == OP["LOAD"] and "table_base_handle" in fields:
        first = fields["table_base_handle"]
        if not first <= handle < first + fields["table.count"]:
            out.append(Finding("ok-outside-range", f"OK for LOAD of handle 0x{handle:x} outside the "
                               f"table the target announced", evidence=ev))
    info = own.ini.target
    if op in (OP["STORE"], OP["ALLOC_STORE"]) and req.get("dd.length", 0) > info.block_size:
        out.append(Finding("ok-too-large", f"OK for a store of {req['dd.length']} octets, Block Size "
                           f"{info.block_size}", evidence=ev))
    if op == OP["LOAD"] and c["completion.data_length"] > req.get("dd.length", 0):
        out.append(Finding("ok-too-large", f"LOAD wrote {c['completion.data_length']} octets into a "
                           f"{req.get('dd.length', 0)}-octet buffer", evidence=ev))
    if op in (OP["LOAD"], OP["STORE"]) and req["generation"] and c["generation"] != req["generation"]:
        out.append(Finding("ok-generation", f"OK for generation {req['generation']}, the entry has "
                           f"{c['generation']}", evidence=ev))
    if op in (OP["LOAD"], OP["STORE"], OP["ALLOC_STORE"], OP["BIND"]) and c["generation"] == 0:
        out.append(Finding("ok-generation", "OK with generation 0 for a bound entry", evidence=ev))
    if op == OP["BIND"] and (req["bind.ticket"], req["bind.block_offset"]) not in allowed_blocks:
        out.append(Finding("ok-forged-bind", f"BIND of ticket {req['bind.ticket']} block "
                           f"0x{req['bind.block_offset']:x} that no slot gave this session", evidence=ev))
    return out


async def liveness(world: World) -> list[Finding]:
    """A fresh HELLO on a new connection must be answered (any status)."""
    try:
        ini = await asyncio.wait_for(world.connect(secrets.token_bytes(16), features=0), LIVENESS_TIMEOUT)
    except KbtpError:
        return []
    except (OSError, ConnectionLost, RemoteError, asyncio.TimeoutError) as exc:
        return [Finding("liveness", f"no HELLO_ACK to a fresh HELLO ({type(exc).__name__}: {exc})")]
    try:
        await asyncio.wait_for(ini.goodbye(release=True), LIVENESS_TIMEOUT)
    except asyncio.TimeoutError:
        await ini.close()
    return []


async def known_loads(world: World) -> list[Finding]:
    """Every guard block (own and peer) loads back unchanged, with its Generation."""
    out = []
    for s in (world.own, world.peer):
        for handle, g in s.guards.items():
            try:
                r = await asyncio.wait_for(world.own.ini.load(handle), LIVENESS_TIMEOUT)
            except KbtpError as exc:
                out.append(Finding("data-changed", f"guard 0x{handle:x} no longer loads: {exc.name}"))
                continue
            except asyncio.TimeoutError:
                out.append(Finding("liveness", f"no completion for a LOAD of guard 0x{handle:x}"))
                continue
            if r.data != g.data or r.generation != g.generation:
                out.append(Finding("data-changed", f"guard 0x{handle:x} loads back changed "
                                   f"(generation {g.generation} -> {r.generation}, "
                                   f"{len(g.data)} -> {len(r.data)} octets)"))
    return out


async def table_invariants(world: World) -> list[Finding]:
    """With DIRECT_LOAD: no block bound twice, guards as stored; with DIRECT_ALLOC also no
    block both free in the ring and bound."""
    ini, f = world.own.ini, world.own.ini.target.fields
    if "table.stag" not in f:
        return []
    raw = await ini.qp.read(f["table.stag"], f["table.offset"], f["table.count"] * M.ENTRY_SIZE)
    size, blocks = ini.target.block_size, f["pool.count"]
    where: Counter[int] = Counter()
    out = []
    entries = {}
    for i in range(f["table.count"]):
        e = codec.decode_struct(M.TABLE_ENTRY, raw[i * M.ENTRY_SIZE:(i + 1) * M.ENTRY_SIZE], ini.addr_le)
        handle = f["table_base_handle"] + i
        entries[handle] = e
        if e["entry.flags"] & VALID:
            where[e["entry.block_offset"]] += 1
            off = e["entry.block_offset"]
            rel = off - f["pool.offset"]        # Block Offsets are Tagged Offsets of the Pool STag
            if rel % size or not 0 <= rel < blocks * size:
                out.append(Finding("invariant", f"handle 0x{handle:x} bound to 0x{off:x}, not a block of the pool"))
    for off, n in where.items():
        if n > 1:
            out.append(Finding("invariant", f"block 0x{off:x} bound by {n} table entries"))
    for s in (world.own, world.peer):
        for handle, g in s.guards.items():
            e = entries.get(handle)
            want = (VALID | SEALED, g.generation, len(g.data))
            if e is not None and (e["entry.flags"] & (VALID | SEALED), e["entry.generation"],
                                  e["entry.data_length"]) != want:
                out.append(Finding("invariant", f"table entry of guard 0x{handle:x} is {e}"))
    if "ring.stag" in f:
        out += await _ring(world, where)
    return out


async def _ring(world: World, bound: Counter[int]) -> list[Finding]:
    ini, f = world.own.ini, world.own.ini.target.fields
    head = await ini.qp.fetch_add(f["head.stag"], f["head.offset"], 0, 0 if ini.qp.masked_atomics else None)
    ticket = head >> 32
    raw = await ini.qp.read(f["ring.stag"], f["ring.offset"], f["ring.count"] * M.SLOT_SIZE)
    free: Counter[int] = Counter()
    for i in range(f["ring.count"]):
        slot = codec.decode_struct(M.RING_SLOT, raw[i * M.SLOT_SIZE:(i + 1) * M.SLOT_SIZE], ini.addr_le)
        seq, off = slot["slot.sequence"], slot["slot.block_offset"]
        if off != M.SLOT_CONSUMED and (seq - ticket) & 0xFFFFFFFF < f["ring.count"]:
            free[off] += 1
    out = []
    for off, n in free.items():
        if n > 1:
            out.append(Finding("invariant", f"block 0x{off:x} free in {n} ring slots"))
        if bound[off]:
            out.append(Finding("invariant", f"block 0x{off:x} is free in the ring and bound"))
    return out
