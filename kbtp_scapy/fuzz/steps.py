"""The kinds of step a case is made of, each acting on the live sessions.

``mutate``: one request through a mutator; ``valid``: a well-formed request, or a
direct-mode load or allocation, on a scratch handle; ``rdma``: an RDMA access to an STag
never granted, or a FetchAdd on Head with wrong operands; ``burst``: as many requests
as credits at once, then more; ``reconnect``: GOODBYE, then the session resumed; ``quota``: requests that fail
(which must use no quota), then ALLOC_STOREs up to the quota and one past it;
``abandon``: a ticket left unbound past its Ticket Timeout. Every request goes through
``Exchanger.request``, so the model judges them all.
"""
from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable
from dataclasses import replace
from typing import Any, cast

from .. import codec
from ..initiator import KbtpError
from ..ring import add_mask, masked_add
from ..rnic import Access
from ..rnic.memory import MemoryRegion
from ..rnic.qp import ConnectionLost, RemoteError
from ..tables import memory as M
from ..vocab import AnyMessage, Feature, Opcode, RequestFlag, Status
from . import fences
from .cases import Step
from .exchange import Exchanger, Reply
from .findings import Finding
from .model import ABANDONED_AFTER, GRACE, Ticket, is_block
from .mutators import MUTATORS, Context
from .state import NoAnswer, Session
from .tally import UNKNOWN_DATA

U64 = (1 << 64) - 1
MAX_FILL = 512            # a quota step sends at most this many ALLOC_STOREs
MAX_ABANDON_WAIT = 10.0   # seconds an abandon step may wait for the Ticket Timeout


