"""Drive a live target with the sessions of a capture.

Every captured session gets its own connection (``Initiator.connect`` with the captured
Requested Features and Completion Credits and a fresh Initiator ID; two captured sessions
with the same ID share one new ID, so a reconnection stays one). Sessions run
concurrently, and a step is issued only once every step whose answer the capture shows
before that step was issued has been answered in the replay: what the capture proves
happened before stays before, across sessions too; requests that were pipelined stay
pipelined (up to the new credits). Requests keep their Request IDs and Generations.

Every answer is waited for ``timeout`` seconds at most, the Send of a request included
(the RNIC completes work in posting order, so a Read the target never answers holds back
every later Send): a one-sided operation left unanswered ends its session's connection,
as an RNIC's exhausted retries do, and the steps after it fail at once.
"""
from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from .. import codec
from ..harness import HarnessError
from ..initiator import Initiator, KbtpError, Limits
from ..initiator.limits import connect_deadline
from ..initiator.results import Waiting, match_completion
from ..rnic import Access
from ..rnic.qp import ConnectionLost, RemoteError
from ..tables import memory as M
from ..vocab import AnyMessage, AnyStruct, Opcode
from .mapping import Mapping
from .sessions import Capture, Outcome, Session, Step, slot_of

Pair = tuple[Outcome | None, Outcome]     # (captured, replayed) of a one-sided operation


@dataclass
class Played:
    """One step and what the replay made of it."""

    step: Step | None                  # None: the session's HELLO
    session: Session
    replayed: Outcome | None = None
    captured: Outcome | None = None
    error: str | None = None           # the target failed to answer or refused the operation
    skipped: str | None = None         # not replayable


@dataclass
class _Event:
    """Something to issue (a HELLO or a step) and its captured answer's frame."""

    frame: int
    time: float
    done_frame: float
    session: Session
    step: Step | None
    done: asyncio.Event


@dataclass
class Stop:
    """Asked for by Ctrl-C: no further step or loop starts; the answers already asked for
    are awaited, so what was replayed is judged."""

    asked: bool = False
    gone: str | None = None     # the target went away: no further loop starts

    def ask(self) -> None:
        self.asked = True


class _Live:
    """One replayed session: its initiator and the answers it waits for."""

    def __init__(self, ses: Session, ini: Initiator) -> None:
        self.ses, self.ini = ses, ini
        self.waiting: Waiting = {}
        credits = min(ini.target.request_credits, ini.completion_credits)
        self.credits = asyncio.Semaphore(max(credits, 1))
        self.reader = asyncio.create_task(self._read())
        self.closed = False

    async def _read(self) -> None:
        while True:
            matched = match_completion(await self.ini.unmatched.get(), self.waiting,
                                       self.ini.addr_le)
            if matched is not None and not matched[0].done():
                future, r = matched
                future.set_result(Outcome(r.status, r.generation, r.data_length, r.block_offset,
                                          form="record" if r.record else "completion"))

    async def close(self) -> None:
        self.reader.cancel()
        if not self.closed:
            self.closed = True
            await self.ini.close()


