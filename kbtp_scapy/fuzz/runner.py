"""Running cases: steps against a live session, then the oracles; findings minimized.

One ``World`` (two sessions) serves many cases; a case that ends a connection is followed
by a reconnect with the same Initiator ID, and a case with a finding by fresh sessions.
"""
from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .. import codec
from ..initiator import KbtpError
from ..rnic import Access, parse_url
from ..rnic.qp import ConnectionLost, Received, RemoteError
from ..ring import add_mask, masked_add
from ..tables import memory as M
from ..tables.enums import FEATURES, OPCODES, REQUEST_FLAGS, flag
from .cases import Case, Step
from .mutators import MUTATORS, Context
from .oracles import Finding, check_completion, known_loads, liveness, table_invariants
from .state import GUARDS, Block, HarnessError, Lost, Rebuild, World

OP = OPCODES.by_name()
F = {f.name: f.value for f in REQUEST_FLAGS.flags}
DIRECT_ALLOC = flag(FEATURES, "DIRECT_ALLOC")
REPLY_TIMEOUT = 2.0
OP_TIMEOUT = 5.0
U64 = (1 << 64) - 1


@dataclass
class CaseResult:
    case: Case
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    duration: float = 0.0


class Runner:
    def __init__(self, url: str, options: dict, frame_listeners: list | None = None) -> None:
        parse_url(url)
        self.url, self.options = url, options
        self.frame_listeners = frame_listeners
        self.world: World | None = None
        self._rids = itertools.count(0x4B46_0000_0000_0001)
        self.families: dict[str, int] = {}

    async def start(self) -> None:
        self.world = World(self.url, self.options, self.frame_listeners)
        await self.world.open()

    async def restart(self) -> None:
        await self.world.close(release=True)
        await self.start()

    async def stop(self) -> None:
        if self.world is not None:
            await self.world.close(release=True)

    # -- a case --------------------------------------------------------------------------

    async def run_case(self, case: Case, steps: list[Step] | None = None) -> CaseResult:
        """Run the steps (default: the case's), then the oracles."""
        result = CaseResult(case)
        t0 = time.monotonic()
        w = self.world
        for i, step in enumerate(case.steps if steps is None else steps):
            try:
                await w.ensure()
                found = await self._step(step, result)
            except Rebuild as exc:
                result.notes.append(str(exc))
                await self.restart()
                w = self.world
                continue
            except Lost as exc:
                result.findings.append(Finding("liveness", str(exc), i))
                break
            except (ConnectionLost, RemoteError) as exc:
                result.notes.append(f"step {i}: connection ended ({exc})")
                continue
            for f in found:
                f.step = i
            result.findings += found
        if not any(f.kind == "liveness" for f in result.findings):
            result.findings += await self._oracles(result)
        result.duration = time.monotonic() - t0
        return result

    async def _oracles(self, result: CaseResult) -> list[Finding]:
        w = self.world
        out = await liveness(w)
        if out:
            return out
        for attempt in range(2):
            try:
                await w.ensure()
                out += self._stray()
                out += await known_loads(w)
                out += await table_invariants(w)
                return out
            except Rebuild as exc:
                result.notes.append(str(exc))
                await self.restart()
                w = self.world
            except Lost as exc:
                return out + [Finding("liveness", str(exc))]
            except (ConnectionLost, RemoteError) as exc:
                result.notes.append(f"oracle: connection ended ({exc})")
        return out

    def _stray(self) -> list[Finding]:
        """Answers nobody asked for (a duplicate completion, a made-up Request ID)."""
        out = []
        q = self.world.own.ini.unmatched
        while not q.empty():
            msg = q.get_nowait()
            out.append(Finding("request-id", "an answer no request was waiting for",
                               evidence={"payload": msg.payload.hex(), "imm": msg.imm}))
        return out

    async def _step(self, step: Step, result: CaseResult) -> list[Finding]:
        kind = step["kind"]
        self.families[kind if kind != "mutate" else f"mutate.{step['family']}"] = \
            self.families.get(kind if kind != "mutate" else f"mutate.{step['family']}", 0) + 1
        if kind == "mutate":
            return await self._mutate(step)
        if kind == "valid":
            return await self._valid(step)
        if kind == "rdma":
            return await self._rdma(step, result)
        if kind == "burst":
            return await self._burst(step)
        if kind == "reconnect":
            await asyncio.wait_for(self.world.own.ini.goodbye(release=False), OP_TIMEOUT)
            return []
        raise HarnessError(f"unknown step kind {kind!r}")

    # -- handles -------------------------------------------------------------------------

    def resolve(self, sel: list, rng: random.Random) -> int:
        w = self.world
        own, peer = w.own, w.peer
        role, arg = sel
        if role == "scratch":
            return own.base + GUARDS + arg
        if role == "guard":
            return own.base + arg
        if role == "peer":
            return peer.base + arg
        f = own.ini.target.fields
        table_end = f["table_base_handle"] + f["table.count"] if "table.count" in f else own.base + 64 * own.count
        return {"own_before": (own.base - 1) & U64, "own_first": own.base,
                "own_last": own.base + own.count - 1, "own_end": own.base + own.count,
                "peer_first": peer.base, "peer_last": peer.base + peer.count - 1,
                "table_end": table_end, "zero": 0, "max": U64,
                "random": rng.getrandbits(64)}[arg]

    def _generation(self, handle: int) -> int:
        w = self.world
        for s in (w.own, w.peer):
            if handle in s.guards:
                return s.guards[handle].generation
        b = w.scratch.get(handle)
        return b.generation if b is not None else 0

    # -- mutated requests ----------------------------------------------------------------

    async def _mutate(self, step: Step) -> list[Finding]:
        w = self.world
        ini, info = w.own.ini, w.own.ini.target
        rng = random.Random(step["seed"])
        handle = self.resolve(step["handle"], rng)
        op = OP[step["op"]]
        regions = []
        values: dict[str, Any] = {"opcode": op, "request_id": next(self._rids), "handle": handle,
                                  "generation": 0, "flags": 0}
        data = rng.randbytes(rng.choice([1, 8, 64, 512]))
        if op == OP["LOAD"]:
            r = ini.memory.register(bytearray(info.block_size), Access.REMOTE_WRITE)
            regions.append(r)
            values.update({"flags": F["ALLOW_UNSEALED"], "dd.stag": r.stag, "dd.offset": 0,
                           "dd.length": info.block_size})
        elif op in (OP["STORE"], OP["ALLOC_STORE"]):
            flags = F["SEAL"] if rng.random() < 0.5 else 0
            if step["inline"]:
                values.update({"flags": flags | F["INLINE"], "dd.length": len(data), "inline_data": data})
            else:
                r = ini.memory.register(bytearray(data), Access.REMOTE_READ)
                regions.append(r)
                values.update({"flags": flags, "dd.stag": r.stag, "dd.offset": 0, "dd.length": len(data)})
        record = None
        if step["record"] and op != OP["BIND"]:
            record = ini.memory.register(bytearray(M.COMPLETION_RECORD.size), Access.REMOTE_WRITE)
            regions.append(record)
            values.update({"flags": values["flags"] | F["RECORD"], "cd.stag": record.stag,
                           "cd.offset": 0, "cd.reserved": 0})
        taken = None
        if op == OP["BIND"]:
            taken = await self._take(rng)
            ticket, block = taken or (w.next_ticket, next(iter(w.bound.values()), 0))
            values.update({"bind.ticket": ticket, "bind.data_length": 1, "bind.block_offset": block})
        ctx = Context(ini.addr_le, info.block_size, info.max_inline, self._generation(handle),
                      sorted(set(w.bound.values())), w.next_ticket)
        payload, what = MUTATORS[step["family"]](values, rng, ctx)
        try:
            found = await self._exchange(payload, record)
        finally:
            for r in regions:
                ini.memory.deregister(r.stag)
        for f in found:
            f.evidence["mutation"] = what
        if taken is not None and w.own.alive and taken[0] in w.tickets:
            await self._bind_taken(*taken)
        return found

    async def _exchange(self, payload: bytes, record) -> list[Finding]:
        """Send one request; judge its answer; update what is known."""
        w = self.world
        ini = w.own.ini
        out = self._stray()
        try:
            req = codec.decode(payload, ini.addr_le)
            head = req
        except codec.Malformed as bad:
            req, head = None, bad.fields
        await ini.qp.send(payload)
        getter = asyncio.ensure_future(ini.unmatched.get())
        closed = asyncio.ensure_future(ini.qp.wait_closed())
        done, _ = await asyncio.wait({getter, closed}, timeout=REPLY_TIMEOUT,
                                     return_when=asyncio.FIRST_COMPLETED)
        closed.cancel()
        if getter not in done:
            getter.cancel()
            if ini.qp.closed or (len(payload) > 1 and payload[1] == OP["GOODBYE"]):
                await w.ensure()                    # it may have acted before the end
                await self._learn_effect(head, {})
                return out
            return out + [Finding("no-answer", f"no completion within {REPLY_TIMEOUT} s, connection up",
                                  evidence={"sent": payload.hex()})]
        msg: Received = getter.result()
        if msg.write_imm:
            if record is None:
                return out + [Finding("request-id", "a completion record for a request without RECORD",
                                      evidence={"sent": payload.hex()})]
            d = codec.decode_struct(M.COMPLETION_RECORD, bytes(record.view), ini.addr_le)
            c = {"opcode": OP["COMPLETION"], "request_id": d["record.request_id"],
                 "status": d["record.status"], "generation": d["record.generation"],
                 "completion.data_length": d["record.data_length"],
                 "completion.block_offset": d["record.block_offset"], "handle": head.get("handle", 0)}
        else:
            try:
                c = codec.decode(msg.payload, ini.addr_le)
            except codec.Malformed as bad:
                return out + [Finding("answer-malformed", f"answer cannot be parsed: {bad}",
                                      evidence={"sent": payload.hex(), "answer": msg.payload.hex()})]
            if c["opcode"] != OP["COMPLETION"]:
                return out + [Finding("answer-malformed", f"answer is {OPCODES.describe(c['opcode'])}",
                                      evidence={"sent": payload.hex(), "answer": msg.payload.hex()})]
        allowed = set(w.tickets.items())
        out += check_completion(w, payload, req, c, allowed)
        if c["status"] == 0:
            await self._learn_effect(head, c)
        return out

    async def _learn_effect(self, head: dict[str, Any], c: dict[str, Any]) -> None:
        """An OK for a mutated request: forget what it may have changed; re-create an own
        guard that it freed (its own handle: the target was right to)."""
        w = self.world
        handles = {head.get("handle"), c.get("handle")}
        for h in handles:
            w.forget(h)
            w.bound.pop(h, None)
        if head.get("opcode") == OP["BIND"]:
            w.tickets.pop(head.get("bind.ticket"), None)
        for h in [h for h in handles if h in w.own.guards]:
            try:
                r = await asyncio.wait_for(w.own.ini.load(h), OP_TIMEOUT)
                if r.data == w.own.guards[h].data and r.generation == w.own.guards[h].generation:
                    continue
            except KbtpError:
                pass
            try:
                await asyncio.wait_for(w.own.ini.free(h), OP_TIMEOUT)
            except KbtpError:
                pass
            data = w.own.guards[h].data
            r = await asyncio.wait_for(w.own.ini.alloc_store(h, data, seal=True), OP_TIMEOUT)
            w.own.guards[h] = Block(data, r.generation)

    # -- tickets (DIRECT_ALLOC) ----------------------------------------------------------

    def _direct_alloc(self) -> bool:
        return "head.stag" in self.world.own.ini.target.fields

    async def _take(self, rng: random.Random) -> tuple[int, int] | None:
        """A real ticket and the block its slot holds, when DIRECT_ALLOC is granted."""
        w = self.world
        if not self._direct_alloc() or rng.random() < 0.4:
            return None
        ini = w.own.ini
        try:
            ticket, offset = await asyncio.wait_for(ini.take_ticket(), OP_TIMEOUT)
            block = await ini.wait_slot(ticket, offset, 0.5)
        except KbtpError:
            return None
        w.tickets[ticket] = block
        w.next_ticket = ticket + 1
        return ticket, block

    async def _bind_taken(self, ticket: int, block: int) -> None:
        """Bind a taken ticket to a free scratch handle, so it is never abandoned."""
        w = self.world
        free = [h for h, b in w.scratch.items() if b is not None and b.data is None]
        if not free:
            h = next(iter(w.scratch))
            try:
                await w.own.ini.free(h)
            except KbtpError:
                pass
            free = [h]
        try:
            r = await asyncio.wait_for(w.own.ini.bind(free[0], ticket, 0, block), OP_TIMEOUT)
            w.scratch[free[0]] = Block(b"", r.generation, None)   # sealed or not: the text is silent
            w.bound[free[0]] = block
        except KbtpError:
            w.forget(free[0])
        w.tickets.pop(ticket, None)

    # -- valid operations and the model ----------------------------------------------------

    async def _valid(self, step: Step) -> list[Finding]:
        w = self.world
        ini = w.own.ini
        h = self.resolve(step["handle"], random.Random(0))
        data = bytes([step["fill"]]) * step["size"]
        known = w.scratch.get(h)
        op = step["op"]
        try:
            if op == "load":
                r = await asyncio.wait_for(ini.load(h, allow_unsealed=True), OP_TIMEOUT)
                return self._compare(h, known, r.data, r.generation, "LOAD")
            if op == "direct_load":
                if "table.stag" not in ini.target.fields or known is None or not known.sealed:
                    return []
                r = await asyncio.wait_for(ini.direct_load(h), OP_TIMEOUT)
                return self._compare(h, known, r.data, r.generation, "DIRECT_LOAD")
            if op == "store":
                r = await asyncio.wait_for(ini.store(h, data, seal=step["seal"], inline=step["inline"]),
                                           OP_TIMEOUT)
                bad = [] if known is None or (known.data is not None and known.sealed is not True) else \
                    [Finding("ok-state", f"STORE OK on 0x{h:x}, which the wire showed "
                             f"{'unbound' if known.data is None else 'sealed'}")]
                w.scratch[h] = Block(data, r.generation, step["seal"] or None)
                return bad
            if op == "alloc_store":
                r = await asyncio.wait_for(ini.alloc_store(h, data, seal=step["seal"], inline=step["inline"]),
                                           OP_TIMEOUT)
                bad = [] if known is None or known.data is None else \
                    [Finding("ok-state", f"ALLOC_STORE OK on 0x{h:x}, which the wire showed bound")]
                w.scratch[h] = Block(data, r.generation, step["seal"])
                w.bound[h] = r.block_offset
                return bad
            if op == "free":
                r = await asyncio.wait_for(ini.free(h), OP_TIMEOUT)
                bad = [] if known is None or known.data is not None else \
                    [Finding("ok-state", f"FREE OK on 0x{h:x}, which the wire showed unbound")]
                w.scratch[h] = Block(None, r.generation)
                w.bound.pop(h, None)
                return bad
            if op == "direct_alloc":
                if not self._direct_alloc() or known is None or known.data is not None:
                    return []
                r = await asyncio.wait_for(ini.direct_alloc(h, data), OP_TIMEOUT)
                w.scratch[h] = Block(data, r.generation, None)
                w.bound[h] = r.block_offset
                return []
        except KbtpError as exc:
            return self._refused(h, known, op, exc)
        return []

    def _compare(self, h: int, known: Block | None, data: bytes, generation: int, how: str) -> list[Finding]:
        w = self.world
        if known is not None and known.data is not None and (data != known.data or generation != known.generation):
            return [Finding("data-changed", f"{how} of 0x{h:x}: {len(data)} octets generation {generation}, "
                            f"stored {len(known.data)} octets generation {known.generation}")]
        if known is not None and known.data is None:
            return [Finding("ok-state", f"{how} OK of 0x{h:x}, which the wire showed unbound")]
        w.scratch[h] = Block(data, generation, known.sealed if known else None)
        return []

    def _refused(self, h: int, known: Block | None, op: str, exc: KbtpError) -> list[Finding]:
        """A refusal of a valid request must agree with what the wire showed of the handle."""
        if known is None:
            return []
        if exc.name == "NOT_VALID" and known.data is not None:
            return [Finding("data-changed", f"{op} of 0x{h:x}: NOT_VALID, but it was stored")]
        if exc.name == "ALREADY_BOUND" and known.data is None and op == "alloc_store":
            return [Finding("data-changed", f"ALLOC_STORE of 0x{h:x}: ALREADY_BOUND, but it was freed")]
        if exc.name in ("INTERNAL", "TICKET_ABANDONED", "NO_SPACE") and op == "direct_alloc":
            self.world.forget(h)
        return []

    # -- RDMA accesses -------------------------------------------------------------------

    async def _rdma(self, step: Step, result: CaseResult) -> list[Finding]:
        w = self.world
        ini = w.own.ini
        rng = random.Random(step["seed"])
        f, pf = ini.target.fields, w.peer.ini.target.fields
        own_stags = {v for k, v in f.items() if k.endswith(".stag")}
        what, verb = step["what"], step["verb"]
        size = ini.target.block_size
        if what == "head_wrong_add":
            return await self._wrong_add(rng, result)
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
        if what != "out_of_bounds":
            length = rng.choice([1, 16, 64])
        try:
            if verb == "read":
                fut = ini.qp.read(stag, offset, length)
            elif verb == "write":
                fut = ini.qp.write(stag, offset, rng.randbytes(length))
            else:
                fut = ini.qp.fetch_add(stag, offset & ~7, rng.getrandbits(64),
                                       rng.getrandbits(64) if ini.qp.masked_atomics else None)
            got = await asyncio.wait_for(fut, OP_TIMEOUT)
            if verb == "write":        # unacknowledged on iWARP: a Terminate would come first
                await asyncio.wait_for(ini.load(next(iter(w.own.guards))), OP_TIMEOUT)
        except (RemoteError, ConnectionLost):
            return []
        except asyncio.TimeoutError:
            return [Finding("no-answer", f"RDMA {why}: neither done nor refused within {OP_TIMEOUT} s")]
        return [Finding("rdma-ungranted", f"RDMA {why} was carried out",
                        evidence={"stag": stag, "offset": offset, "verb": verb,
                                  "result": got.hex() if isinstance(got, bytes) else got})]

    async def _wrong_add(self, rng: random.Random, result: CaseResult) -> list[Finding]:
        """FetchAdd on our Head with wrong Add Data or Add Mask, then an add that puts the
        counter back (a trusted initiator's slip; the target cannot undo it for us)."""
        ini = self.world.own.ini
        f = ini.target.fields
        if "head.stag" not in f:
            return []
        n = (f["ring.count"] - 1).bit_length()
        add = rng.choice([0x10, 0x0000000100000000, 0x0000000200000010, 0xFFFFFFFFFFFFFFFF,
                          0x0000000100000008, rng.getrandbits(64)])
        masked = ini.qp.masked_atomics
        mask = rng.choice([0, add_mask(n) ^ (1 << (n + 3)), U64, rng.getrandbits(64)]) if masked else None
        v = await asyncio.wait_for(ini.qp.fetch_add(f["head.stag"], f["head.offset"], add, mask or None
                                                    if masked else None), OP_TIMEOUT)
        new = masked_add(v, add, mask) if masked and mask else (v + add) & U64
        back = await asyncio.wait_for(ini.qp.fetch_add(f["head.stag"], f["head.offset"], (v - new) & U64,
                                                       None), OP_TIMEOUT)
        if back != new:
            result.notes.append(f"Head moved between two FetchAdds: 0x{new:x} expected, 0x{back:x} seen")
        return []

    # -- more requests than credits ------------------------------------------------------

    async def _burst(self, step: Step) -> list[Finding]:
        w = self.world
        ini = w.own.ini
        h = next(iter(w.own.guards))
        count = ini.target.request_credits + step["extra"]
        region = ini.memory.register(bytearray(ini.target.block_size), Access.REMOTE_WRITE)
        ids = [next(self._rids) for _ in range(count)]
        out = self._stray()
        try:
            for rid in ids:
                ini.qp.send(codec.encode({"opcode": OP["LOAD"], "request_id": rid, "handle": h, "flags": 0,
                                          "dd.stag": region.stag, "dd.offset": 0,
                                          "dd.length": ini.target.block_size}, ini.addr_le))
            seen: set[int] = set()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + REPLY_TIMEOUT + 1
            while len(seen) < count and not ini.qp.closed and loop.time() < deadline:
                try:
                    msg = await asyncio.wait_for(ini.unmatched.get(), 0.05)
                except asyncio.TimeoutError:
                    continue
                c = codec.decode(msg.payload, ini.addr_le)
                if c["request_id"] not in ids or c["request_id"] in seen:
                    out.append(Finding("request-id", f"answer with Request ID {c['request_id']} in a burst",
                                       evidence={"answer": msg.payload.hex()}))
                seen.add(c["request_id"])
            if len(seen) < count and not ini.qp.closed:
                out.append(Finding("no-answer", f"{count - len(seen)} of {count} requests of a burst "
                                   f"beyond the credits unanswered, connection up"))
        finally:
            ini.memory.deregister(region.stag)
        return out


async def minimize(runner_factory: Callable[[], Runner], case: Case, kinds: set[str],
                   budget: int = 24) -> list[Step]:
    """Delta debugging over the case's steps: the fewest that still show a finding of
    one of ``kinds`` on fresh sessions."""
    async def shows(steps: list[Step]) -> bool:
        r = runner_factory()
        try:
            await r.start()
            res = await r.run_case(case, steps)
        except HarnessError:      # the target can no longer give fresh sessions
            return False
        finally:
            await r.stop()
        return any(f.kind in kinds for f in res.findings)

    steps, n, tries = list(case.steps), 2, 0
    if await shows([]):
        return []
    while len(steps) >= 2 and tries < budget:
        chunk = max(1, len(steps) // n)
        reduced = False
        for start in range(0, len(steps), chunk):
            candidate = steps[:start] + steps[start + chunk:]
            tries += 1
            if candidate and await shows(candidate):
                steps, n, reduced = candidate, max(n - 1, 2), True
                break
        if not reduced:
            if n >= len(steps):
                break
            n = min(len(steps), 2 * n)
    return steps