class Steps(Exchanger):
    """Mixed into the runner."""

    async def within(self, aw: Awaitable, what: str) -> Any:
        """``aw``, or ``NoAnswer`` after the timeout."""
        try:
            return await asyncio.wait_for(aw, self.timeout)
        except TimeoutError:
            raise NoAnswer(f"{what}: no answer within {self.timeout:g} s, connection up") from None

    # -- well-formed requests ----------------------------------------------------------

    def _record(self, s: Session, values: dict[str, Any]) -> MemoryRegion:
        region, offset = fences.fenced(s.ini.memory, M.COMPLETION_RECORD.size)
        values.update({"flags": values["flags"] | RequestFlag.RECORD, "cd.stag": region.stag, "cd.offset": offset,
                       "cd.reserved": 0})
        return region

    def load_values(self, s: Session, h: int, *, length: int | None = None, allow_unsealed: bool = False,
                    record: bool = False, generation: int = 0) -> tuple[dict[str, Any], list[MemoryRegion]]:
        """A LOAD into a fresh buffer (Block Size octets unless told), with INVALIDATE
        unless it completes by a record, as the reference initiator sends it."""
        n = s.info.block_size if length is None else length
        buf, offset = fences.fenced(s.ini.memory, n)
        flags = (RequestFlag.ALLOW_UNSEALED if allow_unsealed else 0) | (0 if record else RequestFlag.INVALIDATE)
        values = {"opcode": Opcode.LOAD, "handle": h, "generation": generation, "flags": flags,
                  "dd.stag": buf.stag, "dd.offset": offset, "dd.length": n}
        return values, [buf] + ([self._record(s, values)] if record else [])

    def store_values(self, s: Session, op: str, h: int, data: bytes, *, seal: bool = False,
                     inline: bool | None = None, record: bool = False,
                     generation: int = 0) -> tuple[dict[str, Any], list[MemoryRegion]]:
        """STORE or ALLOC_STORE, inline when the data fits Max Inline unless told."""
        inline = len(data) <= s.info.max_inline if inline is None else inline
        values: dict[str, Any] = {"opcode": Opcode[op], "handle": h, "generation": generation,
                                  "flags": RequestFlag.SEAL if seal else 0}
        regions = []
        if inline:
            values.update({"flags": values["flags"] | RequestFlag.INLINE, "dd.stag": 0, "dd.offset": 0,
                           "dd.length": len(data), "inline_data": data})
        else:
            src = s.ini.memory.register(bytearray(data), Access.REMOTE_READ)
            regions.append(src)
            values.update({"dd.stag": src.stag, "dd.offset": 0, "dd.length": len(data)})
            values["flags"] |= 0 if record else RequestFlag.INVALIDATE
        return values, regions + ([self._record(s, values)] if record else [])

    def free_values(self, s: Session, h: int, *, record: bool = False,
                    generation: int = 0) -> tuple[dict[str, Any], list[MemoryRegion]]:
        values = {"opcode": Opcode.FREE, "handle": h, "generation": generation, "flags": 0}
        return values, [self._record(s, values)] if record else []

    async def call(self, s: Session, values: dict[str, Any], regions: list[MemoryRegion],
                   stored: bytes | None = None) -> Reply:
        """One request whose buffers are the initiator's for this request only."""
        try:
            return await self.request(s, cast(AnyMessage, values), stored=stored)
        finally:
            for region in regions:
                s.ini.memory.deregister(region.stag)

    async def bind(self, s: Session, h: int, ticket: int, length: int, block: int,
                   stored: bytes | None = None) -> Reply:
        return await self.request(s, {"opcode": Opcode.BIND, "handle": h, "generation": 0, "flags": 0,
                                      "bind.ticket": ticket, "bind.data_length": length,
                                      "bind.block_offset": block}, stored=stored)

    # -- handles -------------------------------------------------------------------------

    def resolve(self, sel: list, rng: random.Random) -> int:
        own, peer = self.world.own, self.world.peer
        role, arg = sel
        if role == "scratch":
            return self.world.scratch[arg]
        if role == "guard":
            return own.base + arg
        if role == "base":                  # a captured request's handle, moved to this session
            return (own.base + arg) & U64
        if role == "peer":
            return peer.base + arg
        f = own.info.fields
        table_end = f["table_base_handle"] + f["table.count"] if "table.count" in f else own.base + 64 * own.count
        return {"own_before": (own.base - 1) & U64, "own_first": own.base,
                "own_last": own.base + own.count - 1, "own_end": own.base + own.count,
                "peer_first": peer.base, "peer_last": peer.base + peer.count - 1,
                "table_end": table_end, "zero": 0, "max": U64,
                "random": rng.getrandbits(64)}[arg]

    def free_scratch(self) -> list[int]:
        own = self.world.own
        return [h for h in self.world.scratch if own.known.entry(h).bound is False]

    # -- mutated requests ----------------------------------------------------------------

    async def mutate(self, step: Step) -> list[Finding]:
        s = self.world.own
        ini, info = s.ini, s.info
        rng = random.Random(step["seed"])
        handle = self.resolve(step["handle"], rng)
        op = Opcode[step["op"]]
        regions = []
        values: dict[str, Any] = {"opcode": op, "request_id": self.rid(), "handle": handle,
                                  "generation": 0, "flags": 0}
        src = step.get("start")             # a request of the seed corpus
        size = min(src["size"], info.block_size) if src else rng.choice([1, 8, 64, 512])
        data = rng.randbytes(size)
        if op == Opcode.LOAD:
            r, offset = fences.fenced(ini.memory, info.block_size)
            regions.append(r)
            values.update({"flags": RequestFlag.ALLOW_UNSEALED, "dd.stag": r.stag, "dd.offset": offset,
                           "dd.length": info.block_size})
        elif op in (Opcode.STORE, Opcode.ALLOC_STORE):
            flags = RequestFlag.SEAL if rng.random() < 0.5 else 0
            if step["inline"]:
                values.update({"flags": flags | RequestFlag.INLINE, "dd.length": len(data), "inline_data": data})
            else:
                r = ini.memory.register(bytearray(data), Access.REMOTE_READ)
                regions.append(r)
                values.update({"flags": flags, "dd.stag": r.stag, "dd.offset": 0, "dd.length": len(data)})
        if step["record"] and op != Opcode.BIND:
            regions.append(self._record(s, values))
        if src:                             # its flags; RECORD only with the descriptor added
            values["flags"] = src["flags"] & ~RequestFlag.RECORD | values["flags"] & RequestFlag.RECORD
        taken: tuple[int, int] | None = None
        found: list[Finding] = []
        if op == Opcode.BIND:
            taken, found = await self.take(rng)
            ticket, block = taken or (s.known.next_ticket, next(iter(self.world.bound_blocks()), 0))
            values.update({"bind.ticket": ticket, "bind.data_length": 1, "bind.block_offset": block})
        ctx = Context(ini.addr_le, info.block_size, info.max_inline, self.world.lookup(handle).generation or 0,
                      sorted(self.world.bound_blocks()), s.known.next_ticket)
        payload, what = MUTATORS[step["family"]](values, rng, ctx)
        try:
            reply = await self.request(s, payload=payload)
        finally:
            for r in regions:
                ini.memory.deregister(r.stag)
        for f in reply.findings:
            f.evidence["mutation"] = what
        if taken is not None and s.alive and taken[0] in s.known.tickets:
            found += await self.bind_taken(*taken)
        return found + reply.findings

    # -- tickets (DIRECT_ALLOC) ----------------------------------------------------------

    def direct_alloc_granted(self, s: Session) -> bool:
        return bool(s.info.features & Feature.DIRECT_ALLOC) and "head.stag" in s.info.fields and not s.known.spoiled

    async def take(self, rng: random.Random | None) -> tuple[tuple[int, int] | None, list[Finding]]:
        """A real ticket and the block its slot holds, when DIRECT_ALLOC is granted (a
        random generator decides, for mutated BINDs, whether to take one at all)."""
        s = self.world.own
        if not self.direct_alloc_granted(s) or rng is not None and rng.random() < 0.4:
            return None, []
        loop, ini = asyncio.get_running_loop(), s.ini
        timeout = ini.target.ticket_timeout_ms / 1000
        within_quota = s.known.usage(loop.time(), timeout)[0] < ini.target.quota
        t0 = loop.time()
        ticket, offset = await self.within(ini.take_ticket(), "FetchAdd on Head")
        t1 = loop.time()
        s.known.next_ticket = ticket + 1
        try:
            block = await ini.wait_slot(ticket, offset, self.timeout)
        except KbtpError:
            s.known.lost[ticket] = Ticket(-1, t0, t1)
            self.world.spoiled = True            # it will be abandoned: start afresh after this case
            return None, [Finding("ticket", f"the slot of ticket {ticket} held no block within "
                                  f"{self.timeout:g} s, though the session was within its quota")
                          ] if within_quota else []
        s.known.tickets[ticket] = Ticket(block, t0, t1)
        f, size = ini.target.fields, ini.target.block_size
        if not is_block(block, f["partition.offset"], f["partition.count"], size):
            return (ticket, block), [Finding("block-offset", f"the slot of ticket {ticket} holds block 0x{block:x}, "
                                             f"outside the Partition 0x{f['partition.offset']:x}+"
                                             f"{f['partition.count']} blocks through which it is to be written")]
        return (ticket, block), []

    async def bind_taken(self, ticket: int, block: int) -> list[Finding]:
        """Bind a taken ticket to a free scratch handle, so it is never abandoned."""
        s, found = self.world.own, []
        if not self.free_scratch():
            found += (await self.call(s, *self.free_values(s, self.world.scratch[0]))).findings
        free = self.free_scratch()
        if not free:
            self.world.spoiled = True
            return found
        return found + (await self.bind(s, free[0], ticket, 0, block, b"")).findings

    # -- valid operations ----------------------------------------------------------------

    async def valid(self, step: Step) -> list[Finding]:
        s = self.world.own
        h = self.resolve(step["handle"], random.Random(0))
        e = s.known.entry(h)
        gen = e.generation if step.get("known_generation") and e.generation else 0
        record = step.get("record", False)
        data = bytes([step["fill"]]) * step["size"]
        op = step["op"]
        if op == "load":
            length = {"exact": e.length, "short": e.length - 1 if e.length else None}.get(step.get("buffer", "block"))
            values, regions = self.load_values(s, h, length=length, allow_unsealed=step.get("allow_unsealed", True),
                                               record=record, generation=gen)
        elif op in ("store", "alloc_store"):
            values, regions = self.store_values(s, op.upper(), h, data, seal=step["seal"], inline=step["inline"],
                                                record=record, generation=gen)
        elif op == "free":
            values, regions = self.free_values(s, h, record=record, generation=gen)
        elif op == "direct_load":
            return await self.direct_load(s, h)
        else:
            return await self.direct_alloc(s, h, data)
        return (await self.call(s, values, regions)).findings

    async def direct_load(self, s: Session, h: int) -> list[Finding]:
        """DIRECT_LOAD against the model: the entry, the block and its Block Offset."""
        e = s.known.entry(h)
        if "table.stag" not in s.info.fields or e.bound is None:
            return []
        try:
            r = await self.within(s.ini.direct_load(h), f"DIRECT_LOAD of 0x{h:x}")
        except KbtpError as exc:
            if e.bound and e.sealed and exc.name in ("NOT_VALID", "NOT_SEALED"):
                return [Finding("invariant", f"DIRECT_LOAD of 0x{h:x}: {exc}, but {e.seen} showed it bound and sealed")]
            return []
        self.tally.judge("direct_load.entry")
        if e.bound and e.data is not None:
            self.tally.judge("direct_load.block")
        else:
            self.tally.cannot(UNKNOWN_DATA, "direct_load.block")
        seen = []
        if not e.bound:
            seen.append("VALID and SEALED")
        if e.generation is not None and r.generation != e.generation:
            seen.append(f"Generation {r.generation}, not {e.generation}")
        if e.bound and e.length is not None and r.data_length != e.length:
            seen.append(f"Data Length {r.data_length}, not {e.length}")
        elif e.bound and e.data is not None and r.data != e.data:
            seen.append("a block that differs from what was stored")
        if e.bound and e.block is not None and r.block_offset != e.block:
            return [Finding("block-offset", f"DIRECT_LOAD of 0x{h:x} reads Block Offset 0x{r.block_offset:x}; "
                            f"{e.seen} showed 0x{e.block:x}")]
        if seen:
            return [Finding("data-changed" if e.bound else "invariant", f"DIRECT_LOAD of 0x{h:x} reads "
                            + ", ".join(seen) + f" ({e.seen} showed {'it bound' if e.bound else 'it unbound'})")]
        s.known.set(h, replace(e, sealed=True, generation=r.generation, length=r.data_length, data=r.data,
                               block=r.block_offset, seen=f"a DIRECT_LOAD of 0x{h:x}"))
        return []

    async def direct_alloc(self, s: Session, h: int, data: bytes) -> list[Finding]:
        """FetchAdd on Head, the slot read, the data written through the Partition STag, BIND."""
        if not self.direct_alloc_granted(s) or s.known.entry(h).bound is not False or len(data) > s.info.block_size:
            return []
        taken, found = await self.take(None)
        if taken is None:
            return found
        ticket, block = taken
        if data:
            await self.within(s.ini.qp.write(s.info.fields["partition.stag"], block, data),
                              "RDMA Write into the partition")
        return found + (await self.bind(s, h, ticket, len(data), block, data)).findings

    # -- RDMA accesses -------------------------------------------------------------------

    async def rdma(self, step: Step) -> list[Finding]:
        w = self.world
        ini = w.own.ini
        rng = random.Random(step["seed"])
        f, pf = ini.target.fields, w.peer.ini.target.fields
        own_stags = {v for k, v in f.items() if k.endswith(".stag")}
        what, verb = step["what"], step["verb"]
        size = ini.target.block_size
        if what == "head_wrong_add":
            return await self.wrong_add(rng)
        if what == "random_stag" or not own_stags:
            stag = rng.getrandbits(32)
            if stag in own_stags:
                return []
            offset, why = rng.choice([0, rng.getrandbits(16)]), f"STag 0x{stag:x} never granted"
        elif what == "peer_stag":
            stags = sorted({v for k, v in pf.items() if k.endswith(".stag")} - own_stags)
            if not stags:
                return []
            stag, offset, why = rng.choice(stags), 0, "an STag granted to the other session"
        elif what == "read_only_write":
            names = [n for n in ("table", "pool", "ring") if f"{n}.stag" in f]
            name = rng.choice(names)
            stag, offset = f[f"{name}.stag"], f[f"{name}.offset"]
            verb = rng.choice(["write", "fetch_add"])
            why = f"{verb} on the read-only {name} STag"
        else:
            names = [n for n in ("table", "pool", "ring", "partition") if f"{n}.stag" in f]
            name = rng.choice(names)
            unit = {"table": M.ENTRY_SIZE, "ring": M.SLOT_SIZE}.get(name, size)
            stag = f[f"{name}.stag"]
            inside = rng.choice([0, 8])
            offset = f[f"{name}.offset"] + f[f"{name}.count"] * unit - inside
            length = inside + rng.choice([1, 16, 64])
            verb = "write" if name == "partition" else "read"
            why = f"{verb} of {length} octets {inside} before the end of the {name} region"
        if what != "out_of_bounds" or not own_stags:    # the out-of-bounds branch sets its own
            length = rng.choice([1, 16, 64])
        got = await self.carried_out(verb, stag, offset, length, rng)
        if got is None:
            return []
        return [Finding("rdma-ungranted", f"RDMA {why} was carried out",
                        evidence={"stag": stag, "offset": offset, "verb": verb,
                                  "result": got.hex() if isinstance(got, bytes) else got})]

    async def carried_out(self, verb: str, stag: int, offset: int, length: int, rng: random.Random) -> Any:
        """The result of an RDMA access the target must refuse, or None when it did."""
        ini = self.world.own.ini
        self.tally.judge(f"rdma.{verb}.refused")
        try:
            if verb == "read":
                fut = ini.qp.read(stag, offset, length)
            elif verb == "write":
                fut = ini.qp.write(stag, offset, rng.randbytes(length))
            else:
                fut = ini.qp.fetch_add(stag, offset & ~7, rng.getrandbits(64),
                                       rng.getrandbits(64) if ini.qp.masked_atomics else None)
            got = await self.within(fut, f"RDMA {verb} of STag 0x{stag:x}")
            if verb == "write":        # unacknowledged on iWARP: a Terminate would come first
                await self.within(self._flush(), "a LOAD after an RDMA Write")
        except (RemoteError, ConnectionLost):
            return None
        return got if got is not None else b""

    async def _flush(self) -> None:
        """A round trip on the connection (a LOAD, whatever its status)."""
        s = self.world.own
        try:
            await s.ini.load(next(iter(s.guards)), allow_unsealed=True)
        except KbtpError:
            pass

    async def wrong_add(self, rng: random.Random) -> list[Finding]:
        """FetchAdd on our Head with wrong Add Data or Add Mask, then an add that puts the
        counter back (a trusted initiator's slip; the target cannot undo it for us). The
        session's tickets and quota use are unknown from here: start afresh after the case."""
        s = self.world.own
        ini, f = s.ini, s.info.fields
        if "head.stag" not in f:
            return []
        s.known.spoiled, self.world.spoiled = True, True
        n = (f["ring.count"] - 1).bit_length()
        add = rng.choice([0x10, 0x0000000100000000, 0x0000000200000010, 0xFFFFFFFFFFFFFFFF,
                          0x0000000100000008, rng.getrandbits(64)])
        masked = ini.qp.masked_atomics
        mask = rng.choice([0, add_mask(n) ^ (1 << (n + 3)), U64, rng.getrandbits(64)]) if masked else None
        v = await self.within(ini.qp.fetch_add(f["head.stag"], f["head.offset"], add, mask or None
                                               if masked else None), "FetchAdd on Head")
        new = masked_add(v, add, mask) if masked and mask else (v + add) & U64
        await self.within(ini.qp.fetch_add(f["head.stag"], f["head.offset"], (v - new) & U64, None),
                          "FetchAdd on Head")
        return []

    # -- more requests than credits ------------------------------------------------------

    async def burst(self, step: Step) -> list[Finding]:
        """As many LOADs at once as the HELLO_ACK's Request Credits (the receive buffers
        the target posted): all answered, the connection up; then more than the credits."""
        s = self.world.own
        ini = s.ini
        credits = ini.target.request_credits
        region, offset = fences.fenced(ini.memory, ini.target.block_size)
        try:
            answered, out = await self._flood(s, credits, region, offset)
            if answered < credits:
                return out + [Finding("credits", f"{credits} LOADs at once, within the {credits} Request "
                                      f"Credits of the HELLO_ACK: {answered} answered, then "
                                      + ("the connection ended" if ini.qp.closed else "no more, connection up"))]
            count = credits + step["extra"]
            answered, found = await self._flood(s, count, region, offset)
            out += found
            if answered < count and not ini.qp.closed:
                out.append(Finding("no-answer", f"{count - answered} of {count} requests of a burst "
                                   f"beyond the credits unanswered, connection up"))
        finally:
            ini.memory.deregister(region.stag)
        return out

    async def _flood(self, s: Session, count: int, region: MemoryRegion, offset: int) -> tuple[int, list[Finding]]:
        """``count`` LOADs of a guard into ``region`` sent back to back, each answer judged:
        how many were answered before the connection ended or the time ran out."""
        ini, loop = s.ini, asyncio.get_running_loop()
        h = next(iter(s.guards))
        out = self.stray(s)
        sent = {}
        before: fences.Snapshot = {}
        for _ in range(count):
            rid = self.rid()
            payload = codec.encode({"opcode": Opcode.LOAD, "request_id": rid, "handle": h, "flags": 0,
                                    "dd.stag": region.stag, "dd.offset": offset,
                                    "dd.length": ini.target.block_size}, ini.addr_le)
            sent[rid] = (payload, *self.expectation(s, payload)[:2])
            before = before or fences.snapshot(ini.memory, sent[rid][1])
            ini.qp.send(payload)
        deadline = loop.time() + self.timeout + 1
        seen: set[int] = set()
        while len(seen) < count and not ini.qp.closed and loop.time() < deadline:
            try:
                msg = await asyncio.wait_for(ini.unmatched.get(), 0.05)
            except TimeoutError:
                continue
            try:
                answered = codec.decode(msg.payload, ini.addr_le)["request_id"]
            except codec.Malformed:
                answered = None
            if answered not in sent or answered in seen:
                out.append(Finding("request-id", f"answer with Request ID {answered} in a burst",
                                   evidence={"answer": msg.payload.hex()}))
                continue
            seen.add(answered)
            payload, req, x = sent[answered]
            out += self.judged(s, x, req, payload, msg, loop.time(), before=before)[1]
        return len(seen), out

    # -- the quota -----------------------------------------------------------------------

    async def quota(self, step: Step) -> list[Finding]:
        """Requests that fail must use no quota ("a failed check ... has no other
        effect"); then ALLOC_STOREs until the quota is used, and one more, which must
        complete NO_SPACE; then FREEs of what they bound."""
        s = self.world.own
        k, info, loop = s.known, s.info, asyncio.get_running_loop()
        if k.spoiled or k.tickets or k.lost:
            return []
        for h, e in list(k.entries.items()):          # learn what the model is unsure of, changing nothing
            if e.bound is None:
                await self.call(s, *self.load_values(s, h, allow_unsealed=True))
        low, high = k.usage(loop.time(), info.ticket_timeout_ms / 1000)
        free = [h for h in range(s.base, s.base + s.count) if k.entry(h).bound is False and h not in s.guards]
        need = info.quota - low + 1
        if high != low or not free or need > MAX_FILL:
            return []
        rng, out = random.Random(step["seed"]), []
        for values, regions in self._failing(s, free, rng):
            out += (await self.call(s, values, regions)).findings
        bound = []
        for h in free[:need]:
            reply = await self.call(s, *self.store_values(s, "ALLOC_STORE", h, b"q" * rng.choice([1, 8]), inline=True))
            out += reply.findings
            if reply.status == Status.OK:
                bound.append(h)
            if reply.findings or reply.closed:
                break                                  # one is enough: the rest would repeat it
        for h in bound:
            if s.alive:
                out += (await self.call(s, *self.free_values(s, h))).findings
        return out

    def _failing(self, s: Session, free: list[int], rng: random.Random) -> list[tuple[dict, list]]:
        """An ALLOC_STORE too large, one to a bound guard, one with a stale Generation,
        one outside the range: each must fail, and use no quota."""
        bs = s.info.block_size
        big, regions = self.store_values(s, "ALLOC_STORE", rng.choice(free), bytes(bs + 1), inline=False)
        out = [(big, regions),
               self.store_values(s, "ALLOC_STORE", next(iter(s.guards)), b"bound", inline=True),
               self.store_values(s, "ALLOC_STORE", s.base + s.count, b"outside", inline=True)]
        h = rng.choice(free)
        gen = s.known.entry(h).generation
        if gen is not None:
            out.append(self.store_values(s, "ALLOC_STORE", h, b"stale", inline=True, generation=gen % 0xFFFF + 1))
        return out

    # -- an abandoned ticket -------------------------------------------------------------

    async def abandon(self, step: Step) -> list[Finding]:
        """Take a ticket and leave it unbound past the Ticket Timeout: a BIND for it must
        then be refused with TICKET_ABANDONED, and the Partition STag must no longer reach
        the block (or the connection must have ended)."""
        s = self.world.own
        timeout = s.info.ticket_timeout_ms / 1000
        wait = ABANDONED_AFTER * timeout + GRACE
        free = self.free_scratch()
        if not self.direct_alloc_granted(s) or not free or wait > MAX_ABANDON_WAIT:
            return []
        taken, out = await self.take(None)
        if taken is None:
            return out
        self.world.spoiled = True           # DIRECT_ALLOC ends for this session: start afresh after the case
        ticket, block = taken
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, s.known.tickets[ticket].seen + wait - loop.time()))
        reply = await self.bind(s, free[0], ticket, 0, block)
        out += reply.findings
        if reply.status != Status.TICKET_ABANDONED or not s.alive:
            return out
        got = await self.carried_out("write", s.info.fields["partition.stag"], block, 1, random.Random(ticket))
        if got is not None:
            out.append(Finding("ticket", f"after TICKET_ABANDONED for ticket {ticket}, an RDMA Write through the "
                               f"Partition STag still reached block 0x{block:x} (the target must invalidate the "
                               "STag or end the connection before reclaiming the block)"))
        return out

    # -- the guards ----------------------------------------------------------------------

    async def repair(self) -> list[Finding]:
        """Store ``own``'s guards again where a request freed or changed them (their own
        handles: the target was right to let it), so the next step finds them as before."""
        s, out = self.world.own, []
        for h, data in s.guards.items():
            if not s.alive:
                break
            e = s.known.entry(h)
            if e.bound is None or e.bound and e.data is None:
                out += (await self.call(s, *self.load_values(s, h, allow_unsealed=True))).findings
                e = s.known.entry(h)
            if e.bound and e.sealed and e.data == data:
                continue
            if e.bound is not False:
                out += (await self.call(s, *self.free_values(s, h))).findings
            out += (await self.call(s, *self.store_values(s, "ALLOC_STORE", h, data, seal=True))).findings
        return out

    async def known_loads(self) -> list[Finding]:
        """Every guard (each through its own session) loads back as stored, and so does
        every other handle the case left bound, without ALLOW_UNSEALED: an unsealed one
        must complete NOT_SEALED. The first of those whose Data Length is known goes into
        a buffer one octet too short: TOO_LARGE, judged against what the request asked,
        whatever length a target that truncates would report."""
        out = []
        for s in (self.world.own, self.world.peer):
            touched, s.known.touched = s.known.touched, set()
            bound = sorted(h for h in touched if s.known.entry(h).bound and h not in s.guards)
            short = next((h for h in bound if s.known.entry(h).length), None)
            for h in [*s.guards, *bound]:
                e = s.known.entry(h)
                length = e.length - 1 if h == short and e.length else None
                out += (await self.call(s, *self.load_values(s, h, length=length))).findings
        return out
