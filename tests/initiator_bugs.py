"""Realistic bugs to plant in the reference initiator, one at a time, to see who catches them.

Each bug breaks one sentence of the specification that binds an initiator and shows on
the wire or in what the program reports. It is planted from outside, never in the
source: this file is also the program the initiator checker runs,

    python tests/initiator_bugs.py BUG URL [kbtp initiator options] script ...

which plants ``BUG`` into the reference initiator's classes in its own process and then
runs ``kbtp initiator`` with the rest of the arguments. ``tools/initiator_catch_rate.py``
runs each bug against the case meant for it on both bindings (a ``fuzz:SEED-INDEX``
case is a case of the hostile target, ``kbtp fuzz --role initiator --replay``);
``tests/test_conform_initiator.py`` runs a few of them in the suite.
"""
from __future__ import annotations

import asyncio
import contextvars
import itertools
import secrets
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __name__ == "__main__":                         # run as a program: import the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kbtp_scapy import codec, ring as counters  # noqa: E402
from kbtp_scapy.cli import initiator as cli_initiator  # noqa: E402
from kbtp_scapy.initiator import client, driver, results  # noqa: E402
from kbtp_scapy.initiator.client import Initiator  # noqa: E402
from kbtp_scapy.initiator.results import KbtpError, Result  # noqa: E402
from kbtp_scapy.initiator.script import RESULTS, result_line  # noqa: E402
from kbtp_scapy.rnic import Access  # noqa: E402
from kbtp_scapy.rnic.qp import ConnectionLost  # noqa: E402
from kbtp_scapy.tables import RING_COUNTER, memory as M  # noqa: E402
from kbtp_scapy.tables.enums import STATUS  # noqa: E402
from kbtp_scapy.vocab import EntryFlag, Opcode, RequestFlag, Status  # noqa: E402

Plant = Callable[[], None]


@dataclass(frozen=True)
class Bug:
    name: str
    sentence: str          # what the bug breaks, in the specification's words
    case: str              # the initiator case meant to catch it
    plant: Plant
    transports: tuple[str, ...] = ("iwarp", "roce")