class Player:
    """One run of a capture against the target at ``url``."""

    def __init__(self, capture: Capture, url: str, *, pace: bool = False, timeout: float = 5.0,
                 local: str | None = None, progress: Callable[[int, int], None] | None = None,
                 limits: Limits | None = None, stop: Stop | None = None) -> None:
        self.capture, self.url, self.pace, self.timeout = capture, url, pace, timeout
        self.limits = limits or Limits(wait=timeout)
        self.local, self.progress, self.stop = local, progress, stop or Stop()
        self.stopped_at: tuple[int, int] | None = None    # (steps issued, of) when stopped
        self.mapping = Mapping(capture)
        self.live: dict[int, _Live] = {}
        self.results: list[Played] = []
        self.ids: dict[bytes, bytes] = {}
        self.tasks: list[asyncio.Task] = []
        self.count = 0

    def _events(self) -> list[_Event]:
        events = [_Event(s.frame, s.time, s.ack_frame, s, None, asyncio.Event())
                  for s in self.capture.sessions]
        events += [_Event(st.frame, st.time, st.done_frame, st.session, st, asyncio.Event())
                   for st in self.capture.steps()]
        return sorted(events, key=lambda e: (e.frame, e.step is not None))

    async def run(self) -> list[Played]:
        events = self._events()
        by_done = sorted((e for e in events if e.done_frame != float("inf")), key=lambda e: e.done_frame)
        waited = 0
        start, first = time.monotonic(), (events[0].time if events else 0.0)
        try:
            for number, event in enumerate(events, 1):
                if self.stop.asked:
                    self.stopped_at = (number - 1, len(events))
                    break
                while waited < len(by_done) and by_done[waited].done_frame < event.frame:
                    await by_done[waited].done.wait()
                    waited += 1
                if self.pace:
                    await asyncio.sleep(max(0.0, start + event.time - first - time.monotonic()))
                try:
                    await self._issue(event)
                except HarnessError:
                    raise
                except Exception as exc:  # noqa: BLE001 - a capture may hold anything
                    self._record(Played(event.step, event.session,
                                        skipped=f"not replayable: {exc}"), event)
                if self.progress:
                    self.progress(number, len(events))
            if self.tasks:
                await asyncio.gather(*self.tasks)
        finally:
            for live in self.live.values():
                await live.close()
        return self.results

    def _record(self, played: Played, event: _Event) -> None:
        if played.captured is None:
            ack = event.session.ack
            played.captured = played.step.captured if played.step else (
                Outcome(status=ack.get("status"), form="hello_ack") if ack else None)
        self.results.append(played)
        event.done.set()

    def _spawn(self, coro) -> None:
        self.tasks.append(asyncio.create_task(coro))

    # -- issuing ---------------------------------------------------------------------------

    async def _issue(self, event: _Event) -> None:
        ses, step = event.session, event.step
        if step is None:
            await self._hello(event)
            return
        live = self.live.get(ses.index)
        if live is None or live.closed:
            self._record(Played(step, ses, skipped="its session is not connected"), event)
            return
        if step.kind == "goodbye":
            await self._goodbye(live, step, event)
        elif step.kind == "request":
            await self._request(live, step, event)
        else:
            self._one_sided(live, step, event)

    async def _hello(self, event: _Event) -> None:
        ses = event.session
        hello = ses.hello
        new_id = self.ids.setdefault(ses.initiator_id, secrets.token_bytes(16))
        options: dict[str, Any] = {"local": self.local} if self.local else {}
        played = Played(None, ses)
        try:
            ini = await asyncio.wait_for(Initiator.connect(
                self.url, initiator_id=new_id,
                features=hello.get("hello.requested_features", 0),
                credits=max(1, hello.get("hello.completion_credits", 32)), limits=self.limits,
                **options), connect_deadline(self.timeout))
        except KbtpError as exc:
            played.replayed = Outcome(status=exc.status, form="hello_ack")
        except (TimeoutError, OSError, ConnectionLost) as exc:
            why = str(exc) or f"no answer within {self.timeout:g} s"
            if not self.live:
                played.error = f"cannot connect to {self.url}: {why}"
                self._record(played, event)     # kept if an earlier loop makes this one partial
                raise HarnessError(played.error) from None
            played.error = f"connection failed: {why}"
        else:
            self.live[ses.index] = _Live(ses, ini)
            self.mapping.granted(ses, ini.target.handle_base)
            played.replayed = Outcome(status=0, form="hello_ack")
        self._record(played, event)

    async def _goodbye(self, live: _Live, step: Step, event: _Event) -> None:
        values: AnyMessage = {**step.fields, "request_id": step.fields.get("request_id", 0)}
        try:
            await asyncio.wait_for(live.ini.qp.send(codec.encode(values, live.ini.addr_le)), self.timeout)
        except TimeoutError:
            pass                     # held back behind an unanswered operation: closed below

        async def closed() -> None:
            try:
                await asyncio.wait_for(live.ini.qp.wait_closed(), self.timeout)
            except TimeoutError:
                pass
            await live.close()
            self._record(Played(step, live.ses, Outcome(form="goodbye")), event)
        self._spawn(closed())

    def _encode(self, live: _Live, step: Step) -> tuple[bytes, list, Any, bytearray | None]:
        """The request for the new session: mapped handle (and BIND ticket and Block
        Offset), fresh buffers at the captured Tagged Offsets. Returns the octets, the
        regions to drop afterwards, the completion record region and the LOAD buffer."""
        ses, ini, f = live.ses, live.ini, step.fields
        if step.error is not None:
            raw = bytearray(step.payload)
            if ses.addr_le == ini.addr_le and len(raw) >= 20 and "handle" in f:
                raw[12:20] = self.mapping.handle(ses, f["handle"]).to_bytes(
                    8, "little" if ini.addr_le else "big")
            return bytes(raw), [], None, None
        values = f.copy()
        regions, record, loaded = [], None, None
        if "handle" in values:
            values["handle"] = self.mapping.handle(ses, values["handle"])
        if step.loaded is not None:
            loaded = bytearray(len(step.loaded))
            regions.append(ini.memory.register(loaded, Access.REMOTE_WRITE, base=f["dd.offset"]))
            values["dd.stag"] = regions[-1].stag
        if step.supplied is not None:
            regions.append(ini.memory.register(bytearray(step.supplied), Access.REMOTE_READ,
                                               base=f["dd.offset"]))
            values["dd.stag"] = regions[-1].stag
        if "cd.stag" in values:
            record = ini.memory.register(bytearray(M.COMPLETION_RECORD.size), Access.REMOTE_WRITE,
                                         base=values["cd.offset"])
            regions.append(record)
            values["cd.stag"] = record.stag
        if f.get("opcode") == Opcode.BIND:
            key = (ses.index, values["bind.ticket"])
            values["bind.ticket"] = self.mapping.tickets.get(key, values["bind.ticket"])
            new = self.mapping.block(values["bind.block_offset"])
            values["bind.block_offset"] = values["bind.block_offset"] if new is None else new
        return codec.encode(values, ini.addr_le), regions, record, loaded

    async def _request(self, live: _Live, step: Step, event: _Event) -> None:
        if step.problem and step.supplied is not None:
            self._record(Played(step, live.ses, skipped=step.problem), event)
            return
        payload, regions, record, loaded = self._encode(live, step)
        await live.credits.acquire()
        future = asyncio.get_running_loop().create_future()
        rid = step.fields.get("request_id", 0)
        live.waiting[rid] = (future, record)
        sent = live.ini.qp.send(payload)

        async def answer() -> None:
            played = Played(step, live.ses)
            try:
                async with asyncio.timeout(self.timeout):
                    await sent
                    played.replayed = await future
            except TimeoutError:
                played.error = f"no completion within {self.timeout:g} s"
            except (ConnectionLost, RemoteError) as exc:
                played.error = f"connection: {exc}"
            finally:
                live.waiting.pop(rid, None)
                live.credits.release()
                for region in regions:
                    live.ini.memory.deregister(region.stag)
            out = played.replayed
            if out is not None:
                if loaded is not None and out.data_length is not None:
                    out.data = bytes(loaded[:out.data_length])
                if step.captured is not None and step.captured.status == 0 and out.status == 0:
                    self.mapping.learn_block(step.captured.block_offset, out.block_offset)
            self._record(played, event)
        self._spawn(answer())

    # -- one-sided operations of the direct modes ----------------------------------------------

    def _one_sided(self, live: _Live, step: Step, event: _Event) -> None:
        try:
            stag, offset, learn = self._address(live, step)
        except LookupError as exc:
            self._record(Played(step, live.ses, skipped=str(exc)), event)
            return
        qp = live.ini.qp
        op: Awaitable[Any]
        try:
            if step.kind == "read":
                op = qp.read(stag, offset, step.length)
            elif step.kind == "write":
                op = qp.write(stag, offset, step.data)
            else:
                op = live.ini.take_ticket()
        except ValueError as exc:           # fields a damaged capture holds
            self._record(Played(step, live.ses, skipped=f"cannot post it: {exc}"), event)
            return

        async def answer() -> None:
            played = Played(step, live.ses)
            try:
                value = await asyncio.wait_for(op, self.timeout)
            except TimeoutError:
                played.error = f"no answer within {self.timeout:g} s"
                qp.abort(f"no answer to {step.name} within {self.timeout:g} s")
            except (ConnectionLost, RemoteError, KbtpError) as exc:
                played.error = f"{step.name} refused: {exc}"
            else:
                try:
                    played.captured, played.replayed = learn(value)
                except Exception as exc:  # noqa: BLE001 - captured octets may be anything
                    played.skipped = f"cannot compare: {exc}"
            self._record(played, event)
        self._spawn(answer())

    def _address(self, live: _Live, step: Step) -> tuple[int, int, Callable[[Any], Pair]]:
        """Where a captured one-sided operation goes in the new session, and how its answer
        is read; ``LookupError`` when it cannot be placed."""
        if step.problem:
            raise LookupError(step.problem)
        ses, ini, m = live.ses, live.ini, self.mapping
        captured = ses.descriptor(step.region) if step.region is not None else None
        if captured is None:
            raise LookupError(f"the captured HELLO_ACK grants no {step.region} descriptor")
        new = ini.target.fields
        if f"{step.region}.stag" not in new:
            raise LookupError(f"the new HELLO_ACK grants no {step.region} descriptor")
        stag, base = new[f"{step.region}.stag"], new[f"{step.region}.offset"]
        block_size = ses.ack.get("hello_ack.block_size", 1) or 1
        longest = max(ini.target.block_size, M.ENTRY_SIZE, M.SLOT_SIZE)
        if step.kind == "read" and step.length > longest:
            # the direct modes read one entry, slot or block: a capture's length field is
            # not what replay's buffers are sized by
            raise LookupError(f"a Read of {step.length} octets is longer than the direct modes "
                              f"make (a block of {ini.target.block_size})")
        if step.region == "table":
            rem = (step.offset - captured[1]) % M.ENTRY_SIZE
            handle = m.handle(ses, step.handle or 0)
            offset = base + M.ENTRY_SIZE * (handle - new["table_base_handle"]) + rem
            return stag, offset, lambda raw: self._entry(live, step, raw, rem)
        if step.region in ("pool", "partition"):
            pool = ses.descriptor("pool")
            origin = pool[1] if pool else 0
            block = origin + (step.offset - origin) // block_size * block_size
            mapped = m.block(block)
            if mapped is None:
                raise LookupError(f"Block Offset 0x{block:x} was never seen in the replay")
            if step.kind == "write":
                return stag, mapped + step.offset - block, lambda _: (step.captured, Outcome(form="write"))
            return stag, mapped + step.offset - block, lambda raw: (
                step.captured, Outcome(data=bytes(raw), form="read"))
        if step.region == "ring":
            slot = step.offset - captured[1]
            offset = base + m.slots.get((ses.index, slot), slot)
            return stag, offset, lambda raw: self._slot(live, step, raw)
        if step.region == "head" and step.kind == "fetch_add":
            return stag, base, lambda got: self._ticket(live, step, got)
        raise LookupError(f"{step.name} is not an operation the direct modes use")

    def _entry(self, live: _Live, step: Step, raw: bytes, rem: int) -> Pair:
        if rem or len(raw) != M.ENTRY_SIZE or step.captured is None or \
                step.captured.data is None or len(step.captured.data) != M.ENTRY_SIZE:
            return step.captured, Outcome(data=bytes(raw), form="read")
        new = codec.decode_struct(M.TABLE_ENTRY, bytes(raw), live.ini.addr_le)
        old = codec.decode_struct(M.TABLE_ENTRY, step.captured.data, live.ses.addr_le)
        self.mapping.learn_block(old["entry.block_offset"], new["entry.block_offset"])
        return _entry_outcome(old), _entry_outcome(new)

    def _slot(self, live: _Live, step: Step, raw: bytes) -> Pair:
        if len(raw) != M.SLOT_SIZE or step.captured is None or \
                step.captured.data is None or len(step.captured.data) != M.SLOT_SIZE:
            return step.captured, Outcome(data=bytes(raw), form="read")
        new = codec.decode_struct(M.RING_SLOT, bytes(raw), live.ini.addr_le)
        old = codec.decode_struct(M.RING_SLOT, step.captured.data, live.ses.addr_le)
        self.mapping.learn_block(old["slot.block_offset"], new["slot.block_offset"])
        return (Outcome(ticket=old["slot.sequence"], block_offset=old["slot.block_offset"], form="slot"),
                Outcome(ticket=new["slot.sequence"], block_offset=new["slot.block_offset"], form="slot"))

    def _ticket(self, live: _Live, step: Step, got: tuple[int, int]) -> Pair:
        ticket, slot = got
        if step.captured is not None and step.captured.ticket is not None:
            old = step.captured.ticket
            self.mapping.tickets[(live.ses.index, old)] = ticket
            ring = live.ses.descriptor("ring")
            self.mapping.slots[(live.ses.index, slot_of(old, ring[2] if ring else 1))] = slot
        return step.captured, Outcome(ticket=ticket, form="fetch_add")


def _entry_outcome(entry: AnyStruct) -> Outcome:
    return Outcome(generation=entry["entry.generation"], data_length=entry["entry.data_length"],
                   block_offset=entry["entry.block_offset"], flags=entry["entry.flags"], form="entry")


async def play(capture: Capture, url: str, *, loops: int = 1, stop: Stop | None = None,
               **options) -> list[Player]:
    """Replay ``capture`` ``loops`` times in a row; one finished player per loop (fewer,
    the last one stopped part-way, when ``stop`` is asked for or the target cannot be
    reached after the first loop: then ``stop.gone`` says in which loop)."""
    if not capture.sessions:
        raise HarnessError(f"{capture.path}: no KBTP session (no HELLO) in the capture")
    stop = stop or Stop()
    players: list[Player] = []
    for number in range(1, loops + 1):
        if stop.asked:
            break
        players.append(Player(capture, url, stop=stop, **options))
        try:
            await players[-1].run()
        except HarnessError:
            if number == 1:
                raise            # never reached: the replay could not run
            # the loop before, when it lost its connections already
            during = number - 1 if any(p.error for p in players[-2].results) else number
            stop.gone = f"the target went away during loop {during} of {loops}"
            break
    return players
