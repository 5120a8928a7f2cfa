"""One request on one session: send it, wait for its answer, judge it by the model, learn.

Every request of the fuzzer goes through here, mutated or not, so one model judges them
all. The answer is whatever comes first: a COMPLETION Send (with or without Invalidate),
a completion record written with RDMA Write with Immediate (read where the request's
Completion Descriptor put it, in the fuzzer's own memory), or the connection ending.
"""
from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import codec
from ..rnic.memory import AccessError
from ..rnic.qp import Received
from ..tables import memory as M
from ..tables.enums import OPCODES
from ..vocab import AnyMessage, Opcode, RequestFlag, Status
from . import fences
from .findings import Finding
from .model import Expect, expect, expect_unparsed, judge, learn
from .oracles import status_known
from .state import Rebuild, Session, World
from .tally import Tally


@dataclass
class Reply:
    completion: AnyMessage | None = None     # the COMPLETION's (or record's) values
    findings: list[Finding] = field(default_factory=list)
    closed: bool = False                          # the connection ended instead

    @property
    def status(self) -> int | None:
        return None if self.completion is None else self.completion["status"]


def _evidence(payload: bytes, c: AnyMessage | None, how: str) -> dict[str, Any]:
    ev: dict[str, Any] = {"sent": payload.hex(), "answer": how}
    if c is not None:
        ev["completion"] = {k: (v.hex() if isinstance(v, bytes) else v) for k, v in c.items()}
    return ev


def _overlap(req: AnyMessage, length: int) -> bool:
    """Whether the completion record was written over the data a LOAD placed."""
    return req["cd.stag"] == req["dd.stag"] and req["cd.offset"] < req["dd.offset"] + length and \
        req["dd.offset"] < req["cd.offset"] + M.COMPLETION_RECORD.size