def patch(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    setattr(owner, name, make(getattr(owner, name)))


def encoding(change: Callable[[dict], None], addr_le_only: bool = False) -> Plant:
    """The initiator's messages encoded after ``change`` rewrote their values (with
    ``addr_le_only``, only those of ADDR_LE sessions)."""
    def plant() -> None:
        real = codec.encode

        class Shim:
            def __getattr__(self, name: str) -> Any:
                return getattr(codec, name)

            @staticmethod
            def encode(values: dict, addr_le: bool = False) -> bytes:
                if addr_le or not addr_le_only:
                    values = dict(values)
                    change(values)
                return real(values, addr_le)
        client.codec = Shim()
    return plant


def after_hello(change: Callable[[Initiator], None]) -> Plant:
    def plant() -> None:
        def make(original):
            async def hello(self, features):
                await original(self, features)
                change(self)
            return hello
        patch(Initiator, "_hello", make)
    return plant


def _hello_field(key: str, value: int) -> Callable[[dict], None]:
    def change(values: dict) -> None:
        if values["opcode"] == Opcode.HELLO:
            values[key] = value
    return change


def _ids(make_id: Callable[[], bytes]) -> Plant:
    def plant() -> None:
        cli_initiator._initiator_id = lambda id_hex, id_file: make_id()
    return plant


def _kept_ids(make_id: Callable[[], bytes]) -> Plant:
    """IDs from ``make_id``, kept in the ID file as the reference keeps its own."""
    def plant() -> None:
        def initiator_id(id_hex, id_file):
            path = Path(id_file)
            if path.exists():
                return bytes.fromhex(path.read_text().strip())
            value = make_id()
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(value.hex() + "\n")
            return value
        cli_initiator._initiator_id = initiator_id
    return plant


_counter = itertools.count(int(time.time() * 1000))


def plant_usage_ignored() -> None:
    Initiator.usage = property(lambda self: 0, lambda self, value: None)


def plant_free_uncounted() -> None:
    """A FREE leaves the usage as it was: the quota looks reached when it is not."""
    def make(original):
        async def free(self, *args, **kwargs):
            r = await original(self, *args, **kwargs)
            self.usage += 1
            return r
        return free
    patch(Initiator, "free", make)


def plant_alloc_store_uncounted() -> None:
    def make(original):
        async def alloc_store(self, *args, **kwargs):
            r = await original(self, *args, **kwargs)
            self.usage -= 1
            return r
        return alloc_store
    patch(Initiator, "alloc_store", make)


def _handle(offset: int, absolute: bool = False) -> Plant:
    def plant() -> None:
        driver.Runner.handle = lambda self, op: (0 if absolute else self.ini.target.handle_base) + op.handle + offset
    return plant


def _load_buffer(register_less: int = 0, length: Callable[[Initiator], int] | None = None) -> Plant:
    """LOAD whose buffer is registered ``register_less`` octets short of the Length it
    declares, or whose Length is ``length(ini)``."""
    declared = length

    def plant() -> None:
        async def load(self, handle, *, generation=0, allow_unsealed=False, length=None, record=False):
            size = declared(self) if declared else length or self.target.block_size
            buf = self.memory.buffer(size)
            region = self.memory.register(buf, Access.REMOTE_WRITE, length=size - register_less)
            record = self._record(record)
            result = await self._call({
                "opcode": Opcode.LOAD, "handle": handle, "generation": generation,
                "flags": self._flags(allow_unsealed=allow_unsealed, record=record,
                                     invalidate=self.invalidate and not record),
                "dd.stag": region.stag, "dd.offset": region.base, "dd.length": size}, [region], record)
            result.data = bytes(buf[:result.data_length])
            return result
        Initiator.load = load
    return plant


def plant_store_length_rounded() -> None:
    def make(original):
        async def _store(self, opcode, handle, data, generation, seal, inline, record):
            if inline is False or (inline is None and len(data) > self.target.max_inline):
                values = {"opcode": Opcode[opcode], "handle": handle, "generation": generation}
                size = -(-len(data) // 64) * 64
                src = self.memory.buffer(size)
                src[:len(data)] = data
                region = self.memory.register(src, Access.REMOTE_READ)
                values.update({"dd.stag": region.stag, "dd.offset": region.base, "dd.length": size,
                               "flags": self._flags(seal=seal, invalidate=self.invalidate)})
                return await self._call(values, [region], False)
            return await original(self, opcode, handle, data, generation, seal, inline, record)
        return _store
    patch(Initiator, "_store", make)


def plant_store_buffer_short() -> None:
    """The source buffer of a store registered 16 octets short of the Length it declares."""
    def make(original):
        async def _store(self, opcode, handle, data, generation, seal, inline, record):
            if inline is False or (inline is None and len(data) > self.target.max_inline):
                src = self.memory.buffer(len(data))
                src[:] = data
                region = self.memory.register(src, Access.REMOTE_READ, length=len(data) - 16)
                values = {"opcode": Opcode[opcode], "handle": handle, "generation": generation,
                          "dd.stag": region.stag, "dd.offset": region.base, "dd.length": len(data),
                          "flags": self._flags(seal=seal, invalidate=self.invalidate)}
                return await self._call(values, [region], False)
            return await original(self, opcode, handle, data, generation, seal, inline, record)
        return _store
    patch(Initiator, "_store", make)


def plant_record_slot_short() -> None:
    """Completion record slots registered with 16 octets, not 24."""
    def make(original):
        def register(self, buffer, access=Access.LOCAL, **kwargs):
            if len(buffer) == M.COMPLETION_RECORD.size and access == Access.REMOTE_WRITE:
                kwargs["length"] = 16
            return original(self, buffer, access, **kwargs)
        return register
    from kbtp_scapy.rnic.memory import MemoryTable
    patch(MemoryTable, "register", make)


def _inline_stag(values: dict) -> None:
    if values.get("flags", 0) & RequestFlag.INLINE:
        values["dd.stag"], values["dd.offset"] = 0x1234, 0x40


def _record_stag_zero(values: dict) -> None:
    if values.get("flags", 0) & RequestFlag.RECORD:
        values["cd.stag"] = 0


def plant_record_ungated() -> None:
    Initiator._record = lambda self, record: record


def plant_fifo_matching() -> None:
    real = results.match_completion

    def match(msg, waiting, addr_le):
        if msg.write_imm or not waiting:
            return real(msg, waiting, addr_le)
        try:
            c = codec.decode(msg.payload, addr_le)
        except codec.Malformed:
            return None
        rid = next(iter(waiting))
        future, _ = waiting.pop(rid)
        return future, Result.of_completion(rid, c)
    client.match_completion = match


def plant_unmatched_to_oldest() -> None:
    real = results.match_completion

    def match(msg, waiting, addr_le):
        got = real(msg, waiting, addr_le)
        if got is None and waiting and not msg.write_imm:
            c = codec.decode(msg.payload, addr_le)
            rid = next(iter(waiting))
            future, _ = waiting.pop(rid)
            return future, Result.of_completion(rid, c)
        return got
    client.match_completion = match


def plant_opcode_unchecked() -> None:
    """Any message with a waiting Request ID is taken as that request's completion,
    whatever its opcode (the Request ID looked at, the opcode not)."""
    real = results.match_completion

    def match(msg, waiting, addr_le):
        if msg.write_imm:
            return real(msg, waiting, addr_le)
        try:
            c = codec.decode(msg.payload, addr_le)
        except codec.Malformed:
            return None
        if c["request_id"] not in waiting:
            return None
        future, _ = waiting.pop(c["request_id"])
        return future, Result(c["request_id"], c["status"], c["generation"],
                              c.get("completion.data_length", 0), c.get("completion.block_offset", 0))
    client.match_completion = match


def plant_unknown_fatal() -> None:
    def make(original):
        def dispatch(self, msg):
            if results.match_completion(msg, dict(self._pending), self.addr_le) is None:
                self._receive(ConnectionLost(f"a completion for no request: {msg.payload[:24].hex()}"))
                return
            original(self, msg)
        return dispatch
    patch(Initiator, "_dispatch", make)


def _status_names(rename: Callable[[int, str], str]) -> Plant:
    def plant() -> None:
        def make(original):
            def init(self, status, result=None, detail=""):
                original(self, status, result, detail)
                self.name = rename(status, self.name)
            return init
        patch(KbtpError, "__init__", make)
    return plant


def plant_load_early() -> None:
    def make(original):
        async def load(self, handle, **kwargs):
            made: list[bytearray] = []
            buffer = self.memory.buffer

            def capture(size):
                b = buffer(size)
                made.append(b)
                return b
            self.memory.buffer = capture
            try:
                task = asyncio.ensure_future(original(self, handle, **kwargs))
                await asyncio.sleep(0)
            finally:
                self.memory.buffer = buffer
            early = None
            while not task.done():
                if made and any(made[0][:64]):
                    early = bytes(made[0])
                    break
                await asyncio.sleep(0.001)
            r = await task
            if early is not None:
                r.data = early[:r.data_length]
            return r
        return load
    patch(Initiator, "load", make)


def _direct_load(same: Callable[[dict, dict], bool] = lambda a, b: a == b, reread: bool = True,
                 together: bool = False, check_sealed: bool = True, check_valid: bool = True,
                 cached: bool = False) -> Plant:
    """``cached``: a handle once read valid at a Generation is trusted at it again after
    one entry read (no second entry read)."""
    def plant() -> None:
        async def direct_load(self, handle, *, attempts=8):
            stag, base, count = self._direct("table")
            pool_stag = self._direct("pool")[0]
            index = handle - self.target.fields["table_base_handle"]
            if not 0 <= index < count:         # as the reference: no read outside the Table
                raise KbtpError(Status.INVALID_HANDLE)
            at = base + index * M.ENTRY_SIZE
            verified = self.__dict__.setdefault("verified", {})
            for _ in range(attempts):
                first = await self._entry(stag, at)
                if check_valid and not first["entry.flags"] & EntryFlag.VALID:
                    raise KbtpError(Status.NOT_VALID)
                if check_sealed and not first["entry.flags"] & EntryFlag.SEALED:
                    raise KbtpError(Status.NOT_SEALED)
                length = first["entry.data_length"]
                if together:
                    data, second = await asyncio.gather(
                        self.qp.read(pool_stag, first["entry.block_offset"], length), self._entry(stag, at))
                else:
                    data = await self.qp.read(pool_stag, first["entry.block_offset"], length)
                    known = cached and verified.get(handle) == first["entry.generation"]
                    second = await self._entry(stag, at) if reread and not known else first
                if same(first, second):
                    verified[handle] = first["entry.generation"]
                    return Result(0, 0, first["entry.generation"], length, first["entry.block_offset"],
                                  bytes(data))
            raise KbtpError(Status.NOT_VALID)
        Initiator.direct_load = direct_load
    return plant


def _generation_only(a: dict, b: dict) -> bool:
    return a["entry.generation"] == b["entry.generation"]


def _flags_only(a: dict, b: dict) -> bool:
    return a["entry.flags"] == b["entry.flags"]


def _valid_and_generation(a: dict, b: dict) -> bool:
    return _generation_only(a, b) and bool(b["entry.flags"] & EntryFlag.VALID)


def _take_ticket(masked_add: int, mask_extra: int = 0, unmasked_add: int | None = None) -> Plant:
    def plant() -> None:
        async def take_ticket(self):
            head_stag, head_offset, _ = self._direct("head")
            n = (self._direct("ring")[2] - 1).bit_length()
            if self.qp.masked_atomics:
                value = await self.qp.fetch_add(head_stag, head_offset, masked_add,
                                                counters.add_mask(n + mask_extra))
                return counters.split(value, n)
            value = await self.qp.fetch_add(head_stag, head_offset,
                                            RING_COUNTER.unmasked_add_data if unmasked_add is None else unmasked_add)
            ticket = value >> 32
            return ticket, M.SLOT_SIZE * (ticket % (1 << n))
        Initiator.take_ticket = take_ticket
    return plant


def plant_slot_unwrapped() -> None:
    """The slot taken as 16 * ticket on both bindings: right while tickets stay below N,
    wrong (and outside the ring) once they do not."""
    async def take_ticket(self):
        head_stag, head_offset, n = self._ring()
        if self.qp.masked_atomics:
            value = await self.qp.fetch_add(head_stag, head_offset, RING_COUNTER.masked_add_data,
                                            counters.add_mask(n))
        else:
            value = await self.qp.fetch_add(head_stag, head_offset, RING_COUNTER.unmasked_add_data)
        ticket = value >> RING_COUNTER.ticket_shift
        return ticket, M.SLOT_SIZE * ticket
    Initiator.take_ticket = take_ticket


def _wait_slot(check_sequence: bool = True, check_consumed: bool = True, confirm: bool = True) -> Plant:
    def plant() -> None:
        async def wait_slot(self, ticket, offset, timeout):
            ring_stag, ring_base, _ = self._direct("ring")
            confirmed = None
            deadline = asyncio.get_running_loop().time() + timeout
            while asyncio.get_running_loop().time() < deadline:
                raw = await self.qp.read(ring_stag, ring_base + offset, M.SLOT_SIZE)
                slot = codec.decode_struct(M.RING_SLOT, raw, self.addr_le)
                ready = ((not check_sequence or slot["slot.sequence"] == ticket & 0xFFFFFFFF)
                         and (not check_consumed or slot["slot.block_offset"] != M.SLOT_CONSUMED))
                if ready and (not confirm or confirmed == slot["slot.block_offset"]):
                    return slot["slot.block_offset"]
                confirmed = slot["slot.block_offset"] if ready else None
                await asyncio.sleep(0.001)
            raise KbtpError(Status.NO_SPACE)
        Initiator.wait_slot = wait_slot
    return plant


def _direct_alloc(offset: int = 0, mark_slot: bool = False, length: Callable[[Initiator, bytes], int] | None = None,
                  delay: float = 0.0, bind_first: bool = False) -> Plant:
    """``bind_first``: BIND is posted, then the data written (both awaited together)."""
    def plant() -> None:
        async def direct_alloc(self, handle, data):
            partition_stag = self._direct("partition")[0]
            if self.usage + self.tickets >= self.target.quota:     # as the reference
                raise KbtpError(Status.NO_SPACE)
            self.tickets += 1
            try:
                return await allocate(self, handle, data, partition_stag)
            finally:
                self.tickets -= 1

        async def allocate(self, handle, data, partition_stag):
            ticket, slot = await self.take_ticket()
            block = await self.wait_slot(ticket, slot, self.target.ticket_timeout_ms / 2000)
            if bind_first:
                bind = asyncio.ensure_future(self.bind(handle, ticket, len(data), block))
                await asyncio.sleep(0)
                await self.qp.write(partition_stag, block, data)
                return await bind
            await self.qp.write(partition_stag, block + offset, data)
            if mark_slot:
                ring_stag, ring_base, _ = self._direct("ring")
                await self.qp.write(ring_stag, ring_base + slot + 8, b"\xff" * 8)
            await asyncio.sleep(delay)
            size = length(self, data) if length else len(data)
            return await self.bind(handle, ticket, size, block)
        Initiator.direct_alloc = direct_alloc
    return plant


def plant_abandoned_is_ok() -> None:
    def make(original):
        async def direct_alloc(self, handle, data):
            try:
                return await original(self, handle, data)
            except KbtpError as exc:
                if exc.name != "TICKET_ABANDONED":
                    raise
                return Result(0, 0, 0, len(data), 0)
        return direct_alloc
    patch(Initiator, "direct_alloc", make)


def _goodbye(fixed: bool) -> Plant:
    def plant() -> None:
        def make(original):
            async def goodbye(self, release=False):
                return await original(self, release=fixed)
            return goodbye
        patch(Initiator, "goodbye", make)
    return plant


def plant_hello_ack_unchecked() -> None:
    """A malformed HELLO_ACK escapes as an exception nobody catches (a crash)."""
    real = codec.decode

    class Shim:
        def __getattr__(self, name: str) -> Any:
            return getattr(codec, name)

        @staticmethod
        def decode(buf: bytes, addr_le: bool = False) -> dict:
            try:
                return real(buf, addr_le)
            except codec.Malformed as exc:
                raise RuntimeError(f"cannot parse {bytes(buf[:2]).hex()}: {exc}") from None
    client.codec = Shim()


def plant_ring_unchecked() -> None:
    """DIRECT_ALLOC on whatever Head and ring the HELLO_ACK names, aligned or not."""
    def ring(self):
        head_stag, head_offset, _ = self._direct("head")
        return head_stag, head_offset, (self._direct("ring")[2] - 1).bit_length()
    Initiator._ring = ring


def plant_no_invalidate() -> None:
    def make(original):
        def init(self, qp, memory, initiator_id, credits, invalidate):
            original(self, qp, memory, initiator_id, credits, False)
        return init
    patch(Initiator, "__init__", make)


def plant_stray_returns_credit() -> None:
    """Every COMPLETION received gives a credit back, one that answers no request too."""
    def make(original):
        def dispatch(self, msg, arrived=0):
            if results.match_completion(msg, dict(self._pending), self.addr_le) is None and self._credits:
                self._credits.release()
            original(self, msg, arrived)
        return dispatch
    patch(Initiator, "_dispatch", make)


def plant_recv_not_reposted() -> None:
    """A receive buffer a COMPLETION consumed is not posted again."""
    def make(original):
        def receive(self, msg):
            self.qp.post_recv = lambda count=1: None
            try:
                original(self, msg)
            finally:
                del self.qp.post_recv
        return receive
    patch(Initiator, "_receive", make)


def plant_tickets_uncounted() -> None:
    """Usage counts the handles bound, not the tickets taken and not yet bound."""
    Initiator.tickets = property(lambda self: 0, lambda self, value: None)


def plant_failed_free_counted() -> None:
    """A FREE that failed releases a unit of usage as one that completed OK does."""
    def make(original):
        async def free(self, *args, **kwargs):
            try:
                return await original(self, *args, **kwargs)
            except KbtpError:
                self.usage = max(0, self.usage - 1)
                raise
        return free
    patch(Initiator, "free", make)


def plant_entries_big_endian() -> None:
    """ADDR_LE applied to the requests, but table entries decoded in network byte order."""
    async def _entry(self, stag, offset):
        raw = await self.qp.read(stag, offset, M.ENTRY_SIZE)
        return codec.decode_struct(M.TABLE_ENTRY, raw, False)
    Initiator._entry = _entry


def _load(*, allow: bool = False, retry: bool = False, collapse: bool = False) -> Plant:
    """LOAD with ALLOW_UNSEALED always (``allow``), again with it after NOT_SEALED
    (``retry``), or every failure reported NOT_VALID (``collapse``)."""
    def plant() -> None:
        def make(original):
            async def load(self, handle, **kwargs):
                if allow:
                    kwargs["allow_unsealed"] = True
                try:
                    return await original(self, handle, **kwargs)
                except KbtpError as exc:
                    if retry and exc.name == "NOT_SEALED" and not kwargs.get("allow_unsealed"):
                        return await original(self, handle, **{**kwargs, "allow_unsealed": True})
                    if collapse:
                        raise KbtpError(Status.NOT_VALID, exc.result) from None
                    raise
            return load
        patch(Initiator, "load", make)
    return plant


def _free_invalidate(values: dict) -> None:
    if values["opcode"] == Opcode.FREE:
        values["flags"] = values.get("flags", 0) | RequestFlag.INVALIDATE


def plant_free_record_dropped() -> None:
    def make(original):
        async def free(self, handle, *, generation=0, record=False):
            return await original(self, handle, generation=generation)
        return free
    patch(Initiator, "free", make)


def plant_record_slot_shared() -> None:
    """One completion record slot, registered once, named by every request with RECORD."""
    from kbtp_scapy.rnic.memory import MemoryTable
    shared: dict[int, Any] = {}

    def make_register(original):
        def register(self, buffer, access=Access.LOCAL, **kwargs):
            if len(buffer) == M.COMPLETION_RECORD.size and access == Access.REMOTE_WRITE:
                if id(self) not in shared:
                    shared[id(self)] = original(self, buffer, access, **kwargs)
                return shared[id(self)]
            return original(self, buffer, access, **kwargs)
        return register

    def make_deregister(original):
        def deregister(self, stag):
            if all(region.stag != stag for region in shared.values()):
                original(self, stag)
        return deregister
    patch(MemoryTable, "register", make_register)
    patch(MemoryTable, "deregister", make_deregister)


def plant_goodbye_early() -> None:
    """GOODBYE sent as soon as the operations before it are issued, not once they completed."""
    async def run(self, script):
        out = self.out_dir / RESULTS
        out.write_text("")
        issued = None
        for statement in script:
            for op in statement:
                if op.name == "goodbye":
                    await self.ini.goodbye(release="release" in op.words)
                    if issued is not None:
                        done = await issued[1]
                        self._write(out, [result_line(o, st if isinstance(st, str) else "ERROR")
                                          for o, st in zip(issued[0], done)])
                    self._write(out, [result_line(op, "OK")])
                    return "release" in op.words
            if issued is not None:
                done = await issued[1]
                self._write(out, [result_line(o, st if isinstance(st, str) else "ERROR")
                                  for o, st in zip(issued[0], done)])
            issued = (statement, asyncio.gather(*(self.one(op) for op in statement), return_exceptions=True))
            await asyncio.sleep(0)
        if issued is not None:
            done = await issued[1]
            self._write(out, [result_line(o, st if isinstance(st, str) else "ERROR")
                              for o, st in zip(issued[0], done)])
        return None
    driver.Runner.run = run


def _cd_big_endian(values: dict) -> None:
    """ADDR_LE applied to the Data Descriptor, the Completion Descriptor left in network order."""
    if "cd.stag" in values:
        values["cd.stag"] = int.from_bytes(values["cd.stag"].to_bytes(4, "big"), "little")
        values["cd.offset"] = int.from_bytes(values["cd.offset"].to_bytes(8, "big"), "little")


def plant_source_writable() -> None:
    """A store's source buffer registered for remote writing as well as reading."""
    from kbtp_scapy.rnic.memory import MemoryTable

    def make(original):
        def register(self, buffer, access=Access.LOCAL, **kwargs):
            if access == Access.REMOTE_READ:
                access = Access.REMOTE_READ | Access.REMOTE_WRITE
            return original(self, buffer, access, **kwargs)
        return register
    patch(MemoryTable, "register", make)


_uncredited = contextvars.ContextVar("uncredited", default=False)


class _Credits:
    """The initiator's credit semaphore, skipped by a request marked ``_uncredited``."""

    def __init__(self, semaphore: asyncio.Semaphore) -> None:
        self.semaphore = semaphore

    async def __aenter__(self) -> None:
        if not _uncredited.get():
            await self.semaphore.acquire()

    async def __aexit__(self, *exc: object) -> None:
        if not _uncredited.get():
            self.semaphore.release()


class _SlowSender:
    """A credit semaphore after which requests go out one every ``gap`` seconds: the
    initiator as a busy host runs it."""

    def __init__(self, semaphore: asyncio.Semaphore, gap: float) -> None:
        self.semaphore, self.gap = semaphore, gap
        self.turn = asyncio.Lock()

    async def __aenter__(self) -> None:
        await self.semaphore.acquire()
        async with self.turn:
            await asyncio.sleep(self.gap)

    async def __aexit__(self, *exc: object) -> None:
        self.semaphore.release()


def plant_mpa_revision_1() -> None:
    """An MPA Request of revision 1 (RFC 5044's, no IRD or ORD), as an old stack sends."""
    from kbtp_scapy.rnic import iwarp as rnic_iwarp
    real = rnic_iwarp.w.build_startup

    def build(request: bool, flags: int, rev: int, *args: Any, **kwargs: Any) -> bytes:
        return real(request, flags, 1) if request else real(request, flags, rev, *args, **kwargs)
    rnic_iwarp.w.build_startup = build


def _without_credit(method: str) -> Plant:
    """Requests of ``method`` sent without taking a credit (the others take one)."""
    def plant() -> None:
        after_hello(lambda self: setattr(self, "_credits", _Credits(self._credits)))()

        def make(original):
            async def call(self, *args, **kwargs):
                token = _uncredited.set(True)
                try:
                    return await original(self, *args, **kwargs)
                finally:
                    _uncredited.reset(token)
            return call
        patch(Initiator, method, make)
    return plant


def plant_matched_by_handle() -> None:
    """A COMPLETION whose Request ID is waiting answers the oldest waiting request of the
    handle it echoes (a queue per handle), not necessarily the one with that ID."""
    handles: dict[int, int] = {}
    real_encode, real_match = codec.encode, results.match_completion

    class Shim:
        def __getattr__(self, name: str) -> Any:
            return getattr(codec, name)

        @staticmethod
        def encode(values: dict, addr_le: bool = False) -> bytes:
            if "request_id" in values:
                handles[values["request_id"]] = values.get("handle", 0)
            return real_encode(values, addr_le)

    def match(msg, waiting, addr_le):
        if msg.write_imm:
            return real_match(msg, waiting, addr_le)
        try:
            c = codec.decode(msg.payload, addr_le)
        except codec.Malformed:
            return None
        if c["opcode"] != Opcode.COMPLETION or c["request_id"] not in waiting:
            return None
        rid = next(r for r in waiting if handles.get(r) == c["handle"])
        future, _ = waiting.pop(rid)
        return future, Result.of_completion(rid, c)
    client.codec = Shim()
    client.match_completion = match


def plant_ticket_per_try() -> None:
    """A slot not ready yet: another ticket taken, instead of the slot read again."""
    async def direct_alloc(self, handle, data):
        partition_stag = self._direct("partition")[0]
        ring_stag, ring_base, _ = self._direct("ring")
        if self.usage + self.tickets >= self.target.quota:
            raise KbtpError(Status.NO_SPACE)
        for _ in range(16):
            ticket, offset = await self.take_ticket()
            slots = []
            for _ in range(2):
                raw = await self.qp.read(ring_stag, ring_base + offset, M.SLOT_SIZE)
                slots.append(codec.decode_struct(M.RING_SLOT, raw, self.addr_le))
                if slots[-1]["slot.sequence"] != ticket or slots[-1]["slot.block_offset"] == M.SLOT_CONSUMED:
                    break
            if len(slots) == 2 and slots[0] == slots[1]:
                block = slots[1]["slot.block_offset"]
                await self.qp.write(partition_stag, block, data)
                return await self.bind(handle, ticket, len(data), block)
        raise KbtpError(Status.NO_SPACE)
    Initiator.direct_alloc = direct_alloc


def plant_generation_cached() -> None:
    """LOADs carry the Generation of the handle's first binding, kept past its FREE."""
    def make_store(original):
        async def alloc_store(self, handle, data, **kwargs):
            result = await original(self, handle, data, **kwargs)
            self.__dict__.setdefault("generations", {}).setdefault(handle, result.generation)
            return result
        return alloc_store

    def make_load(original):
        async def load(self, handle, **kwargs):
            kwargs["generation"] = self.__dict__.get("generations", {}).get(handle, 0)
            return await original(self, handle, **kwargs)
        return load
    patch(Initiator, "alloc_store", make_store)
    patch(Initiator, "load", make_load)


def _half_repeated() -> bytes:
    half = secrets.token_bytes(8)
    return half + half


CORPUS = [
    Bug("hello_version_2", "Version is 1.", "hello.header", encoding(_hello_field("version", 2))),
    Bug("hello_request_id", "the common header () in which Request ID, Block Handle, Generation, "
        "and Status are zero", "hello.header", encoding(_hello_field("request_id", 1))),
    Bug("hello_handle", "the common header () in which Request ID, Block Handle, Generation, and "
        "Status are zero", "hello.header", encoding(_hello_field("handle", 0x4000))),
    Bug("id_zero", "the Initiator ID MUST be generated with at least 128 bits of entropy",
        "hello.id_entropy", _ids(lambda: bytes(16))),
    Bug("id_clock", "the Initiator ID MUST be generated with at least 128 bits of entropy",
        "hello.id_entropy", _ids(lambda: next(_counter).to_bytes(16, "big"))),
    Bug("id_short", "the Initiator ID MUST be generated with at least 128 bits of entropy",
        "hello.id_entropy", _ids(lambda: secrets.token_bytes(2) * 8)),
    Bug("id_forgotten", "The Initiator ID is a stable random identifier of the initiator",
        "hello.id_retained", _ids(lambda: secrets.token_bytes(16))),
    Bug("credits_completion_only", "A target pre-posts, for each request credit, a receive buffer",
        "credits.one", after_hello(lambda self: setattr(self, "_credits", asyncio.Semaphore(self.completion_credits)))),
    Bug("credits_one_more", "A target pre-posts, for each request credit, a receive buffer",
        "credits.two", after_hello(lambda self: setattr(self, "_credits", asyncio.Semaphore(
            min(self.target.request_credits, self.completion_credits) + 1)))),
    Bug("quota_ignored", "An initiator MUST NOT exceed its quota", "quota.tickets", plant_usage_ignored),
    Bug("quota_alloc_store_uncounted", "An initiator's usage is the number of handles it has bound plus "
        "the number of tickets it has taken", "quota.tickets", plant_alloc_store_uncounted),
    Bug("quota_free_uncounted", "An initiator's usage is the number of handles it has bound plus "
        "the number of tickets it has taken and not yet bound", "quota.tickets", plant_free_uncounted),
    Bug("handle_off_by_one", "chosen by an initiator within the handle range assigned to it",
        "handles.own_range", _handle(1)),
    Bug("handle_without_base", "chosen by an initiator within the handle range assigned to it",
        "handles.own_range", _handle(0, absolute=True)),
    Bug("addr_le_ignored", "the receive scatter list places the request's Data Descriptor and handle "
        "directly into the address fields (hence the ADDR_LE option)", "addr_le.encoding",
        after_hello(lambda self: setattr(self, "addr_le", False))),
    Bug("load_buffer_short_registered", "lengths MUST NOT exceed Block Size or the initiator's buffer",
        "descriptor.load_length", _load_buffer(register_less=16)),
    Bug("load_length_half", "lengths MUST NOT exceed Block Size or the initiator's buffer",
        "descriptor.load_length", _load_buffer(length=lambda self: self.target.block_size // 2)),
    Bug("store_length_rounded", "for STORE and ALLOC_STORE it is the source that the target reads with "
        "RDMA Read", "descriptor.store_length", plant_store_length_rounded),
    Bug("store_buffer_short", "The initiator exposes only the buffers named in its descriptors",
        "descriptor.store_buffer", plant_store_buffer_short),
    Bug("record_slot_short", "naming a 24-octet completion record slot of the initiator",
        "record.buffer", plant_record_slot_short, ("roce",)),
    Bug("inline_with_stag", "in which case STag and Tagged Offset are zero", "descriptor.store_length",
        encoding(_inline_stag)),
    Bug("record_ungated", "If the target advertised RECORD_COMPLETION and the request has the RECORD flag",
        "record.only_when_advertised", plant_record_ungated),
    Bug("record_stag_zero", "0x0004 RECORD: complete with a completion record (); a Completion "
        "Descriptor is present.", "record.descriptor", encoding(_record_stag_zero), ("roce",)),
    Bug("fifo_matching", "Request ID is chosen by the initiator and echoed in the completion.",
        "completion.out_of_order", plant_fifo_matching),
    Bug("unmatched_to_oldest", "Request ID is chosen by the initiator and echoed in the completion.",
        "completion.duplicate", plant_unmatched_to_oldest),
    Bug("unknown_id_fatal", "Request ID is chosen by the initiator and echoed in the completion.",
        "completion.unknown_id", plant_unknown_fatal),
    Bug("opcode_unchecked", "Request ID is chosen by the initiator and echoed in the completion.",
        "completion.other_opcode", plant_opcode_unchecked),
    Bug("status_collapsed", "KBTP Status Codes", "status.every_code",
        _status_names(lambda status, name: "INTERNAL" if status else name)),
    Bug("status_table_shifted", "KBTP Status Codes", "status.every_code",
        _status_names(lambda status, name: STATUS.describe(status - 1) if status >= 8 else name)),
    Bug("load_data_early", "receipt of the completion implies that the loaded data is in the "
        "initiator's buffer", "load.data_after_completion", plant_load_early),
    Bug("direct_load_no_reread", "the initiator RDMA-reads the table entry, then the block, then the "
        "entry again", "direct_load.generation", _direct_load(reread=False)),
    Bug("direct_load_flags_only", "The data is valid if both entry reads show the same Generation",
        "direct_load.generation", _direct_load(same=_flags_only)),
    Bug("direct_load_generation_only", "with VALID and SEALED set", "direct_load.valid",
        _direct_load(same=_generation_only)),
    Bug("direct_load_sealed_once", "with VALID and SEALED set", "direct_load.sealed",
        _direct_load(same=_valid_and_generation)),
    Bug("direct_load_unsealed", "with VALID and SEALED set", "direct_load.unsealed",
        _direct_load(check_sealed=False)),
    Bug("table_base_assumed", "The entry for handle h is at Table Offset + 16 * (h - Table Base Handle)",
        "direct_load.table_range",
        after_hello(lambda self: self.target.fields.update(table_base_handle=self.target.handle_base))),
    Bug("direct_load_sealed_only", "with VALID and SEALED set", "direct_load.invalid",
        _direct_load(check_valid=False)),
    Bug("direct_load_together", "issuing each read only after the previous one has completed",
        "direct_load.order", _direct_load(together=True)),
    Bug("fetch_add_mask_wide", "FetchAdd on its Head with the Add Data and Add Mask of ()",
        "direct_alloc.fetch_add", _take_ticket(RING_COUNTER.masked_add_data, mask_extra=1), ("iwarp",)),
    Bug("fetch_add_data_wrong", "FetchAdd on its Head with the Add Data and Add Mask of ()",
        "direct_alloc.fetch_add", _take_ticket(RING_COUNTER.unmasked_add_data,
                                               unmasked_add=RING_COUNTER.masked_add_data)),
    Bug("slot_no_confirm", "and then once more to confirm both values", "direct_alloc.slot",
        _wait_slot(confirm=False)),
    Bug("slot_ignores_sequence", "re-reading until the Sequence equals its ticket", "direct_alloc.slot",
        _wait_slot(check_sequence=False)),
    Bug("slot_accepts_consumed", "and the Block Offset is not all ones", "direct_alloc.slot",
        _wait_slot(check_consumed=False)),
    Bug("slot_unwrapped", "FetchAdd on Head returns ticket t and offset o. The slot at o holds the "
        "block for this allocation", "direct_alloc.ring_wrap", plant_slot_unwrapped),
    Bug("slot_marked_by_initiator", "The initiator never writes ring slots.", "direct_alloc.partition_only",
        _direct_alloc(mark_slot=True)),
    Bug("write_past_data", "RDMA-writes the data into the block", "direct_alloc.partition_only",
        _direct_alloc(offset=64)),
    Bug("bind_block_size", "sends BIND with the ticket, Data Length, and Block Offset", "direct_alloc.bind",
        _direct_alloc(length=lambda self, data: self.target.block_size)),
    Bug("bind_late", "A ticket that is not bound by BIND within the Ticket Timeout advertised in "
        "HELLO_ACK is abandoned.", "direct_alloc.ticket_timeout", _direct_alloc(delay=1.2)),
    Bug("abandoned_is_ok", "rejects a later BIND for that ticket with status TICKET_ABANDONED",
        "direct_alloc.abandoned", plant_abandoned_is_ok),
    Bug("goodbye_never_releases", "for GOODBYE, 0x0001 RELEASE", "goodbye.release", _goodbye(False)),
    Bug("goodbye_always_releases", "for GOODBYE, 0x0001 RELEASE", "goodbye.retain", _goodbye(True)),
    Bug("no_invalidate", "SHOULD request INVALIDATE so that they are revoked by the completion",
        "security.single_use_stags", plant_no_invalidate),
    # the deeper cases: each bug below escapes every case above it
    Bug("id_uuid4", "the Initiator ID MUST be generated with at least 128 bits of entropy",
        "hello.id_bits", _kept_ids(lambda: uuid.uuid4().bytes)),
    Bug("id_half_repeated", "the Initiator ID MUST be generated with at least 128 bits of entropy",
        "hello.id_bits", _kept_ids(_half_repeated)),
    Bug("id_fixed_prefix", "the Initiator ID MUST be generated with at least 128 bits of entropy",
        "hello.id_bits", _kept_ids(lambda: b"KBTP" + secrets.token_bytes(12))),
    Bug("stray_returns_credit", "A target pre-posts, for each request credit, a receive buffer",
        "credits.strays", plant_stray_returns_credit),
    Bug("recv_not_reposted", "Completion Credits is the number of receive buffers the initiator has "
        "posted for COMPLETION messages.", "credits.completion_buffers", plant_recv_not_reposted),
    Bug("credits_request_only", "Completion Credits is the number of receive buffers the initiator has "
        "posted for COMPLETION messages.", "credits.completion_buffers",
        after_hello(lambda self: setattr(self, "_credits", asyncio.Semaphore(self.target.request_credits)))),
    Bug("credits_request_only_slow", "Completion Credits is the number of receive buffers the initiator "
        "has posted for COMPLETION messages.", "credits.completion_buffers",
        after_hello(lambda self: setattr(self, "_credits", _SlowSender(
            asyncio.Semaphore(self.target.request_credits), 0.02)))),
    Bug("mpa_revision_1", "Peers SHOULD use the enhanced connection establishment of .",
        "binding.mpa.enhanced", plant_mpa_revision_1, ("iwarp",)),
    Bug("quota_tickets_uncounted", "plus the number of tickets it has taken and not yet bound",
        "quota.concurrent", plant_tickets_uncounted),
    Bug("quota_failed_free_counted", "the target releases one unit of usage when a FREE completes",
        "quota.failed_free", plant_failed_free_counted),
    Bug("addr_le_entries_ignored", "the Block Offset fields of table entries and ring slots are in "
        "little-endian byte order", "addr_le.direct_load", plant_entries_big_endian),
    Bug("allow_unsealed_always", "0x0010 ALLOW_UNSEALED: a load may return an unsealed block.",
        "flags.as_asked", _load(allow=True)),
    Bug("unsealed_retry", "0x0010 ALLOW_UNSEALED: a load may return an unsealed block.",
        "flags.as_asked", _load(retry=True)),
    Bug("invalidate_on_free", "0x0008 INVALIDATE: ... invalidating the STag of the initiator's Data "
        "Descriptor.", "flags.as_asked", encoding(_free_invalidate)),
    Bug("record_dropped_on_free", "0x0004 RECORD: complete with a completion record ()",
        "flags.record_as_asked", plant_free_record_dropped, ("roce",)),
    Bug("record_slot_shared", "naming a 24-octet completion record slot of the initiator",
        "record.slots", plant_record_slot_shared, ("roce",)),
    Bug("load_status_collapsed", "A failed check completes the request with the corresponding status",
        "status.every_opcode", _load(collapse=True)),
    Bug("direct_load_cached", "the initiator RDMA-reads the table entry, then the block, then the "
        "entry again", "direct_load.every_window", _direct_load(cached=True)),
    Bug("bind_before_write", "RDMA-writes the data into the block, and then sends BIND",
        "direct_alloc.write_order", _direct_alloc(bind_first=True)),
    Bug("goodbye_early", "GOODBYE ends the session.", "goodbye.after_completions", plant_goodbye_early),
    Bug("bind_without_credit", "A target pre-posts, for each request credit, a receive buffer",
        "credits.every_opcode", _without_credit("bind")),
    Bug("free_without_credit", "A target pre-posts, for each request credit, a receive buffer",
        "credits.every_opcode", _without_credit("free")),
    Bug("matched_by_handle", "Request ID is chosen by the initiator and echoed in the completion.",
        "completion.same_handle", plant_matched_by_handle),
    Bug("ticket_per_try", "re-reading until the Sequence equals its ticket", "direct_alloc.slot",
        plant_ticket_per_try),
    Bug("generation_cached", "Generation in a request is the generation the initiator expects",
        "generation.rebound", plant_generation_cached),
    Bug("request_ids_cycle", "Request ID is chosen by the initiator and echoed in the completion.",
        "request.ids", after_hello(lambda self: setattr(self, "_ids", itertools.cycle(range(1, 5))))),
    Bug("record_descriptor_big_endian", "the initiator MUST encode ... the STag, Tagged Offset, and "
        "Length fields of the Data and Completion Descriptors in little-endian byte order",
        "addr_le.record", encoding(_cd_big_endian, addr_le_only=True), ("roce",)),
    Bug("source_writable", "The initiator exposes only the buffers named in its descriptors",
        "descriptor.read_only", plant_source_writable),
    # for the hostile target (``kbtp fuzz --role initiator``): case "fuzz:SEED-INDEX"
    Bug("hello_ack_unchecked", "HELLO_ACK Body (Target Descriptor)", "fuzz:1-000014",
        plant_hello_ack_unchecked),
    Bug("completion_length_unchecked", "Data Length MUST NOT exceed the descriptor Length.",
        "fuzz:1-000828", _load_buffer()),
    Bug("head_unaligned_used", "two 64-bit counters, Head (used to allocate) and Tail (used to free), "
        "each aligned to 8 octets", "fuzz:11-000004", plant_ring_unchecked),
    Bug("entry_unchecked", "Direct Load (DIRECT_LOAD): through the read-only Table and Pool STags",
        "fuzz:1-001470", lambda: setattr(Initiator, "_in_pool", lambda self, offset, length: True)),
]
# -- for the model of ``kbtp fuzz --role initiator``: the classes issue 31 names ----------------

def _load_words(**forced: bool) -> Plant:
    """Every LOAD sent with ``forced`` flags (ALLOW_UNSEALED the application did not ask for)."""
    def plant() -> None:
        def make(original):
            async def load(self, handle, **kwargs):
                return await original(self, handle, **{**kwargs, **forced})
            return load
        patch(Initiator, "load", make)
    return plant


def plant_retry_unsealed() -> None:
    """A LOAD answered NOT_SEALED silently sent again with ALLOW_UNSEALED."""
    def make(original):
        async def load(self, handle, **kwargs):
            try:
                return await original(self, handle, **kwargs)
            except KbtpError as exc:
                if exc.status != Status.NOT_SEALED:
                    raise
                return await original(self, handle, **{**kwargs, "allow_unsealed": True})
        return load
    patch(Initiator, "load", make)


def plant_goodbye_early_fuzz() -> None:
    """The operations of a statement waited for 50 ms only: GOODBYE may overtake answers."""
    async def run(self, script):
        out = self.out_dir / "results"
        out.write_text("")
        for statement in script:
            if statement[0].name == "goodbye":
                self._write(out, ["goodbye - OK"])
                await self.ini.goodbye(release="release" in statement[0].words)
                return "release" in statement[0].words
            tasks = [asyncio.ensure_future(self.one(op)) for op in statement]
            await asyncio.wait(tasks, timeout=0.05)
            self._write(out, [f"{op.name} {op.handle} {t.result() if t.done() else 'ERROR'}"
                              for op, t in zip(statement, tasks)])
        return None
    driver.Runner.run = run


def plant_bind_before_write() -> None:
    """DIRECT_ALLOC: BIND sent first, the data written into the block after it."""
    async def direct_alloc(self, handle, data):
        partition_stag = self._direct("partition")[0]
        ticket, slot = await self.take_ticket()
        block = await self.wait_slot(ticket, slot, self.target.ticket_timeout_ms / 2000)
        bound = asyncio.ensure_future(self.bind(handle, ticket, len(data), block))
        await asyncio.sleep(0.01)
        await self.qp.write(partition_stag, block, data)
        return await bound
    Initiator.direct_alloc = direct_alloc


_slot: dict[str, int] = {}


def _shared_record_slot(values: dict) -> None:
    """Every RECORD request names the completion record slot of the first one."""
    if values.get("flags", 0) & RequestFlag.RECORD and "cd.stag" in values:
        _slot.setdefault("stag", values["cd.stag"])
        _slot.setdefault("offset", values["cd.offset"])
        values["cd.stag"], values["cd.offset"] = _slot["stag"], _slot["offset"]


CORPUS += [
    Bug("load_always_unsealed", "0x0010 ALLOW_UNSEALED", "fuzz:7-000012",
        _load_words(allow_unsealed=True)),
    Bug("retry_unsealed", "0x0010 ALLOW_UNSEALED", "fuzz:7-000025", plant_retry_unsealed),
    Bug("free_invalidate", "0x0008 INVALIDATE: the target completes with Send with Invalidate, "
        "invalidating the STag of the initiator's Data Descriptor", "fuzz:7-000012",
        encoding(_free_invalidate)),
    Bug("record_dropped", "0x0004 RECORD: complete with a completion record", "fuzz:7-000093",
        lambda: setattr(Initiator, "_record", lambda self, record: False), ("roce",)),
    Bug("goodbye_early_fuzz", "GOODBYE ends the session", "fuzz:7-000005", plant_goodbye_early_fuzz),
    Bug("credit_from_unknown", "A target pre-posts, for each request credit, a receive buffer",
        "fuzz:7-000015", plant_stray_returns_credit),
    Bug("bind_before_write_fuzz", "RDMA-writes the data into the block, and then sends BIND",
        "fuzz:7-000198", plant_bind_before_write),
    Bug("entries_big_endian", "the receive scatter list places the request's Data Descriptor and "
        "handle directly into the address fields (hence the ADDR_LE option)", "fuzz:7-000018",
        plant_entries_big_endian),
    Bug("record_slot_shared_fuzz", "naming a 24-octet completion record slot of the initiator",
        "fuzz:7-000093", encoding(_shared_record_slot), ("roce",)),
    Bug("id_fixed", "the Initiator ID MUST be generated with at least 128 bits of entropy",
        "fuzz:7-000000", _ids(lambda: bytes.fromhex("5f1c2a9e7b3d4c8a0e6f1b2d3c4a5e6f"))),
]

def plant_receive_not_reposted() -> None:
    """A receive buffer not posted again once a message has used it: the Completion Credits
    promised in HELLO run out after that many messages."""
    def _receive(self, msg):
        if isinstance(msg, ConnectionLost):
            for future, _ in self._pending.values():
                if not future.done():
                    future.set_exception(msg)
            self._pending.clear()
            return
        self._dispatch(msg)
    Initiator._receive = _receive


CORPUS += [
    Bug("receive_not_reposted", "hello.completion_credits: receive buffers the initiator keeps posted",
        "fuzz:7-000014", plant_receive_not_reposted),
    Bug("tickets_uncounted", "An initiator's usage is the number of handles it has bound plus the "
        "number of tickets it has taken and not yet bound", "fuzz:7-000010", plant_tickets_uncounted),
    Bug("failed_free_released", "A failed check completes the request with the corresponding status "
        "and has no other effect", "fuzz:7-000010", plant_failed_free_counted),
]
BY_NAME = {b.name: b for b in CORPUS}

#: the program the checker runs for a bug: this file, the bug, then kbtp initiator's arguments
ARGS = ["{url}", "--timeout", "{timeout}", "--local", "{local}", "--id-file", "{state}/id", "script",
        "--ops", "{ops}", "--in", "{in}", "--out", "{out}"]


def program(bug: str | None, python: str = sys.executable) -> list[str]:
    """The command line of the reference initiator with ``bug`` planted (None: clean)."""
    return [python, str(Path(__file__).resolve()), bug or "none", *ARGS]


def main(argv: list[str]) -> int:
    name, rest = argv[0], argv[1:]
    if name != "none":
        BY_NAME[name].plant()
    if "--local" in rest and rest[rest.index("--local") + 1] == "":
        i = rest.index("--local")
        rest = rest[:i] + rest[i + 2:]
    from kbtp_scapy.cli import main as kbtp
    return kbtp(["initiator", *rest])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
