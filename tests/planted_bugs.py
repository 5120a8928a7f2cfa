"""Realistic bugs to plant in a reference target, one at a time, to see who catches them.

Each bug breaks one sentence of the specification and shows on the wire. It is planted
from outside, never in the target's source: executor handlers and attributes are replaced
in the target's own thread, class methods with a ``pytest.MonkeyPatch`` (undone after).
``tests/test_conform.py`` plants, for every conformance case, the bugs that case exists
to catch; ``tools/conform_catch_rate.py`` plants the whole corpus and runs the whole
checker against each, to measure what fraction of them it catches.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kbtp_scapy import codec
from kbtp_scapy.rnic import Access
from kbtp_scapy.target import TargetConfig, connection as conn_mod, direct as direct_mod, table as table_mod
from kbtp_scapy.target.connection import Connection
from kbtp_scapy.target.operations import Executor, Failed, Outcome
from kbtp_scapy.target.ring import FreeRing
from kbtp_scapy.target.server import Target
from kbtp_scapy.target.sessions import InitiatorState, Sessions
from kbtp_scapy.target.table import UNBOUND_OFFSET, BlockTable, Entry
from kbtp_scapy.vocab import EntryFlag, Feature, Opcode, RequestFlag, Status

from .kbtp_harness import TargetThread

STORES = (Opcode.STORE, Opcode.ALLOC_STORE)
#: Never-bound entries start here instead of at 0, so that generation.never_zero sees the
#: Generation wrap after about 128 bind/free cycles instead of 32,768.
SEED_GENERATION = 0xFF00

Plant = Callable[[TargetThread, Any], None]


@dataclass(frozen=True)
class Bug:
    name: str
    sentence: str                  # the sentence of the specification it breaks
    case: str                      # the conformance case meant to catch it
    plant: Plant = field(repr=False)
    transports: tuple[str, ...] = ("iwarp", "roce")
    config: dict[str, Any] = field(default_factory=dict)


BASE_CONFIG = dict(blocks=128, block_size=4096, max_initiators=8, ticket_timeout_ms=300,
                   retention_s=30)
#: For the bugs of cases that judge tickets before their Ticket Timeout (conform/pace.py): a
#: Timeout long enough that a busy host does not turn their FAIL into a SKIP. The short one
#: above keeps the cases that wait for an abandonment quick.
JUDGED_IN_TIME = dict(ticket_timeout_ms=2000)


def start(transport: str, hosts: list[str], bug: Bug | None = None, *,
          seed: int | None = SEED_GENERATION) -> TargetThread:
    """A reference target for ``bug`` (its configuration; the bug is not planted yet),
    its never-bound entries at Generation ``seed``. An allocation whose ring slot never
    fills gives up (INTERNAL) after 1 s instead of 5, so a lost ticket shows quickly."""
    config = TargetConfig(**{**BASE_CONFIG, **(bug.config if bug else {})})
    t = TargetThread(transport, config, hosts=hosts)
    set_attr(t, t.target.executor, "allocate_timeout", 1.0)
    if seed is not None:
        t.run(lambda: seed_generations(t.target.memory.table, seed))
    return t


def seed_generations(table: BlockTable, generation: int) -> None:
    for handle in range(table.base_handle, table.base_handle + table.count):
        table.write(handle, Entry(0, generation, 0, UNBOUND_OFFSET))


# -- ways to plant ---------------------------------------------------------------------------

def set_handler(t: TargetThread, opcode: str, wrap) -> None:
    """Replace one opcode's handler of the target's executor (in the target's thread)."""
    ex = t.target.executor
    original = Executor._handlers[Opcode[opcode]]
    t.run(lambda: setattr(ex, "_handlers", {**ex._handlers, Opcode[opcode]: wrap(original)}))


def set_attr(t: TargetThread, obj: Any, name: str, value: Any) -> None:
    t.run(lambda: setattr(obj, name, value))


def wrap_method(mp, cls, name: str, make_wrapper) -> None:
    mp.setattr(cls, name, make_wrapper(getattr(cls, name)))


def hello_ack_body(change):
    def wrapper(original):
        async def hello_ack(self, status, body):
            if body:
                change(self, body)
            await original(self, status, body)
        return hello_ack
    return wrapper


def complete_with(change):
    """Connection._complete with the request as ``change`` rewrites it."""
    def wrapper(original):
        def complete(self, req, outcome, why=""):
            original(self, change(dict(req)), outcome, why)
        return complete
    return wrapper


def outcome_with(change):
    """A handler whose Outcome ``change`` rewrites."""
    def wrapper(original):
        async def handler(self, conn, req, fetch=None):
            out = await original(self, conn, req, fetch)
            change(self, req, out)
            return out
        return handler
    return wrapper


class CodecShim:
    """The connection module's codec with ``decode`` replaced."""

    def __init__(self, decode):
        self.decode = decode

    def __getattr__(self, name):
        return getattr(codec, name)


def shim_decode(mp, fix) -> None:
    mp.setattr(conn_mod, "codec", CodecShim(lambda buf, le=False: fix(bytes(buf), le)))


def grant(mp, name: str, change) -> None:
    original = getattr(conn_mod, name)

    def granted(*args):
        fields, windows = original(*args)
        change(args, fields, windows)
        return fields, windows
    mp.setattr(conn_mod, name, granted)


def if_entry(predicate, then):
    """A handler wrapper: ``then`` when ``predicate(entry, req)``, else the real handler."""
    def wrapper(original):
        async def handler(self, conn, req, fetch=None):
            if req["handle"] in self.table:
                entry = self.table.read(req["handle"])
                if predicate(entry, req):
                    return await then(self, conn, req, entry, original, fetch)
            return await original(self, conn, req, fetch)
        return handler
    return wrapper


def on_failure(react):
    """A handler wrapper: ``react(self, conn, failure)`` when a check fails, then fail."""
    def wrapper(original):
        async def handler(self, conn, req, fetch=None):
            try:
                return await original(self, conn, req, fetch)
            except Failed as failure:
                react(self, conn, failure)
                raise
        return handler
    return wrapper


def with_request(change):
    """A handler wrapper: the real handler on the request as ``change`` rewrites it."""
    def wrapper(original):
        async def handler(self, conn, req, fetch=None):
            change(conn, req)
            return await original(self, conn, req, fetch)
        return handler
    return wrapper


def shadowed(owner, name: str, value):
    """A handler wrapper: while the real handler runs, ``owner(conn)``'s ``name`` is ``value``."""
    def wrapper(original):
        async def handler(self, conn, req, fetch=None):
            obj = owner(conn)
            if obj is None:
                return await original(self, conn, req, fetch)
            setattr(obj, name, value)
            try:
                return await original(self, conn, req, fetch)
            finally:
                delattr(obj, name)
        return handler
    return wrapper


def _flags(mask_off=0, mask_on=0):
    def change(conn, req):
        req["flags"] = (req["flags"] & ~mask_off) | mask_on
    return with_request(change)


def _not_valid(entry, req):
    return not entry.valid


async def _ok(self, conn, req, entry, original, fetch):
    return Outcome(0, entry.generation, 0, entry.block_offset)


# -- Session Establishment -------------------------------------------------------------------

def plant_hello_ack_request_id(t, mp):
    async def hello_ack(self, status, body):
        await self.qp.send(codec.encode({"opcode": Opcode.HELLO_ACK, "status": status, "request_id": 1,
                                         "hello_ack.features": 0, **body}))
    mp.setattr(Connection, "_hello_ack", hello_ack)


def plant_admit_active(t, mp):
    def wrapper(original):
        def admit(self, ident, want, *source):
            known = self.by_id.get(ident)
            if known is not None:
                known.active = False
            return original(self, ident, want, *source)
        return admit
    wrap_method(mp, Sessions, "admit", wrapper)


def _goodbye_releases(release: bool):
    """GOODBYE acted on as if its RELEASE flag were ``release``."""
    def wrapper(original):
        async def requests(self):
            await original(self)
            return release
        return requests
    return wrapper


def plant_lost_connection_releases(t, mp):
    def wrapper(original):
        def detach(self, state, release):
            return original(self, state, release or state.qp is None or state.qp.closed)
        return detach
    wrap_method(mp, Sessions, "detach", wrapper)


def plant_partition_released_with_bindings(t, mp):
    """A departing DIRECT_ALLOC session gives its partition back even while blocks of it
    are still bound (its ring starts afresh for the next owner)."""
    def wrapper(original):
        def detach(self, state, release):
            if not release and state.partition is not None and state.usage:
                state.partition.release()
                state.partition, state.watch = None, None
            return original(self, state, release)
        return detach
    wrap_method(mp, Sessions, "detach", wrapper)


def plant_unparseable_echoes_no_request_id(t, mp):
    """The answer to a request that cannot be parsed carries Request ID 0 (mutation sample 5's
    ``len(payload) == 12`` for ``>= 12``: only a request cut right after its Request ID got
    it echoed)."""
    wrap_method(mp, Connection, "_malformed", lambda malformed: lambda self, payload, fields: {
        **malformed(self, payload, fields), "request_id": 0})


def plant_unparseable_too_large(t, mp):
    """Every request that cannot be parsed is refused TOO_LARGE, whatever its lengths."""
    def wrapper(original):
        async def execute(self, req, fetch, why):
            if why:
                return self.target.executor.failure(Status.TOO_LARGE, req["handle"]), ""
            return await original(self, req, fetch, why)
        return execute
    wrap_method(mp, Connection, "execute", wrapper)


def _settle_unconsumed(self):
    """Deferred frees written at the next free whether or not their slots were consumed."""
    for offset in list(self._deferred):
        self._fill(offset, *self._deferred.pop(offset))
    return 0


def plant_credits(extra: int):
    def plant(t, mp):
        wrap_method(mp, Connection, "_hello_ack", hello_ack_body(
            lambda self, body: body.update({"hello_ack.request_credits": body["hello_ack.request_credits"] + extra})))
    return plant


def plant_hello_buffer_not_reposted(t, mp):
    """The receive buffer the HELLO used is never posted again: one fewer for requests."""
    def wrapper(original):
        async def hello(self):
            self.qp.post_recv = lambda count=1: None
            try:
                return await original(self)
            finally:
                del self.qp.post_recv
        return hello
    wrap_method(mp, Connection, "_hello", wrapper)


def plant_failure_buffer_not_reposted(t, mp):
    """The receive buffer of a request that failed (any Status but OK) is never posted
    again: each failed request costs the initiator a credit, and the request that then
    arrives within its credits finds no buffer (DDP Terminate on iWARP, RNR on RoCEv2).
    Not in ``CORPUS``: no one case catches it alone on a fresh target, it takes failed
    requests first (``tests/test_verdicts_peer_fault.py`` plants it)."""
    def wrapper(original):
        async def execute(self, req, fetch, why):
            outcome, why = await original(self, req, fetch, why)
            if outcome is not None and outcome.status:
                def skip_once(count=1):
                    del self.qp.post_recv
                self.qp.post_recv = skip_once
            return outcome, why
        return execute
    wrap_method(mp, Connection, "execute", wrapper)


# -- Operations ------------------------------------------------------------------------------

def plant_no_generation_check(t, mp):
    ex = t.target.executor

    def entry(req, own):
        h = req["handle"]
        if h not in ex.table or (own is not None and not own.owns(h)):
            raise Failed("INVALID_HANDLE")
        return ex.table.read(h)
    set_attr(t, ex, "_entry", entry)


def _ignore_generation(conn, req):
    req["generation"] = 0


def _low_octet_generation(conn, req):
    """A Generation compared in its low octet only (as if the entry kept 8 bits of it)."""
    table = conn.target.executor.table
    if req["generation"] and req["handle"] in table:
        current = table.read(req["handle"]).generation
        if not (req["generation"] ^ current) & 0xFF:
            req["generation"] = current


def plant_outside_is_not_valid(t, mp):
    """A handle outside every range reads as an unbound entry of the table."""
    def contains(self, handle):
        return True

    def read(original):
        def entry(self, handle):
            if not self.base_handle <= handle < self.base_handle + self.count:
                return Entry(0, 0, 0, UNBOUND_OFFSET)
            return original(self, handle)
        return entry
    mp.setattr(BlockTable, "__contains__", contains)
    wrap_method(mp, BlockTable, "read", read)


async def _truncating_load(self, conn, req, entry, original, fetch):
    n = req["dd.length"]
    conn.qp.write(req["dd.stag"], req["dd.offset"], bytes(self.memory.block(entry.block_offset, n)),
                  signaled=False)
    return Outcome(0, entry.generation, n, entry.block_offset)


async def _overwrite_bound(self, conn, req, entry, original, fetch):
    self.table.unbind(req["handle"])
    conn.state.bound.discard(req["handle"])
    self.release_block(entry.block_offset)
    return await original(self, conn, req, fetch)


async def _unseal_first(self, conn, req, entry, original, fetch):
    self.table.write(req["handle"], Entry(entry.flags & ~EntryFlag.SEALED, entry.generation, entry.data_length,
                                          entry.block_offset))
    return await original(self, conn, req, fetch)


async def _write_then_check(self, conn, req, entry, original, fetch):
    data = req.get("inline_data", b"")
    self.memory.block(entry.block_offset, len(data))[:] = data
    return await original(self, conn, req, fetch)


def plant_mpa_revision_1(t, mp):
    """The target answers every MPA Request as one of revision 1 (RFC 5044's, no IRD/ORD)."""
    from dataclasses import replace

    from kbtp_scapy.rnic.iwarp import IwarpQP
    real = IwarpQP._on_request
    mp.setattr(IwarpQP, "_on_request", lambda self, req: real(self, replace(req, rev=1, enhanced=False)))


def plant_corrupt_data(t, mp):
    ex = t.target.executor
    original = ex._data

    async def data(conn, req, length, fetch):
        d = await original(conn, req, length, fetch)
        return d[:-1] + bytes([d[-1] ^ 1]) if d else d
    set_attr(t, ex, "_data", data)


def plant_store_keeps_length(t, mp):
    """STORE writes the data but leaves the entry's Data Length as it was."""
    def wrapper(original):
        async def store(self, conn, req, fetch=None):
            before = self.table.read(req["handle"])
            out = await original(self, conn, req, fetch)
            if not out.status:
                e = self.table.read(req["handle"])
                self.table.write(req["handle"], Entry(e.flags, e.generation, before.data_length, e.block_offset))
            return out
        return store
    set_handler(t, "STORE", wrapper)


def plant_store_at_offset(t, mp):
    """Stores write the data 8 octets into the block; loads read it from the start."""
    ex = t.target.executor
    memory, block, data_of = ex.memory, ex.memory.block, ex._data
    armed = [False]

    def shifted(block_offset, length=None):
        if armed[0]:                  # the write that follows the data's arrival
            armed[0] = False
            return block(block_offset + 8, length)
        return block(block_offset, length)

    async def data(conn, req, length, fetch):
        got = await data_of(conn, req, length, fetch)
        armed[0] = True
        return got
    set_attr(t, memory, "block", shifted)
    set_attr(t, ex, "_data", data)


def _leak_usage(self, conn, failure):
    conn.state.tickets += 1


def _lose_ticket(self, conn, failure):
    ring = conn.ring
    ticket, _ = ring.take_ticket()
    if conn.state.watch is not None:
        conn.state.watch.taken_by_target(ticket)


def plant_free_keeps_usage(t, mp):
    def wrapper(original):
        async def free(self, conn, req, fetch=None):
            out = await original(self, conn, req, fetch)
            if not out.status:
                conn.state.tickets += 1       # the unit of usage is never given back
            return out
        return free
    set_handler(t, "FREE", wrapper)


def plant_free_keeps_sealed(t, mp):
    def unbind(self, handle):
        entry = self.read(handle)
        self.write(handle, Entry(entry.flags & EntryFlag.SEALED, table_mod.next_generation(entry.generation), 0,
                                 UNBOUND_OFFSET))
        return entry
    mp.setattr(BlockTable, "unbind", unbind)


def plant_free_keeps_generation(t, mp):
    def unbind(self, handle):
        entry = self.read(handle)
        self.write(handle, Entry(0, entry.generation, 0, UNBOUND_OFFSET))
        return entry
    mp.setattr(BlockTable, "unbind", unbind)


def plant_free_to_shared_ring(t, mp):
    memory = t.target.memory
    set_attr(t, memory, "ring_of", lambda block_offset: memory.shared_ring)


# -- Completion ------------------------------------------------------------------------------

def plant_order(t, mp):
    held = []

    def wrapper(original):
        def complete(self, req, outcome, why=""):
            if req["opcode"] == Opcode.LOAD and not held:
                held.append((req, outcome, why))
                return
            original(self, req, outcome, why)
            while held:
                original(self, *held.pop())
        return complete
    wrap_method(mp, Connection, "_complete", wrapper)


DEFERRED = Outcome(-1)


def plant_concurrent_stores(t, mp):
    """Stores that fetch their data by RDMA Read finish in the background, so the
    requests after them are executed (and completed) while the Read is under way."""
    ex = t.target.executor
    original = ex.run

    async def run(conn, req, fetch=None):
        if req["opcode"] in STORES and not req["flags"] & RequestFlag.INLINE:
            async def finish():
                conn._complete(req, await original(conn, req, fetch))
            asyncio.ensure_future(finish())
            return DEFERRED
        return await original(conn, req, fetch)

    def wrapper(complete):
        def skip_deferred(self, req, outcome, why=""):
            if outcome is not DEFERRED:
                complete(self, req, outcome, why)
        return skip_deferred
    wrap_method(mp, Connection, "_complete", wrapper)
    set_attr(t, ex, "run", run)


def plant_late_data(t, mp):
    def wrapper(original):
        async def load(self, conn, req, fetch=None):
            e = self.table.read(req["handle"])
            if not e.valid:
                return await original(self, conn, req, fetch)
            data = bytes(self.memory.block(e.block_offset, e.data_length))
            asyncio.get_running_loop().call_later(
                0.3, lambda: conn.qp.write(req["dd.stag"], req["dd.offset"], data, signaled=False))
            return Outcome(0, e.generation, e.data_length, e.block_offset)
        return load
    set_handler(t, "LOAD", wrapper)


def plant_record_without_immediate(t, mp):
    """The completion record is written with a plain RDMA Write, no Immediate Data."""
    def wrapper(original):
        def complete(self, req, outcome, why=""):
            write = self.qp.write
            self.qp.write = lambda stag, offset, data, imm=None, signaled=True: write(
                stag, offset, data, signaled=signaled)
            try:
                original(self, req, outcome, why)
            finally:
                del self.qp.write
        return complete
    wrap_method(mp, Connection, "_complete", wrapper)


# -- Direct modes and the ring ---------------------------------------------------------------

def _checked_alloc_store(write):
    """ALLOC_STORE with the reference's checks, then ``write(self, conn, req, length, fetch,
    block)`` doing steps 2 to 4 its own (wrong) way; returns the Generation bound."""
    def wrapper(original):
        async def alloc_store(self, conn, req, fetch=None):
            length = self._store_length(req)
            state = conn.state
            if self._entry(req, state).valid:
                raise Failed("ALREADY_BOUND")
            if state.usage >= state.quota:
                raise Failed("NO_SPACE")
            ring = conn.ring
            _, block = await ring.allocate(self._pause(ring, conn), self.allocate_timeout)
            generation, stored = await write(self, conn, req, length, fetch, block)
            state.bound.add(req["handle"])
            return Outcome(0, generation, stored, block)
        return alloc_store
    return wrapper


async def _bind_then_fetch(self, conn, req, length, fetch, block):
    """Steps 3 and 4 swapped: the entry is VALID while the RDMA Read is still under way."""
    bound = self.table.bind(req["handle"], block, length, bool(req["flags"] & RequestFlag.SEAL))
    data = await self._data(conn, req, length, fetch)
    self.memory.block(block, len(data))[:] = data
    return bound.generation, len(data)


async def _bind_then_copy(self, conn, req, length, fetch, block):
    """The data is at hand, but the entry is written first and the copy 50 ms later."""
    data = await self._data(conn, req, length, fetch)
    bound = self.table.bind(req["handle"], block, len(data), bool(req["flags"] & RequestFlag.SEAL))
    await asyncio.sleep(0.05)
    self.memory.block(block, len(data))[:] = data
    return bound.generation, len(data)


def plant_bind_any_offset(t, mp):
    def change(conn, req):
        ring = conn.state.partition.ring
        block = ring.ready(req["bind.ticket"], ring.offset_of(req["bind.ticket"]))
        if block is not None:
            req["bind.block_offset"] = block
    set_handler(t, "BIND", with_request(change))


def plant_bind_length(t, mp):
    set_handler(t, "BIND", with_request(lambda conn, req: req.update({"bind.data_length": 0})))


def plant_deferred_free_overwrites(t, mp):
    """A FREE whose slot is not yet consumed writes it anyway instead of deferring."""
    def free(self, block):
        ticket, offset = self._fetch_add(self.tail)
        self._fill(offset, ticket, block)
    mp.setattr(FreeRing, "free", free)


def plant_slots_never_reused(t, mp):
    """Slot offsets computed as 16 * ticket, without the modulo N: nothing goes round."""
    mp.setattr(FreeRing, "offset_of", lambda self, ticket: 16 * ticket)


def plant_wider_partition(t, mp):
    def change(args, fields, windows):
        memory, _, qp = args
        w = windows[0]
        memory.memory.deregister(w.stag)
        wide = memory.memory.register(memory.pool, Access.REMOTE_WRITE, start=w.start,
                                      length=w.length + memory.block_size, base=w.base, connection=qp)
        fields["hello_ack.partition.stag"], windows[0] = wide.stag, wide
    grant(mp, "grant_partition", change)


def plant_abandon_keeps_window(t, mp):
    def wrapper(original):
        def abandon(self, ticket):
            self.windows = []
            original(self, ticket)
        return abandon
    wrap_method(mp, direct_mod.TicketWatch, "_abandon", wrapper)


# -- issue 24: the classes of bugs that got through -------------------------------------------

_LOW32 = 0xFFFFFFFF


def plant_request_id_upper_cached(t, mp):
    """The upper half of the first Request ID of a connection is echoed for all later ones."""
    def wrapper(original):
        def complete(self, req, outcome, why=""):
            upper = self.__dict__.setdefault("_upper", req["request_id"] & ~_LOW32)
            original(self, {**req, "request_id": upper | req["request_id"] & _LOW32}, outcome, why)
        return complete
    wrap_method(mp, Connection, "_complete", wrapper)


def plant_handle_32_bits(t, mp):
    """The table and the ranges look at the low 32 bits of a Block Handle only."""
    contains, at, owns = BlockTable.__contains__, BlockTable._at, InitiatorState.owns
    mp.setattr(BlockTable, "__contains__", lambda self, h: contains(self, h & _LOW32))
    mp.setattr(BlockTable, "_at", lambda self, h: at(self, h & _LOW32))
    mp.setattr(InitiatorState, "owns", lambda self, h: owns(self, h & _LOW32))


def plant_offset_32_bits(t, mp):
    """Data Descriptor Tagged Offsets kept in 32 bits."""
    def decode(b, le):
        req = codec.decode(b, le)
        if "dd.offset" in req:
            req["dd.offset"] &= _LOW32
        return req
    shim_decode(mp, decode)


def plant_initiator_id_low_half(t, mp):
    """Sessions are told apart by the low 64 bits of the Initiator ID only."""
    def wrapper(original):
        def admit(self, ident, want, *source):
            return original(self, bytes(8) + ident[8:], want, *source)
        return admit
    wrap_method(mp, Sessions, "admit", wrapper)


def plant_load_pads_descriptor(t, mp):
    """A LOAD writes the whole descriptor Length, the data padded with zeros."""
    def wrapper(original):
        async def load(self, conn, req, fetch=None):
            out = await original(self, conn, req, fetch)
            if req["dd.length"] > out.data_length:
                conn.qp.write(req["dd.stag"], req["dd.offset"] + out.data_length,
                              bytes(req["dd.length"] - out.data_length), signaled=False)
            return out
        return load
    set_handler(t, "LOAD", wrapper)


class _RecordShim(CodecShim):
    """The connection module's codec, completion records padded to 32 octets."""

    def __init__(self):
        super().__init__(codec.decode)

    @staticmethod
    def encode_struct(struct, values, le=False):
        raw = codec.encode_struct(struct, values, le)
        return raw + bytes(8) if struct is conn_mod.M.COMPLETION_RECORD else raw


def plant_store_overruns(t, mp):
    """A whole-block STORE writes 8 octets more than its data, into the next block."""
    def wrapper(original):
        async def store(self, conn, req, fetch=None):
            out = await original(self, conn, req, fetch)
            end = out.block_offset + out.data_length
            if out.data_length == self.block_size and end + 8 <= self.memory.pool_base + len(self.memory.pool_view):
                self.memory.block(end, 8)[:] = bytes(8)
            return out
        return store
    set_handler(t, "STORE", wrapper)


def plant_record_not_negotiated(t, mp):
    """Completion records for every request with RECORD, whether or not the session was
    granted RECORD_COMPLETION."""
    def wrapper(original):
        def complete(self, req, outcome, why=""):
            features = self.features
            self.features |= Feature.RECORD_COMPLETION
            try:
                original(self, req, outcome, why)
            finally:
                self.features = features
        return complete
    wrap_method(mp, Connection, "_complete", wrapper)


async def _sealed_first(self, conn, req, entry, original, fetch):
    raise Failed("SEALED")


def plant_block_size_exclusive(t, mp):
    """A store of exactly Block Size is refused as too large."""
    ex = t.target.executor
    original = ex._store_length

    def length(req):
        if req["dd.length"] == ex.block_size:
            raise Failed("TOO_LARGE")
        return original(req)
    set_attr(t, ex, "_store_length", length)


def plant_ticket_timeout_tenths(t, mp):
    """The Ticket Timeout taken as tenths of the advertised milliseconds."""
    def wrapper(original):
        def init(self, state, memory, timeout_ms):
            original(self, state, memory, timeout_ms)
            self.timeout = timeout_ms / 10000
        return init
    wrap_method(mp, direct_mod.TicketWatch, "__init__", wrapper)


def plant_credit_lost_on_reconnect(t, mp):
    """A restored session's connection never reposts the buffer its HELLO used."""
    def wrapper(original):
        async def hello(self):
            posted = []
            self.qp.post_recv = lambda count=1: posted.append(count)
            try:
                ok = await original(self)
            finally:
                del self.qp.post_recv
            if not (ok and self.state.retained_at):
                for count in posted:
                    self.qp.post_recv(count)
            return ok
        return hello
    wrap_method(mp, Connection, "_hello", wrapper)


def plant_usage_forgotten_on_reconnect(t, mp):
    """A restored session starts counting its usage afresh (its bindings stay bound)."""
    def wrapper(original):
        def admit(self, ident, want, *source):
            state, restored = original(self, ident, want, *source)
            if restored:
                state.bound = set()
            return state, restored
        return admit
    wrap_method(mp, Sessions, "admit", wrapper)


def plant_full_target_drops_hello(t, mp):
    """A HELLO the target has no room for ends the connection instead of a HELLO_ACK."""
    def wrapper(original):
        def admit(self, ident, want, *source):
            try:
                return original(self, ident, want, *source)
            except conn_mod.Refused as refused:
                if refused.status == "NO_SPACE":
                    raise RuntimeError("no handle range left") from None
                raise
        return admit
    wrap_method(mp, Sessions, "admit", wrapper)


def plant_reclaim_keeps_usage(t, mp):
    """The unit of usage of an abandoned ticket is never released."""
    def wrapper(original):
        def abandon(self, ticket):
            original(self, ticket)
            self.state.tickets += 1
        return abandon
    wrap_method(mp, direct_mod.TicketWatch, "_abandon", wrapper)


# -- the corpus ------------------------------------------------------------------------------

VALIDATE = ("It validates every request before touching memory: ... A failed check completes "
            "the request with the corresponding status and has no other effect.")

def plant_usage_compared_for_equality(t, mp) -> None:
    """The quota test ``usage == quota`` instead of ``>=``: usage above the quota, which only
    tickets taken past it by FetchAdd can reach, passes as if below it."""
    real = InitiatorState.usage.fget
    assert real is not None

    def usage(s: InitiatorState) -> int:
        used = real(s)
        return used if used <= s.quota else s.quota - 1
    mp.setattr(InitiatorState, "usage", property(usage))


def plant_partition_for_every_session(t, mp) -> None:
    """A partition reserved for every session, whatever its HELLO requested: one that did
    not ask for DIRECT_ALLOC allocates from a partition, not from the shared ring."""
    wrap_method(mp, Sessions, "admit", lambda admit: lambda self, ident, want, source="":
                admit(self, ident, True, source))


def plant_partition_kept_when_not_granted(t, mp) -> None:
    """A HELLO asking DIRECT_ALLOC reserves a partition, the HELLO_ACK does not grant
    DIRECT_ALLOC (here: the partition's windows are refused, as a device may refuse them),
    and the session keeps the partition: its target-executed allocations take blocks from
    it, not from the shared ring (mutation sample 4's `features >> DIRECT_ALLOC` grants it
    only with RECORD_COMPLETION or ADDR_LE beside it)."""
    def refused(*args):
        raise OSError("the partition's windows refused (planted)")
    mp.setattr(conn_mod, "grant_partition", refused)


def plant_bound_ticket_counted_twice(t, mp) -> None:
    """BIND turns a ticket into a bound handle but leaves it counted as a ticket too, so each
    BIND costs two units of quota (the ticket watch's ``tickets -= 1`` made ``-= 0``, which
    mutation sample 3 saw killed by fuzz alone)."""
    mp.setattr(direct_mod.TicketWatch, "bound", lambda self, ticket: self._pending.pop(ticket))


def plant_shared_ring_counted_larger(t, mp) -> None:
    """Admission counts one quota more in the shared ring than the ring holds, so it admits
    one session without direct modes more than its free blocks cover (mutation sample 5's
    ``shared_sessions * quota`` for ``(shared_sessions + 1) * quota``)."""
    real = TargetConfig.shared_blocks.fget
    assert real is not None
    mp.setattr(TargetConfig, "shared_blocks", property(lambda c: real(c) + c.quota))


# -- issue 31: the target classes that got through --------------------------------------------

def _hello_requested(original):
    """Connection._hello that keeps the HELLO's Requested Features as ``self.requested``."""
    async def hello(self):
        recv = self.qp.recv

        async def kept():
            msg = await recv()
            self.requested = int.from_bytes(msg.payload[24:26], "big") if len(msg.payload) >= 26 else 0
            return msg
        self.qp.recv = kept
        try:
            return await original(self)
        finally:
            del self.qp.recv
    return hello


def plant_addr_le_when_requested(t, mp):
    """Little-endian address fields in every session whose HELLO asked for ADDR_LE, whether
    or not the HELLO_ACK granted it (the session's byte order taken from the request)."""
    def wrapper(original):
        async def hello(self):
            ok = await original(self)
            if ok and self.requested & Feature.ADDR_LE:
                self.addr_le = True
            return ok
        return _hello_requested(hello)
    wrap_method(mp, Connection, "_hello", wrapper)


def plant_store_seal_from_inline(t, mp):
    """STORE (the mapped store only) seals when the INLINE bit is set, not the SEAL bit:
    the two constants swapped in one handler."""
    def change(conn, req):
        flags = req["flags"] & ~RequestFlag.SEAL
        req["flags"] = flags | (RequestFlag.SEAL if flags & RequestFlag.INLINE else 0)
    set_handler(t, "STORE", with_request(change))


def plant_load_honours_seal(t, mp):
    """The flags shared by every opcode acted on for all: a LOAD with SEAL seals the block."""
    def wrapper(original):
        async def load(self, conn, req, fetch=None):
            out = await original(self, conn, req, fetch)
            if not out.status and req["flags"] & RequestFlag.SEAL:
                e = self.table.read(req["handle"])
                self.table.write(req["handle"], Entry(e.flags | EntryFlag.SEALED, e.generation, e.data_length,
                                                      e.block_offset))
            return out
        return load
    set_handler(t, "LOAD", wrapper)


def plant_quota_checked_first(t, mp):
    """ALLOC_STORE checks the quota before anything else, so a request that also fails a
    validation or ALREADY_BOUND answers NO_SPACE while the quota is full."""
    def wrapper(original):
        async def alloc_store(self, conn, req, fetch=None):
            if conn.state.usage >= conn.state.quota:
                raise Failed("NO_SPACE")
            return await original(self, conn, req, fetch)
        return alloc_store
    set_handler(t, "ALLOC_STORE", wrapper)


def plant_bind_quota_counts_its_ticket(t, mp):
    """BIND checks the quota as ALLOC_STORE does, on usage, which still counts the ticket
    being bound: the BIND that reaches the quota exactly is refused NO_SPACE."""
    def wrapper(original):
        async def bind(self, conn, req, fetch=None):
            state = conn.state
            if state.watch is not None:
                state.watch.poll()
            if state.usage >= state.quota:
                raise Failed("NO_SPACE")
            return await original(self, conn, req, fetch)
        return bind
    set_handler(t, "BIND", wrapper)


def plant_bind_verifies_ticket_first(t, mp):
    """BIND looks at the ring before anything else: a ticket whose slot does not hold the
    Block Offset is MALFORMED whatever else is wrong with the request."""
    def wrapper(original):
        async def bind(self, conn, req, fetch=None):
            watch = conn.state.watch
            if watch is not None:
                ring = watch.part.ring
                ticket = req["bind.ticket"]
                if ring.ready(ticket, ring.offset_of(ticket)) != req["bind.block_offset"]:
                    raise Failed("MALFORMED")
            return await original(self, conn, req, fetch)
        return bind
    set_handler(t, "BIND", wrapper)


def plant_invalidate_last_descriptor(t, mp):
    """INVALIDATE revokes the STag of the request's last descriptor: the Completion
    Descriptor's when RECORD put one there, and the session answers with a COMPLETION."""
    wrap_method(mp, Connection, "_complete", complete_with(
        lambda req: {**req, "dd.stag": req["cd.stag"]} if "cd.stag" in req else req))


def plant_hello_version_ignored(t, mp):
    """The HELLO's Version is never looked at (requests' Versions still are)."""
    def decode(b, le=False):
        if len(b) > 1 and b[1] == Opcode.HELLO:
            b = bytes([1]) + b[1:]
        return codec.decode(b, le)
    shim_decode(mp, decode)


def plant_credits_from_config(t, mp):
    """Request Credits are the target's own receive buffers, whatever Completion Credits the
    HELLO announced."""
    wrap_method(mp, Connection, "_hello_ack", hello_ack_body(lambda self, body: body.update(
        {"hello_ack.request_credits": self.target.config.request_credits})))


def plant_release_skips_clear(t, mp):
    """Freed blocks are cleared by FREE only: GOODBYE with RELEASE returns them as they are."""
    target = t.target
    original = target.sessions._release

    def release(state):
        clear, target.executor.clear_freed = target.executor.clear_freed, False
        try:
            original(state)
        finally:
            target.executor.clear_freed = clear
    set_attr(t, target.sessions, "_release", release)


def plant_clear_data_length(t, mp):
    """A freed block is cleared over its entry's Data Length only, not its Block Size."""
    ex = t.target.executor

    def wrapper(original):
        async def free(self, conn, req, fetch=None):
            h = req["handle"]
            entry = self.table.read(h) if h in self.table else None
            clear = self.clear_freed
            self.clear_freed = False
            try:
                out = await original(self, conn, req, fetch)
            finally:
                self.clear_freed = clear
            if clear and not out.status and entry is not None and \
                    self.memory.ring_of(entry.block_offset) is self.memory.shared_ring:
                self.memory.block(entry.block_offset, entry.data_length)[:] = bytes(entry.data_length)
            return out
        return free
    assert ex.clear_freed
    set_handler(t, "FREE", wrapper)


CORPUS: list[Bug] = [
    # Session Establishment
    Bug("hello_ack_request_id", "HELLO_ACK ... in which Request ID, Block Handle, Generation, and "
        "Status are zero", "session.hello_ack.header", plant_hello_ack_request_id),
    Bug("admit_active_id", "a target MUST reject a HELLO whose Initiator ID belongs to a session "
        "that is still active", "session.initiator_id.active_rejected", plant_admit_active),
    Bug("goodbye_always_releases", "Otherwise [without RELEASE] ... the target keeps the initiator's "
        "bindings", "session.retention.goodbye",
        lambda t, mp: wrap_method(mp, Connection, "_requests", _goodbye_releases(True))),
    Bug("lost_connection_releases", "and when a connection fails, the target keeps the initiator's "
        "bindings", "session.retention.connection_lost", plant_lost_connection_releases),
    Bug("partition_released_with_bindings", "the target keeps the initiator's bindings ... With these "
        "rules no block is ever lost or handed out twice", "session.retention.partition",
        plant_partition_released_with_bindings),
    Bug("release_frees_nothing", "With flag 0x0001 RELEASE, the target frees all handles bound by "
        "the initiator", "session.goodbye.release",
        lambda t, mp: set_attr(t, t.target.sessions, "_release", lambda state: None)),
    Bug("release_ignored", "With flag 0x0001 RELEASE, the target frees all handles bound by the "
        "initiator", "session.goodbye.release",
        lambda t, mp: wrap_method(mp, Connection, "_requests", _goodbye_releases(False))),
    Bug("same_handle_base", "Handles of different initiators never overlap",
        "session.hello_ack.disjoint_ranges", lambda t, mp: wrap_method(
            mp, Connection, "_hello_ack", hello_ack_body(lambda self, body: body.update(
                {"hello_ack.handle_base": self.target.config.base_handle})))),
    Bug("credits_overstated", "A target pre-posts, for each request credit, a receive buffer",
        "session.credits.request", plant_credits(62), config={"request_credits": 2}),
    Bug("credits_one_short", "A target pre-posts, for each request credit, a receive buffer",
        "session.credits.request", plant_credits(1)),
    Bug("hello_buffer_not_reposted", "A target pre-posts, for each request credit, a receive buffer",
        "session.credits.request", plant_hello_buffer_not_reposted),
    # Common Header
    Bug("version_ignored", "Version is 1 ... MALFORMED: Request cannot be parsed", "ops.header.version",
        lambda t, mp: shim_decode(mp, lambda b, le: codec.decode(b[:1] and b"\x01" + b[1:], le))),
    Bug("unknown_opcode_executed", "Opcodes are listed in ... MALFORMED", "ops.header.opcode",
        lambda t, mp: shim_decode(mp, lambda b, le: codec.decode(
            b[:1] + b"\x12" + b[2:] if b[1:2] == b"\x7e" else b, le))),
    Bug("unparseable_request_id_zero", "Request ID is chosen by the initiator and echoed in the completion",
        "ops.header.version", plant_unparseable_echoes_no_request_id),
    Bug("unparseable_too_large", "A failed check completes the request with the corresponding status; "
        "TOO_LARGE: Length exceeds block or buffer", "ops.header.opcode", plant_unparseable_too_large),
    Bug("short_inline_padded", "MALFORMED: Request cannot be parsed", "ops.header.length",
        lambda t, mp: shim_decode(mp, lambda b, le: codec.decode(
            b + bytes(7) if b[1:2] == b"\x12" and len(b) == 45 else b, le))),
    # Operations: validation
    Bug("no_own_range_check", "the handle MUST be within ... its own range for stores and frees",
        "ops.handle.own_range", lambda t, mp: mp.setattr(InitiatorState, "owns", lambda self, h: True)),
    Bug("free_range_unchecked", "(its own range for stores and frees)", "ops.handle.own_range",
        lambda t, mp: set_handler(t, "FREE", shadowed(lambda conn: conn.state, "owns", lambda h: True))),
    Bug("outside_is_not_valid", "the handle MUST be within a range the initiator is authorized for",
        "ops.handle.outside_table", plant_outside_is_not_valid),
    Bug("no_generation_check", "if the request Generation is non-zero, it MUST equal the entry's",
        "ops.generation.stale", plant_no_generation_check),
    Bug("free_ignores_generation", "if the request Generation is non-zero, it MUST equal the entry's",
        "ops.generation.stale", lambda t, mp: set_handler(t, "FREE", with_request(_ignore_generation))),
    Bug("load_ignores_generation", "if the request Generation is non-zero, it MUST equal the entry's",
        "ops.generation.stale", lambda t, mp: set_handler(t, "LOAD", with_request(_ignore_generation))),
    Bug("generation_low_octet", "if the request Generation is non-zero, it MUST equal the entry's "
        "(Generation: A 16-bit counter)", "ops.generation.full_width",
        lambda t, mp: set_handler(t, "LOAD", with_request(_low_octet_generation))),
    # Block Load
    Bug("load_unbound_ok", "The entry MUST be VALID", "ops.load.not_valid",
        lambda t, mp: set_handler(t, "LOAD", if_entry(_not_valid, _ok))),
    Bug("load_ignores_seal", "and SEALED unless ALLOW_UNSEALED is set", "ops.load.not_sealed",
        lambda t, mp: set_handler(t, "LOAD", _flags(mask_on=RequestFlag.ALLOW_UNSEALED))),
    Bug("load_truncates", "Data Length MUST NOT exceed the descriptor Length", "ops.load.too_large",
        lambda t, mp: set_handler(t, "LOAD", if_entry(
            lambda e, req: e.valid and e.data_length > req["dd.length"], _truncating_load))),
    Bug("load_offset_wrong", "It completes the request with the Block Offset, Data Length, and "
        "Generation of the entry", "ops.unmapped_store.completion", lambda t, mp: set_handler(
            t, "LOAD", outcome_with(lambda self, req, out: setattr(
                out, "block_offset", out.block_offset + self.block_size)))),
    Bug("load_generation_zero", "It completes the request with the Block Offset, Data Length, and "
        "Generation of the entry", "ops.unmapped_store.completion", lambda t, mp: set_handler(
            t, "LOAD", outcome_with(lambda self, req, out: setattr(out, "generation", 0)))),
    # Block Mapped Store
    Bug("store_size_unchecked", "lengths MUST NOT exceed Block Size", "ops.store.too_large",
        lambda t, mp: set_attr(t, t.target.executor, "_store_length", lambda req: req["dd.length"])),
    Bug("store_unbound_ok", "which MUST be VALID", "ops.store.not_valid",
        lambda t, mp: set_handler(t, "STORE", if_entry(_not_valid, _ok))),
    Bug("store_sealed_overwrites", "and not SEALED", "ops.store.sealed",
        lambda t, mp: set_handler(t, "STORE", if_entry(lambda e, r: e.sealed, _unseal_first))),
    Bug("store_ignores_seal", "if SEAL is set, sets SEALED", "ops.store.seal_flag",
        lambda t, mp: set_handler(t, "STORE", _flags(mask_off=RequestFlag.SEAL))),
    Bug("store_keeps_length", "It updates Data Length", "ops.store.seal_flag", plant_store_keeps_length),
    Bug("read_data_corrupted", "It obtains the data ... by RDMA Read ... and writes it into the block",
        "ops.store.data", plant_corrupt_data),
    Bug("store_at_offset_8", "and writes it into the block", "ops.store.data", plant_store_at_offset),
    # Block Unmapped Store
    Bug("alloc_overwrites_bound", "its entry MUST NOT be VALID", "ops.unmapped_store.already_bound",
        lambda t, mp: set_handler(t, "ALLOC_STORE", if_entry(lambda e, r: e.valid, _overwrite_bound))),
    Bug("alloc_overwrites_unsealed", "its entry MUST NOT be VALID", "ops.unmapped_store.already_bound",
        lambda t, mp: set_handler(t, "ALLOC_STORE", if_entry(
            lambda e, r: e.valid and not e.sealed, _overwrite_bound))),
    Bug("no_side_effect_sealed_store", VALIDATE, "ops.no_side_effect",
        lambda t, mp: set_handler(t, "STORE", if_entry(
            lambda e, r: e.sealed and r["flags"] & RequestFlag.INLINE, _write_then_check))),
    Bug("failed_alloc_uses_quota", VALIDATE, "ops.no_side_effect.quota",
        lambda t, mp: set_handler(t, "ALLOC_STORE", on_failure(_leak_usage))),
    Bug("failed_alloc_takes_ticket", VALIDATE, "ops.no_side_effect.quota",
        lambda t, mp: set_handler(t, "ALLOC_STORE", on_failure(_lose_ticket))),
    # Block Free
    Bug("free_unbound_ok", "The handle MUST be in the initiator's range and VALID", "ops.free.not_valid",
        lambda t, mp: set_handler(t, "FREE", if_entry(_not_valid, _ok))),
    Bug("free_does_nothing", "The target clears VALID and SEALED ... It returns the block to the ring",
        "ops.free.unbinds", lambda t, mp: set_handler(t, "FREE", if_entry(lambda e, r: True, _ok))),
    Bug("free_keeps_sealed", "The target clears VALID and SEALED", "ops.free.unbinds",
        plant_free_keeps_sealed),
    Bug("free_to_shared_ring", "It returns the block to the ring from which it was allocated",
        "direct.ring.laps", plant_free_to_shared_ring, config=JUDGED_IN_TIME),
    # Allocation Quotas
    Bug("no_quota", "it completes the request with NO_SPACE", "ops.quota.no_space",
        lambda t, mp: mp.setattr(InitiatorState, "usage", property(lambda s: 0))),
    Bug("free_keeps_usage", "the target releases one unit of usage when a FREE completes",
        "ops.quota.no_space", plant_free_keeps_usage),
    # Generations
    Bug("generation_mod_2", "Generation never takes the value zero", "generation.never_zero",
        lambda t, mp: mp.setattr(table_mod, "next_generation", lambda g: (g + 1) % 2)),
    Bug("generation_wraps_to_zero", "Generation never takes the value zero", "generation.never_zero",
        lambda t, mp: mp.setattr(table_mod, "next_generation", lambda g: (g + 1) & 0xFFFF)),
    Bug("generation_steps_two", "the next Generation (incremented by one, skipping zero)",
        "generation.next", lambda t, mp: mp.setattr(table_mod, "next_generation", lambda g: g % 0xFFFF + 2)),
    Bug("free_keeps_generation", "[FREE] increments the Generation (skipping zero)", "generation.next",
        plant_free_keeps_generation),
    # Completion
    Bug("request_id_flipped", "Request ID is ... echoed in the completion", "completion.request_id",
        lambda t, mp: wrap_method(mp, Connection, "_complete", complete_with(
            lambda req: {**req, "request_id": req["request_id"] ^ 1}))),
    Bug("request_id_32_bits", "Request ID is ... echoed in the completion", "completion.request_id",
        lambda t, mp: wrap_method(mp, Connection, "_complete", complete_with(
            lambda req: {**req, "request_id": req["request_id"] & 0xFFFFFFFF}))),
    Bug("completions_reordered", "A target processes the requests of one connection in order",
        "completion.order", plant_order),
    Bug("stores_overtaken", "A target processes the requests of one connection in order",
        "completion.order", plant_concurrent_stores),
    Bug("invalidate_ignored", "0x0008 INVALIDATE: the target completes with Send with Invalidate",
        "completion.invalidate", lambda t, mp: wrap_method(mp, Connection, "_complete", complete_with(
            lambda req: {**req, "flags": req["flags"] & ~RequestFlag.INVALIDATE}))),
    Bug("store_invalidate_ignored", "0x0008 INVALIDATE: the target completes with Send with Invalidate",
        "completion.invalidate", lambda t, mp: wrap_method(mp, Connection, "_complete", complete_with(
            lambda req: {**req, "flags": req["flags"] & ~RequestFlag.INVALIDATE}
            if req["opcode"] in STORES else req))),
    Bug("load_data_late", "receipt of the completion implies that the loaded data is in the "
        "initiator's buffer", "completion.load_data", plant_late_data),
    Bug("mpa_revision_1", "Peers SHOULD use the enhanced connection establishment of .",
        "binding.mpa.enhanced", plant_mpa_revision_1, transports=("iwarp",)),
    Bug("record_over_rdmap", "a target MUST NOT advertise RECORD_COMPLETION in the RDMAP binding",
        "completion.record.rdmap", lambda t, mp: mp.setattr(
            Target, "offered_features", lambda self, qp: self.config.features), transports=("iwarp",)),
    Bug("record_ignored", "Completion records on these transports MUST be written with RDMA Write "
        "with Immediate", "completion.record.write_imm", lambda t, mp: wrap_method(
            mp, Connection, "_complete",
            complete_with(lambda req: {**req, "flags": req["flags"] & ~RequestFlag.RECORD})),
        transports=("roce",)),
    Bug("record_without_immediate", "Completion records on these transports MUST be written with "
        "RDMA Write with Immediate", "completion.record.write_imm", plant_record_without_immediate,
        transports=("roce",)),
    # Direct modes
    Bug("table_base_off_by_one", "The entry for handle h is at Table Offset + 16 * (h - Table Base "
        "Handle)", "direct.load.entry_and_block", lambda t, mp: grant(
            mp, "grant_direct_load", lambda a, f, w: f.update(
                {"hello_ack.table_base_handle": f["hello_ack.table_base_handle"] + 1}))),
    Bug("pool_writable", "a Pool descriptor (Count = F) that grants read access only",
        "direct.load.read_only", lambda t, mp: grant(mp, "grant_direct_load", lambda a, f, w: setattr(
            w[1], "access", w[1].access | Access.REMOTE_WRITE))),
    Bug("head_not_atomic", "MUST support the atomic operations", "direct.alloc.atomics",
        lambda t, mp: grant(mp, "grant_partition", lambda a, f, w: setattr(w[2], "access", Access.REMOTE_READ)),
        config=JUDGED_IN_TIME),
    Bug("bind_length_zero", "sends BIND with the ticket, Data Length, and Block Offset ... writes the "
        "table entry", "direct.alloc.bind", plant_bind_length, config=JUDGED_IN_TIME),
    Bug("bind_any_offset", "The target verifies ... that the slot of the ticket holds that Block "
        "Offset", "direct.bind.verify", plant_bind_any_offset, config=JUDGED_IN_TIME),
    Bug("never_abandoned", "rejects a later BIND for that ticket with status TICKET_ABANDONED",
        "direct.ticket.abandoned", lambda t, mp: mp.setattr(
            direct_mod.TicketWatch, "abandoned", lambda s, k: False)),
    Bug("abandon_keeps_window", "the target MUST ensure that no RDMA Write of the initiator can "
        "still reach the block", "direct.ticket.partition_revoked", plant_abandon_keeps_window),
    Bug("head_misaligned", "the Tagged Offset MUST be a multiple of 8", "direct.head.aligned",
        lambda t, mp: grant(mp, "grant_partition", lambda a, f, w: f.update(
            {"hello_ack.head.offset": f["hello_ack.head.offset"] + 4}))),
    Bug("partition_too_wide", "[the Partition STag] covers nothing else", "direct.partition.bounds",
        plant_wider_partition),
    Bug("partition_any_connection", "[the Partition STag] is specific to this connection",
        "direct.partition.connection", lambda t, mp: grant(
            mp, "grant_partition", lambda a, f, w: setattr(w[0], "connection", None))),
    Bug("stags_any_connection", "In the default mode, the target exposes no STag of its own memory",
        "security.default_mode.no_stag", lambda t, mp: grant(mp, "grant_direct_load", lambda a, f, w: [
            setattr(x, "connection", None) for x in w])),
    Bug("no_clear_on_free", "targets SHOULD clear blocks when they are freed", "security.clear_freed",
        lambda t, mp: set_attr(t, t.target.executor, "clear_freed", False)),
    Bug("valid_before_data", "The entry is written after the data, so any initiator that observes "
        "VALID in the entry also observes the data", "direct.load.data_before_valid",
        lambda t, mp: set_handler(t, "ALLOC_STORE", _checked_alloc_store(_bind_then_fetch))),
    Bug("valid_before_copy", "The entry is written after the data", "direct.load.data_before_valid",
        lambda t, mp: set_handler(t, "ALLOC_STORE", _checked_alloc_store(_bind_then_copy))),
    # Free-Block Ring
    Bug("deferred_free_overwrites", "the target MUST defer the write until the slot is consumed; it "
        "MUST NOT overwrite the slot", "direct.ring.deferred_free", plant_deferred_free_overwrites,
        config=JUDGED_IN_TIME),
    Bug("settle_overwrites", "the target MUST defer the write until the slot is consumed; it MUST NOT "
        "overwrite the slot", "direct.ring.deferred_free",
        lambda t, mp: mp.setattr(FreeRing, "settle", _settle_unconsumed), config=JUDGED_IN_TIME),
    Bug("bind_keeps_slot", "the slot is marked consumed ... by the target when it processes BIND",
        "direct.ring.laps", lambda t, mp: set_handler(t, "BIND", shadowed(
            lambda conn: conn.state.partition and conn.state.partition.ring, "consume", lambda offset: None)),
        config=JUDGED_IN_TIME),
    Bug("slots_never_reused", "Slot Offset ... wrapping at the end of the ring", "direct.ring.laps",
        plant_slots_never_reused, config=JUDGED_IN_TIME),
    # issue 24: promises kept late, accounting carried, full widths, canaries, negotiation,
    # precedence, limits
    Bug("request_id_upper_cached", "Request ID is chosen by the initiator and echoed in the completion",
        "completion.request_id.full_width", plant_request_id_upper_cached),
    Bug("handle_32_bits", "Block Handle: A 64-bit name ... the handle MUST be within a range the "
        "initiator is authorized for", "ops.handle.upper_half", plant_handle_32_bits),
    Bug("tagged_offset_32_bits", "Tagged Offset (64 bits)", "ops.descriptor.offset_full_width",
        plant_offset_32_bits),
    Bug("initiator_id_low_half", "a target uses it [the Initiator ID] to restore the initiator's handle "
        "range and bindings", "session.initiator_id.full_width", plant_initiator_id_low_half),
    Bug("load_pads_descriptor", "It RDMA-writes Data Length octets of the block to the Data Descriptor",
        "ops.load.canaries", plant_load_pads_descriptor),
    Bug("record_32_octets", "the target instead writes a 24-octet completion record",
        "completion.record.canaries", lambda t, mp: mp.setattr(conn_mod, "codec", _RecordShim()),
        transports=("roce",)),
    Bug("store_overruns_block", "It obtains the data ... and writes it into the block",
        "ops.store.neighbours", plant_store_overruns),
    Bug("record_not_negotiated", "If the target advertised RECORD_COMPLETION and the request has the "
        "RECORD flag", "session.features.not_granted", plant_record_not_negotiated, transports=("roce",)),
    Bug("features_not_masked", "HELLO_ACK Features: what the HELLO requested and the target offers",
        "session.features.not_granted", lambda t, mp: wrap_method(
            mp, Connection, "_hello_ack", hello_ack_body(lambda self, body: body.update(
                {"hello_ack.features": body["hello_ack.features"] | Feature.RECORD_COMPLETION})))),
    Bug("sealed_before_generation", "validates every request before touching memory: ... the "
        "Generation", "ops.status.precedence",
        lambda t, mp: set_handler(t, "STORE", if_entry(lambda e, r: e.sealed, _sealed_first))),
    Bug("block_size_exclusive", "lengths MUST NOT exceed Block Size", "ops.limits.lengths",
        plant_block_size_exclusive),
    Bug("range_end_inclusive", "its own range for stores and frees", "ops.limits.range_edges",
        lambda t, mp: mp.setattr(InitiatorState, "owns", lambda self, h: self.handle_base <= h
                                 <= self.handle_base + self.handle_count)),
    Bug("ticket_timeout_tenths", "within the Ticket Timeout advertised in HELLO_ACK",
        "direct.ticket.within_timeout", plant_ticket_timeout_tenths, config=JUDGED_IN_TIME),
    Bug("credit_lost_on_reconnect", "Request Credits ... an initiator that reconnects ... receives the "
        "same handle range", "session.promises.late", plant_credit_lost_on_reconnect),
    Bug("usage_forgotten_on_reconnect", "An initiator's usage is the number of handles it has bound",
        "ops.quota.carried", plant_usage_forgotten_on_reconnect),
    Bug("full_target_drops_hello", "the initiator sends HELLO and the target answers with HELLO_ACK",
        "session.hello_ack.when_full", plant_full_target_drops_hello),
    Bug("full_target_evicts_active", "Quotas and handle ranges are set at session setup and changed by "
        "reconnecting", "session.hello_ack.when_full",
        lambda t, mp: mp.setattr(InitiatorState, "heard", lambda self, now: float("-inf"))),
    Bug("reclaim_keeps_usage", "the target releases one unit of usage ... when an abandoned ticket is "
        "reclaimed", "direct.ticket.reclaimed_unit", plant_reclaim_keeps_usage),
    # the two checker gaps mutation sample 4 found (docs/MUTANTS.md)
    Bug("quota_by_equality", "If a target observes an allocation by an initiator that exceeds its "
        "quota, it completes the request with NO_SPACE", "direct.quota.tickets",
        plant_usage_compared_for_equality, config=JUDGED_IN_TIME),
    Bug("partition_not_requested", "Target-executed allocations take blocks from a ring shared by all "
        "initiators that the target serves this way", "session.features.shared_ring",
        plant_partition_for_every_session),
    Bug("partition_kept_not_granted", "Target-executed allocations take blocks from a ring shared by "
        "all initiators that the target serves this way", "session.features.shared_ring",
        plant_partition_kept_when_not_granted),
    Bug("bound_ticket_counted_twice", "An initiator's usage is the number of handles it has bound plus "
        "the number of tickets it has taken and not yet bound", "direct.quota.bound_ticket",
        plant_bound_ticket_counted_twice, config=JUDGED_IN_TIME),
    Bug("shared_ring_overcommitted", "The target assigns each initiator an Allocation Quota at session "
        "setup and keeps the sum of quotas not larger than F", "session.quota.sum",
        plant_shared_ring_counted_larger),
    # issue 31: the target classes that got through
    Bug("addr_le_when_requested", "All fields ... are in network byte order, except the address fields "
        "listed in when the target selects little-endian address fields",
        "session.features.requested_not_granted", plant_addr_le_when_requested),
    Bug("store_seal_from_inline", "0x0002 SEAL: seal the block after the store", "ops.flags.stores",
        plant_store_seal_from_inline),
    Bug("load_honours_seal", "0x0002 SEAL: seal the block after the store", "ops.flags.load_free",
        plant_load_honours_seal),
    Bug("quota_checked_first", "validates every request before touching memory ... 1. The handle MUST be "
        "in the initiator's range and its entry MUST NOT be VALID. 2. The target allocates a block",
        "ops.status.precedence.quota", plant_quota_checked_first),
    Bug("bind_quota_counts_its_ticket", "[BIND] verifies ... that the initiator is within its quota",
        "direct.quota.bind_edge", plant_bind_quota_counts_its_ticket),
    Bug("bind_verifies_ticket_first", "[BIND] It validates every request before touching memory ... The "
        "target verifies ... that the slot of the ticket holds that Block Offset", "direct.bind.precedence",
        plant_bind_verifies_ticket_first),
    Bug("invalidate_last_descriptor", "0x0008 INVALIDATE: ... invalidating the STag of the initiator's Data "
        "Descriptor", "completion.invalidate.two_descriptors", plant_invalidate_last_descriptor),
    Bug("hello_version_ignored", "Version is 1", "session.hello.version", plant_hello_version_ignored),
    Bug("credits_from_config", "Completion Credits is the number of receive buffers the initiator has "
        "posted for COMPLETION messages", "session.credits.completion", plant_credits_from_config),
    Bug("clear_data_length", "targets SHOULD clear blocks when they are freed", "security.clear_freed",
        plant_clear_data_length),
    Bug("release_skips_clear", "targets SHOULD clear blocks when they are freed", "security.clear_freed",
        plant_release_skips_clear),
]
BY_NAME = {b.name: b for b in CORPUS}
assert len(BY_NAME) == len(CORPUS)