class Exchanger:
    """Mixed into the runner: needs ``world`` and ``timeout``."""

    timeout: float
    if TYPE_CHECKING:
        @property
        def world(self) -> World: ...

    def __init__(self) -> None:
        self._rids = itertools.count(0x4B46_0000_0000_0001)
        self.answers: Counter[str] = Counter()
        self.tally = Tally()

    def rid(self) -> int:
        return next(self._rids)

    def stray(self, s: Session) -> list[Finding]:
        """Answers nobody asked for (a duplicate completion, a made-up Request ID)."""
        out = []
        q = s.ini.unmatched
        while not q.empty():
            msg = q.get_nowait()
            out.append(Finding("request-id", "an answer no request was waiting for",
                               evidence={"payload": msg.payload.hex(), "imm": msg.imm,
                                         "record": msg.write_imm}))
        return out

    def _buffer(self, s: Session, stag: int, offset: int, length: int) -> bytes | None:
        """Octets of one of the initiator's buffers, as the target left them."""
        region = s.ini.memory.get(stag)
        try:
            return bytes(region.local(offset, length)) if region is not None else None
        except AccessError:
            return None

    def _ours(self, s: Session):
        def valid(stag: int) -> bool:
            region = s.ini.memory.get(stag)
            return region is not None and region.valid
        return valid

    def expectation(self, s: Session, payload: bytes) -> tuple[AnyMessage | None, Expect, bytes | None]:
        """``payload`` decoded (None if it cannot be), what the model expects of its
        answer, and the data it stores when the fuzzer can tell."""
        loop, ini = asyncio.get_running_loop(), s.ini
        try:
            req = codec.decode(payload, ini.addr_le)
        except codec.Malformed as bad:
            x = expect_unparsed(payload, bad.fields.get("handle", 0))
            x.request_id = codec.request_id_of(payload, ini.addr_le)
            return None, x, None
        x = expect(req, s.info, s.known, self.world.lookup, self.world.bound_blocks(), self._ours(s), loop.time())
        x.request_id, x.foreign = req["request_id"], self.world.owner(x.handle) is None
        stored = None
        if req["opcode"] in (Opcode.STORE, Opcode.ALLOC_STORE):
            stored = req.get("inline_data") if req["flags"] & RequestFlag.INLINE else \
                self._buffer(s, req["dd.stag"], req["dd.offset"], req["dd.length"])
        return req, x, stored

    async def request(self, s: Session, values: AnyMessage | None = None, *, payload: bytes | None = None,
                      stored: bytes | None = None) -> Reply:
        """Send ``values`` (encoded) or ``payload`` as a request on ``s`` and judge the answer."""
        w, ini = self.world, s.ini
        loop = asyncio.get_running_loop()
        if payload is None:
            if values is None:
                raise TypeError("request() takes values or a payload")
            payload = codec.encode({"request_id": self.rid(), **values}, ini.addr_le)
        out = self.stray(s)
        req, x, seen = self.expectation(s, payload)
        stored = stored if stored is not None else seen
        owner = w.owner(x.handle)
        before = fences.snapshot(ini.memory, req)
        goodbye = len(payload) > 1 and payload[1] == Opcode.GOODBYE
        release = goodbye and len(payload) >= 4 and bool(payload[3] & 1)
        try:
            await ini.qp.send(payload)
        except BaseException:
            learn(owner, x, req, None, allowed=True)      # it may have arrived
            raise
        getter = asyncio.ensure_future(ini.unmatched.get())
        closed = asyncio.ensure_future(ini.qp.wait_closed())
        done, _ = await asyncio.wait({getter, closed}, timeout=self.timeout, return_when=asyncio.FIRST_COMPLETED)
        closed.cancel()
        if getter in done:
            c, found = self.judged(s, x, req, payload, getter.result(), loop.time(), stored, before)
            if release and req is not None:              # a GOODBYE, answered: the session is gone all the same
                raise Rebuild("a mutated GOODBYE with RELEASE ended the session")
            return Reply(c, out + found)
        getter.cancel()
        learn(owner, x, req, None, allowed=True)
        if not ini.qp.closed and not goodbye:
            self.answers["none"] += 1
            return Reply(findings=out + [Finding("no-answer", f"{x.what}: no completion within {self.timeout:g} s, "
                                                 "connection up", evidence=_evidence(payload, None, "none"))])
        self.answers["connection ended"] += 1
        if release:
            raise Rebuild("a mutated GOODBYE with RELEASE ended the session")
        await w.ensure()
        return Reply(closed=True, findings=out)

    def judged(self, s: Session, x: Expect, req: AnyMessage | None, payload: bytes, msg: Received, at: float,
               stored: bytes | None = None, before: fences.Snapshot | None = None,
               ) -> tuple[AnyMessage | None, list[Finding]]:
        """The answer ``msg`` to ``payload`` (``req`` decoded, ``x`` its expectation) judged
        and learnt from: the completion's values and the findings. ``before`` holds the
        buffers the request names as they were before it was sent."""
        owner = self.world.owner(x.handle)
        c, how = self._answer(s, req, msg)
        if c is None:
            self.answers["unreadable"] += 1
            learn(owner, x, req, None, allowed=True)
            what = "a completion record it cannot find" if msg.write_imm else "an answer that is not a COMPLETION"
            return None, [Finding("answer-malformed", f"{x.what} was answered by {what}: {how}",
                                  evidence={"sent": payload.hex(), "answer": msg.payload.hex()})]
        self.answers[how] += 1
        ev = _evidence(payload, c, how)
        out = fences.check(s.ini.memory, req, c, msg.write_imm, before or {}, x.what, self.tally)
        if not status_known(c["status"]):
            out.append(Finding("status-undefined", f"status {c['status']} is neither assigned nor Private Use"))
        loaded = None
        if req is not None and req["opcode"] == Opcode.LOAD and c["status"] == Status.OK and not (
                msg.write_imm and _overlap(req, c["completion.data_length"])):
            loaded = self._buffer(s, req["dd.stag"], req["dd.offset"], c["completion.data_length"])
        out += judge(x, c, record=msg.write_imm, invalidated=msg.invalidated, at=at, data=loaded, tally=self.tally)
        for f in out:
            f.evidence = ev
        learn(owner, x, req, c, allowed=x.allows(c["status"]), stored=stored, loaded=loaded)
        return c, out

    def _answer(self, s: Session, req: AnyMessage | None, msg: Received) -> tuple[AnyMessage | None, str]:
        """The completion's values, and how it came (or why it cannot be read)."""
        addr_le = s.ini.addr_le
        if msg.write_imm:
            raw = None
            if req is not None and "cd.stag" in req:
                raw = self._buffer(s, req["cd.stag"], req["cd.offset"], M.COMPLETION_RECORD.size)
            if raw is None:
                return None, "the request names no Completion Descriptor of the initiator's"
            d = codec.decode_struct(M.COMPLETION_RECORD, raw, addr_le)
            return {"opcode": Opcode.COMPLETION, "request_id": d["record.request_id"],
                    "status": d["record.status"], "generation": d["record.generation"],
                    "completion.data_length": d["record.data_length"],
                    "completion.block_offset": d["record.block_offset"]}, "record"
        try:
            c = codec.decode(msg.payload, addr_le)
        except codec.Malformed as bad:
            return None, str(bad)
        if c["opcode"] != Opcode.COMPLETION:
            return None, f"{OPCODES.describe(c['opcode'])}"
        return c, "send with invalidate" if msg.invalidated is not None else "send"
