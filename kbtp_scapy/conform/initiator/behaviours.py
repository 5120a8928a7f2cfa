"""The checking target's deliberate deviations, one class per way of testing an initiator.

Each is a ``Behaviour`` (``target.py``): it changes only what its case needs and keeps
what it did, so the case can say what the initiator was shown.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from ... import codec, ring as counters
from ...rnic.qp import ConnectionLost, RemoteError
from ...tables import memory as M
from ...target.direct import TicketWatch
from ...target.operations import Outcome
from ...target.ring import FreeRing
from ...vocab import AnyMessage, EntryFlag, Feature, HelloAck, Opcode, RequestFlag, Status
from ..hold import SETTLE, ReadHold
from .observe import Access
from .target import Behaviour, CheckedConnection

Run = Callable[[], Awaitable[Outcome]]


class Pace:
    """The initiator's own pace: the longest gap between two requests that came while
    others were held, and the hold that pace asks for (at least ``floor``; four such gaps
    when longer), so an initiator on a busy host that sends slowly is still given time
    to show a request too many."""

    def __init__(self, floor: float) -> None:
        self.floor = floor
        self._last = 0.0
        self._gap = 0.0

    def arrived(self, held: int) -> None:
        """A request came, with ``held`` others held at the time."""
        now = asyncio.get_running_loop().time()
        if held:
            self._gap = max(self._gap, now - self._last)
        self._last = now

    def restart(self) -> None:
        self._gap = 0.0

    @property
    def hold(self) -> float:
        return max(self.floor, 4 * self._gap)


class Grant(Behaviour):
    """Grant ``credits`` Request Credits and hold every completion ``hold`` seconds, or
    four times the longest gap seen between two requests in flight together if longer
    (an initiator on a busy host sends slowly): an initiator that sends past its credits
    shows it while they are held."""

    def __init__(self, credits: int, hold: float = SETTLE) -> None:
        self.credits, self.pace = credits, Pace(hold)
        self._held = 0

    def hello_ack(self, conn: CheckedConnection, body: HelloAck) -> None:
        body["hello_ack.request_credits"] = self.credits

    def complete(self, conn: CheckedConnection, req: AnyMessage, outcome: Outcome,
                 send: Callable[[], None]) -> None:
        self.pace.arrived(self._held)
        self._held += 1

        def sent() -> None:
            self._held -= 1
            send()
        asyncio.get_running_loop().call_later(self.pace.hold, sent)


class Strays(Grant):
    """``Grant``, and while each completion is held, two COMPLETIONs that answer nothing
    (an unknown Request ID with status OK, and the previous completion again): they
    must neither give the initiator a credit back nor be taken as an answer. Sent only
    while the Completion Credits the HELLO announced leave room for them."""

    def __init__(self, credits: int, hold: float = SETTLE) -> None:
        super().__init__(credits, hold)
        self.sent = 0
        self.last: dict[str, int] | None = None

    def complete(self, conn: CheckedConnection, req: AnyMessage, outcome: Outcome,
                 send: Callable[[], None]) -> None:
        room = (conn.session.hello or {}).get("hello.completion_credits", 0) - self.credits
        used = {m.decoded["request_id"] for m in conn.session.messages if m.decoded}
        unknown = max(used) + 0x1000
        if room >= 2:
            conn.send_completion(unknown, req["handle"], Status.OK)
            if self.last is not None:
                conn.send_completion(**self.last)
            self.sent += 1 + (self.last is not None)

        def sent() -> None:            # only a completion already sent is sent again
            send()
            self.last = {"request_id": req["request_id"], "handle": req["handle"],
                         "status": outcome.status, "data_length": outcome.data_length,
                         "block_offset": outcome.block_offset, "generation": outcome.generation}
        super().complete(conn, req, outcome, sent)


class Burst(Behaviour):
    """Grant ``extra`` Request Credits more than the Completion Credits C the HELLO
    announced, and hold completions: once C requests wait, until one more comes (the
    initiator broke its promise: sent at once, they need C + 1 buffers) or none came for
    a quiet spell; then send them all at once. The spell is ``SETTLE`` or four times the
    longest gap between the requests held, whichever is longer: on a busy host an
    initiator that keeps more than C in flight still shows it, however slowly it sends."""

    def __init__(self, extra: int) -> None:
        self.extra = extra
        self.held: list[Callable[[], None]] = []
        self.bursts: list[int] = []
        self.no_buffer = 0          # COMPLETIONs the initiator's RNIC had no buffer for (RNR NAKs)
        self._timer: asyncio.TimerHandle | None = None
        self._conn: CheckedConnection | None = None
        self._pace = Pace(SETTLE)

    def hello_ack(self, conn: CheckedConnection, body: HelloAck) -> None:
        credits = (conn.session.hello or {}).get("hello.completion_credits", 1)
        body["hello_ack.request_credits"] = min(credits + self.extra, 0xFFFF)

    def complete(self, conn: CheckedConnection, req: AnyMessage, outcome: Outcome,
                 send: Callable[[], None]) -> None:
        self._conn = conn
        self._pace.arrived(len(self.held))
        self.held.append(send)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if len(self.held) > (conn.session.hello or {}).get("hello.completion_credits", 1):
            self._flush()
        else:
            self._timer = asyncio.get_running_loop().call_later(self._pace.hold, self._flush)

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        held, self.held = self.held, []
        self._pace.restart()
        self.bursts.append(len(held))
        for send in held:
            send()
        asyncio.get_running_loop().call_later(SETTLE, self._refused)

    def _refused(self) -> None:
        """RoCEv2: a COMPLETION that found no receive buffer is retried by the RNIC for as
        long as RNR NAKs come back; end the connection then, so that the initiator's
        broken promise ends its session (iWARP's Terminate does that by itself)."""
        conn = self._conn
        if conn is None or conn.qp.closed:
            return
        self.no_buffer = conn.qp.stats.get("rnr_naks", 0)
        if self.no_buffer:
            conn.qp.abort(f"{self.no_buffer} RNR NAK(s): no receive buffer for a COMPLETION")


class Reverse(Behaviour):
    """Hold completions until ``count`` wait (or ``SETTLE`` passes), then send them last first."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.held: list[Callable[[], None]] = []
        self.reordered = 0
        self._timer: asyncio.TimerHandle | None = None

    def complete(self, conn: CheckedConnection, req: AnyMessage, outcome: Outcome,
                 send: Callable[[], None]) -> None:
        self.held.append(send)
        if len(self.held) >= self.count:
            self._flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(3 * SETTLE, self._flush)

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        held, self.held = self.held, []
        if len(held) > 1:
            self.reordered += len(held)
        for send in reversed(held):
            send()


class Duplicate(Behaviour):
    """Before each completion, send the previous completion again (a duplicate of a
    Request ID the initiator has retired)."""

    def __init__(self) -> None:
        self.last: dict[str, int] | None = None
        self.sent = 0

    def complete(self, conn: CheckedConnection, req: AnyMessage, outcome: Outcome,
                 send: Callable[[], None]) -> None:
        if self.last is not None:
            conn.send_completion(**self.last)
            self.sent += 1
        send()
        self.last = {"request_id": req["request_id"], "handle": req["handle"],
                     "status": outcome.status, "data_length": outcome.data_length,
                     "block_offset": outcome.block_offset, "generation": outcome.generation}


class Unknown(Behaviour):
    """Before each completion, one with a Request ID the initiator never used, with
    status INTERNAL and the same handle."""

    def __init__(self) -> None:
        self.sent = 0

    def complete(self, conn: CheckedConnection, req: AnyMessage, outcome: Outcome,
                 send: Callable[[], None]) -> None:
        used = {m.decoded["request_id"] for m in conn.session.messages if m.decoded}
        rid = (req["request_id"] ^ 0x5A5A_0000_0000_0000) or 0x5A5A
        if rid not in used:
            conn.send_completion(rid, req["handle"], Status.INTERNAL)
            self.sent += 1
        send()


class Statuses(Behaviour):
    """Answer the requests of ``opcode`` (one name, or several joined by ``|``) with
    ``statuses``, each opcode in turn from the start of the list (then as the reference)."""

    def __init__(self, opcode: str, statuses: list[int]) -> None:
        self.left: dict[int, list[int]] = {Opcode[name]: list(statuses) for name in opcode.split("|")}

    async def operation(self, conn: CheckedConnection, req: AnyMessage, run: Run) -> Outcome:
        left = self.left.get(req["opcode"])
        if left:
            return Outcome(left.pop(0))
        return await run()


class Decoy(Behaviour):
    """LOAD: decoy octets into the Data Descriptor, a pause, the real data, the completion."""

    def __init__(self) -> None:
        self.decoys: list[bytes] = []

    async def operation(self, conn: CheckedConnection, req: AnyMessage, run: Run) -> Outcome:
        if req["opcode"] == Opcode.LOAD and req["handle"] in conn.target.memory.table:
            entry = conn.target.memory.table.read(req["handle"])
            if entry.valid and 0 < entry.data_length <= req["dd.length"]:
                decoy = bytes(b ^ 0xA5 for b in conn.target.memory.block(entry.block_offset,
                                                                         entry.data_length))
                self.decoys.append(decoy)
                await _signaled(conn.qp.write(req["dd.stag"], req["dd.offset"], decoy))
                await asyncio.sleep(SETTLE)
        return await run()


class Probe(Behaviour):
    """Before the first request of ``opcode`` is executed, probe the buffer a descriptor
    of it names at its last octet (must be reached) and at the octet past it (must be
    refused by the initiator's RNIC): RDMA Writes into a LOAD's Data Descriptor
    (``what="load"``) or its completion record slot (``"record"``), RDMA Reads of a
    store's Data Descriptor (``"store"``). A probe's answer, and the refusal of the one past
    the buffer, are waited for ``patience`` seconds: a busy initiator refuses late, and a
    correct one ends the wait at once (the case passes the program's {timeout} in halves,
    so the program does not give up on its request meanwhile)."""

    def __init__(self, what: str, patience: float) -> None:
        self.what, self.patience = what, patience
        self.opcodes = {Opcode.LOAD} if what in ("load", "record") else {Opcode.STORE, Opcode.ALLOC_STORE}
        self.edge: str | None = None       # "placed" or why not
        self.past: str | None = None       # "refused: ..." or "placed"
        self.length = 0

    def _buffer(self, req: AnyMessage) -> tuple[int, int, int] | None:
        if self.what == "record":
            return (req["cd.stag"], req["cd.offset"], M.COMPLETION_RECORD.size) if "cd.stag" in req else None
        if req["flags"] & RequestFlag.INLINE:
            return None
        return req["dd.stag"], req["dd.offset"], req["dd.length"]

    async def operation(self, conn: CheckedConnection, req: AnyMessage, run: Run) -> Outcome:
        named = self._buffer(req) if req["opcode"] in self.opcodes and self.past is None else None
        if named is None or not named[2]:
            return await run()
        stag, at, self.length = named
        self.edge = await _probe(conn, self.what != "store", stag, at + self.length - 1,
                                 self.patience, SETTLE)
        if self.edge == "placed":
            self.past = await _probe(conn, self.what != "store", stag, at + self.length,
                                     self.patience, self.patience)
        return await run()        # on a connection a refusal ended, this ends the session


async def _signaled(future: asyncio.Future | None) -> None:
    """Wait for a signaled work request (the queue pair gives every one a future)."""
    assert future is not None
    await future


async def _probe(conn: CheckedConnection, write: bool, stag: int, offset: int, answer: float,
                 settle: float, octet: bytes = b"\x00") -> str:
    """Whether a 1-octet RDMA Write (of ``octet``; or a Read) of the initiator's buffer was
    placed, its completion waited for ``answer`` seconds. An iWARP Write completes once it is sent
    (RDMAP acknowledges nothing), so a refusal shows as the peer's Terminate ending the
    connection: it must still be up ``settle`` seconds later."""
    try:
        if write:
            await asyncio.wait_for(_signaled(conn.qp.write(stag, offset, octet)), answer)
        else:
            await asyncio.wait_for(conn.qp.read(stag, offset, 1), answer)
        await asyncio.wait_for(conn.qp.wait_closed(), settle)
    except (RemoteError, ConnectionLost) as exc:
        return f"refused ({exc or type(exc).__name__})"
    except TimeoutError:
        return "placed" if not conn.qp.closed else f"refused (no answer within {answer:g} s)"
    return f"refused (the connection ended: {conn.qp.error or 'closed'})"


class Overreach(Behaviour):
    """Before the first store that the target reads by RDMA Read is executed, write its
    source buffer's first octet (with the value a Read of it returns, so nothing changes
    if it is placed): a buffer exposed to be read must refuse Writes."""

    def __init__(self) -> None:
        self.write: str | None = None      # "placed" or "refused: ..."

    async def operation(self, conn: CheckedConnection, req: AnyMessage, run: Run) -> Outcome:
        if (self.write is None and req["opcode"] in (Opcode.STORE, Opcode.ALLOC_STORE)
                and not req["flags"] & RequestFlag.INLINE and req["dd.length"]):
            stag, at = req["dd.stag"], req["dd.offset"]
            try:
                first = bytes(await asyncio.wait_for(conn.qp.read(stag, at, 1), 2.0))
            except (RemoteError, ConnectionLost, TimeoutError):
                return await run()       # its own Read refused: the store fails on its own
            self.write = await _probe(conn, True, stag, at, 2.0, SETTLE, first)
        return await run()


class DirectLoadWindow(Behaviour):
    """DIRECT_LOAD: hold each Read's answer ``SETTLE`` seconds (a Read issued meanwhile did
    not wait for the previous one; unless not ``hold``), and in entry-block-entry window
    number ``window`` (0: the first) change what
    the second entry read shows (``mode``): ``generation`` moves the entry's Generation in
    memory, ``valid`` shows it with VALID cleared, ``sealed`` with SEALED cleared. The
    block read of that window returns decoy octets."""

    def __init__(self, mode: str | None = None, window: int = 0, hold: bool = True) -> None:
        self.mode, self.hold = mode, hold
        self.window = window            # which entry-block-entry window to change (0: the first)
        self.decoy = b""
        self.changed = False
        self.overlapped: list[str] = []
        self._pending: Access | None = None
        self._window: list[Access] = []
        self._seen = 0                  # windows completed before the one to change

    def read(self, conn: CheckedConnection, access: Access, data: bytes) -> bytes:
        if access.region not in ("table", "pool"):
            return data
        if self._pending is not None:
            self.overlapped.append(f"{access.region} read at offset {access.offset:#x} issued while "
                                   f"the {self._pending.region} read before it was unanswered")
        self._pending = access
        if self.hold:
            hold = _hold_responses(conn)
            asyncio.get_running_loop().call_later(SETTLE, self._answered, hold, access)
        else:
            self._pending = None
        if self.mode is None or self.changed:
            return data
        self._window.append(access)
        kinds = [a.region for a in self._window]
        if kinds == ["table", "pool"] and self._seen == self.window:
            self.decoy = bytes(b ^ 0x5A for b in data) or b""
            return self.decoy
        if kinds == ["table", "pool", "table"]:
            if self._seen < self.window:
                self._seen += 1
                self._window = []
                return data
            self.changed = True
            return self._second_entry(conn, access, data)
        if kinds[-1] == "table":
            self._window = [access]
        return data

    def _second_entry(self, conn: CheckedConnection, access: Access, data: bytes) -> bytes:
        entry = codec.decode_struct(M.TABLE_ENTRY, data, conn.addr_le)
        if self.mode == "generation":
            table = conn.target.memory.table
            handle = table.base_handle + (access.offset - conn.session.granted.get(
                "hello_ack.table.offset", 0)) // M.ENTRY_SIZE
            e = table.read(handle)
            e.generation = e.generation % 0xFFFF + 1
            table.write(handle, e)
            entry["entry.generation"] = e.generation
        elif self.mode == "valid":
            entry["entry.flags"] &= ~EntryFlag.VALID
        elif self.mode == "sealed":
            entry["entry.flags"] &= ~EntryFlag.SEALED
        return codec.encode_struct(M.TABLE_ENTRY, entry, conn.addr_le)

    def _answered(self, hold: ReadHold, access: Access) -> None:
        if self._pending is access:
            self._pending = None
        hold.release()


class EntryShown(Behaviour):
    """DIRECT_LOAD: every read of a Table entry shows it with the flags ``clear`` cleared
    and all else as memory holds it (a target that leaves SEALED set when it unbinds),
    and every read of the Pool returns decoy octets (a block no binding holds may hold
    anything)."""

    def __init__(self, clear: int) -> None:
        self.clear = clear
        self.decoy = b""

    def read(self, conn: CheckedConnection, access: Access, data: bytes) -> bytes:
        if access.region == "pool":
            self.decoy = bytes(b ^ 0x5A for b in data)
            return self.decoy
        if access.region != "table":
            return data
        entry = codec.decode_struct(M.TABLE_ENTRY, data, conn.addr_le)
        entry["entry.flags"] &= ~self.clear
        return codec.encode_struct(M.TABLE_ENTRY, entry, conn.addr_le)


def _hold_responses(conn: CheckedConnection) -> ReadHold:
    """Hold the Read Responses of the target's queue pair (``conform/hold.py`` works on
    either end of a connection)."""
    if conn.read_hold is None:
        conn.read_hold = ReadHold(conn.qp)
    hold = conn.read_hold
    hold.hold()
    return hold


class SlotReads(Behaviour):
    """DIRECT_ALLOC: the first reads of the ticket's slot show it not ready yet (twice an
    old Sequence with a stale Block Offset, then twice the right Sequence with Block
    Offset all ones), then torn (the right Sequence with another block's offset), then
    as it is. An initiator that skips any of the checks takes a wrong Block Offset."""

    def __init__(self) -> None:
        self.shown: list[tuple[int, int]] = []
        self.stale = 0
        self.untrusted = 5          # reads shown not ready, or torn

    def read(self, conn: CheckedConnection, access: Access, data: bytes) -> bytes:
        if access.region != "ring":
            return data
        slot = codec.decode_struct(M.RING_SLOT, data, conn.addr_le)
        n = len(self.shown)
        sequence, block = slot["slot.sequence"], slot["slot.block_offset"]
        if block == M.SLOT_CONSUMED:
            return data
        first = conn.session.granted.get("hello_ack.partition.offset", 0)
        size = conn.target.config.block_size
        count = conn.session.granted.get("hello_ack.partition.count", 1)
        self.stale = first + ((block - first) // size + 1) % max(count, 1) * size
        old = (sequence - 1) & 0xFFFFFFFF
        fake = [(old, self.stale), (old, self.stale), (sequence, M.SLOT_CONSUMED),
                (sequence, M.SLOT_CONSUMED), (sequence, self.stale)]
        if n < len(fake):
            slot["slot.sequence"], slot["slot.block_offset"] = fake[n]
        self.shown.append((slot["slot.sequence"], slot["slot.block_offset"]))
        return codec.encode_struct(M.RING_SLOT, slot, conn.addr_le)


class BindSnapshot(Behaviour):
    """DIRECT_ALLOC: as each BIND lands in its receive buffer (in wire order with the
    initiator's RDMA Writes), what the block it names holds for its Data Length."""

    def __init__(self) -> None:
        self.snapshots: list[tuple[int, bytes]] = []     # (Block Offset, octets)

    def placed(self, conn: CheckedConnection, payload: bytes) -> None:
        if codec.opcode_of(payload) != Opcode.BIND:
            return
        try:
            bind = codec.decode(payload, conn.addr_le)
        except codec.Malformed:
            return
        memory = conn.target.memory
        at, length = bind["bind.block_offset"] - memory.pool_base, bind["bind.data_length"]
        if 0 <= at and at + length <= len(memory.pool_view):
            self.snapshots.append((bind["bind.block_offset"], bytes(memory.pool_view[at:at + length])))


class Abandon(Behaviour):
    """BIND: answered TICKET_ABANDONED."""

    async def operation(self, conn: CheckedConnection, req: AnyMessage, run: Run) -> Outcome:
        if req["opcode"] == Opcode.BIND:
            return Outcome(Status.TICKET_ABANDONED)
        return await run()



class OtherOpcodes(Behaviour):
    """Before each completion, the same octets under every other opcode (cut or padded to
    that opcode's length, Status INTERNAL): messages that carry the Request ID of a
    waiting request but are not its COMPLETION. Never more of them than the Completion
    Credits the HELLO announced leave room for, beside the completion itself."""

    def __init__(self) -> None:
        self.sent = 0

    def complete(self, conn: CheckedConnection, req: AnyMessage, outcome: Outcome,
                 send: Callable[[], None]) -> None:
        room = (conn.session.hello or {}).get("hello.completion_credits", 1) - 1
        completion = codec.encode({
            "opcode": Opcode.COMPLETION, "request_id": req["request_id"], "handle": req["handle"],
            "generation": outcome.generation, "status": Status.INTERNAL,
            "completion.data_length": outcome.data_length, "completion.reserved": 0,
            "completion.block_offset": outcome.block_offset}, conn.addr_le)
        for opcode in [o for o in Opcode if o != Opcode.COMPLETION][:max(room, 0)]:
            length = codec.message_length(opcode, 0)
            raw = bytearray(completion[:length].ljust(length, b"\0"))
            raw[1] = opcode
            if not conn.qp.closed:
                conn.qp.send(bytes(raw), signaled=False)
                self.sent += 1
        send()


class TableWindow(Behaviour):
    """DIRECT_LOAD: a Table descriptor that names the entries of the initiator's range
    except its first ``skip`` and its last ``short`` handles (Table Base Handle, Tagged
    Offset and Count moved together, so every entry it names is where the text puts it).
    The entries left out stay in the Table STag's memory, just outside the descriptor."""

    def __init__(self, skip: int = 1, short: int = 1) -> None:
        self.skip, self.short = skip, short

    def hello_ack(self, conn: CheckedConnection, body: HelloAck) -> None:
        if not body["hello_ack.features"] & Feature.DIRECT_LOAD:
            return
        first = body["hello_ack.handle_base"] + self.skip
        moved = first - body["hello_ack.table_base_handle"]
        body["hello_ack.table_base_handle"] = first
        body["hello_ack.table.offset"] += M.ENTRY_SIZE * moved
        body["hello_ack.table.count"] = body["hello_ack.handle_count"] - self.skip - self.short


class RingStart(Behaviour):
    """DIRECT_ALLOC: the initiator's ring as it is after ``first`` allocations each freed
    again in turn (Head at Ticket ``first``), instead of at Ticket 0: its tickets are far
    from 0, and the Slot Offset wraps at the end of the ring while the Ticket goes on."""

    def __init__(self, first: int) -> None:
        self.first = first

    def hello_ack(self, conn: CheckedConnection, body: HelloAck) -> None:
        part, watch = conn.state.partition, conn.state.watch
        if not body["hello_ack.features"] & Feature.DIRECT_ALLOC or part is None or watch is None:
            return
        start_ring(part.ring, self.first, part.offsets)
        moved = TicketWatch(conn.state, conn.target.rnic_memory, conn.target.config.ticket_timeout_ms)
        moved.windows = watch.windows           # a watch starts at the Head it finds
        conn.state.watch = moved


def start_ring(ring: FreeRing, first: int, blocks: Sequence[int]) -> None:
    """The text's "Initialization" rule with every ticket moved on by ``first``: ticket
    t = first + i (mod 2**32) has slot t mod N, holding {t, the i-th block} for i < F
    and {t - N, all ones} after; Head at Ticket ``first``, Tail at ``first`` + F, each
    with its Slot Offset 16 * (Ticket mod N) when counters are masked."""
    size, f = ring.size, len(blocks)

    def counter(ticket: int) -> bytes:
        ticket &= 0xFFFFFFFF
        value = counters.join(ticket, M.SLOT_SIZE * (ticket % size) if ring.masked else 0)
        return value.to_bytes(8, ring.memory.order)

    for i in range(size):
        ticket = (first + i) & 0xFFFFFFFF
        sequence, block = (ticket, blocks[i]) if i < f else ((ticket - size) & 0xFFFFFFFF, M.SLOT_CONSUMED)
        at = M.SLOT_SIZE * (ticket % size)
        ring.slots[at:at + M.SLOT_SIZE] = codec.encode_struct(
            M.RING_SLOT, {"slot.sequence": sequence, "slot.reserved": 0, "slot.block_offset": block},
            ring.addr_le)
    ring.head[:], ring.tail[:] = counter(first), counter(first + f)
