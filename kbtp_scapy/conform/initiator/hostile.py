"""A hostile target for fuzzing initiators: ``kbtp fuzz --role initiator``.

Each case is drawn from its name (``iwarp-SEED-INDEX``), so a seed gives the same cases
and a finding replays by name. A case is one run (or, for ``reconnect``, two runs with
one state) of the program under test with an operation script, against a checking
target that deviates in one way (a ``Hostile`` ``kind``). Every block of ``BLOCK``
cases holds each of the model's kinds once (``MODEL_KINDS``: few credits held at their
edge with unsolicited COMPLETIONs, completions delayed, reversed, duplicated, unknown or
under other opcodes, every defined status, NOT_SEALED and TICKET_ABANDONED, decoys before
a LOAD's data, moved or cleared entries between DIRECT_LOAD's reads, stale and torn
slots, a wrapping ring, a shifted Table, ADDR_LE, RECORD not granted, a small quota,
probes of every buffer's last octet, a reconnection), most borrowed from the conformance
behaviours, and some of the malformed ones (``OLD_KINDS``: HELLO_ACKs cut, extended or
with impossible descriptors, lying completions, garbage in the ring and the Table, a
Write past a LOAD's buffer, a disconnect).

The oracles: the program neither crashes (a signal, or a traceback on stderr) nor hangs
(it must give up by itself within the run's time), no pool block changes that nothing of
the initiator named, and ``model.py`` judges every field of every request and every
one-sided access against what the script asked and the target did, and every result
against the answer it got. A finding is minimised by dropping statements of the script
while the same oracle still fires, and saved as JSON and pcap; the report counts the
fields judged and those the model could not predict, with the reason.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

from ... import codec
from ...initiator.script import parse
from ...tables import memory as M
from ...tables.enums import OPCODES
from ...tally import Tally
from ...target.operations import Outcome
from ...vocab import AnyMessage, EntryFlag, Feature, HelloAck, Opcode, RequestFlag, Status
from ...wire.address import parse_url
from ..context import FrameBuffer
from . import behaviours as B
from .context import ICtx, Unjudged
from .model import Finding, Model
from .observe import Access, Altered, Session
from .target import Behaviour, CheckedConnection

#: The operation scripts; a case draws one of those its kind lists (``SCRIPTS_FOR``), and a
#: ``|`` separates runs of one initiator that keep its state (a reconnection).
SCRIPTS = [
    "alloc_store 0 @a seal; load 0 @ra; free 0",
    "alloc_store 0 @a seal; alloc_store 1 @b seal noinline; load 0 @ra & load 1 @rb; free 1",
    "alloc_store 0 @a seal; direct_load 0 @ra; load 0 @rb",
    "direct_alloc 0 @a; load 0 @ra; direct_load 0 @rb; free 0",
    "alloc_store 2 @b seal; direct_alloc 0 @a & load 2 @rb; direct_load 0 @ra",
    "alloc_store 0 @a seal record & alloc_store 1 @b seal & alloc_store 2 @c inline & alloc_store 3 @a "
    "noinline; load 0 @ra record & load 1 @rb record & load 2 @rc unsealed & load 3 @rd; free 0 record & "
    "free 1 record; goodbye release",
    "alloc_store 4 @c seal inline; load 4 @ra unsealed; store 4 @b seal; load 4 @rb; free 4 record; goodbye",
    "direct_alloc 5 @a & direct_alloc 6 @c & direct_alloc 7 @b; direct_load 5 @ra & direct_load 6 @rc; "
    "free 5; free 6; direct_alloc 8 @c; load 8 @r8; goodbye release",
    "alloc_store 0 @c seal; direct_alloc 1 @a & direct_alloc 2 @b & direct_alloc 3 @c; free 9; "
    "direct_alloc 4 @a; free 0; direct_alloc 5 @a; load 5 @r5; free 1; free 2; direct_alloc 6 @c",
    "alloc_store 0 @a seal & alloc_store 1 @b seal & alloc_store 2 @c seal & alloc_store 3 @a seal & "
    "alloc_store 4 @b seal; load 0 @r0 & load 1 @r1 & load 2 @r2 & load 3 @r3 & load 4 @r4; "
    "free 0 & free 1 & free 2",
    "alloc_store 3 @a seal; direct_alloc 4 @c | load 3 @ra; direct_load 4 @rc; free 3; free 4; goodbye release",
]
GENERAL = (0, 1, 2, 3, 4, 5, 6, 7, 9)
OLD_KINDS = ("hello_ack.truncate", "hello_ack.extend", "hello_ack.features", "hello_ack.count",
             "hello_ack.head_offset", "hello_ack.credits", "completion.request_id",
             "completion.data_length", "completion.status", "completion.drop", "disconnect",
             "ring.garbage", "ring.torn", "entry.garbage", "load.outside")
#: kind -> the scripts (indices of ``SCRIPTS``) that reach what it provokes (a window of
#: DIRECT_LOAD reads is judged one DIRECT_LOAD at a time: none issued together)
MODEL_KINDS: dict[str, tuple[int, ...]] = {
    "plain": GENERAL, "credits.edge": (1, 5, 9), "completion.delay": GENERAL,
    "completion.reverse": (1, 4, 5, 7, 9), "completion.duplicate": GENERAL,
    "completion.unknown": GENERAL, "completion.other_opcode": (0, 1, 5, 6),
    "status.defined": GENERAL, "load.not_sealed": (0, 1, 5, 6), "bind.abandoned": (3, 4, 7, 8),
    "load.decoy": (0, 1, 5, 9), "direct_load.window": (2, 3, 4), "entry.shown": (2, 3, 7),
    "slot.reads": (3, 4, 7), "ring.wrap": (7,), "table.window": (2, 3, 4, 7), "addr_le": (1, 3, 4, 7),
    "record.ungranted": (5, 6), "quota.small": (8,), "probe.buffers": (1, 5, 6), "reconnect": (10,)}
KINDS = OLD_KINDS + tuple(MODEL_KINDS)
OLD_PER_BLOCK = 5
BLOCK = len(MODEL_KINDS) + OLD_PER_BLOCK
#: kinds whose target keeps to the protocol (bar the answers it marks ``Altered``): the
#: program must run its script to the end and exit 0
GENTLE = frozenset(MODEL_KINDS) | {"completion.status", "completion.data_length", "ring.garbage",
                                  "ring.torn", "entry.garbage"}
READS_ALTERED = frozenset({"direct_load.window", "entry.shown", "entry.garbage", "slot.reads", "ring.garbage",
                           "ring.torn"})
MALFORMED_ACK = frozenset({"hello_ack.truncate", "hello_ack.extend"})
DESCRIPTOR_COUNTS = ("table", "pool", "partition", "ring", "head")
EXIT_OK, EXIT_FINDING, EXIT_HARNESS = 0, 1, 2
RING_WRAP_FIRST = (1 << 32) - 3      # tickets that wrap to 0 within a few allocations


@dataclass
class HostileCase:
    name: str
    kind: str
    script: str
    params: dict[str, Any] = field(default_factory=dict)


def parse_name(name: str) -> tuple[str, int, int]:
    transport, seed, index = name.rsplit("-", 2)
    return transport, int(seed), int(index)


def kind_of(seed: int, index: int) -> str:
    """The kind of case ``index``: each block of ``BLOCK`` cases holds every model kind once
    and ``OLD_PER_BLOCK`` of the malformed ones (in turn), in an order the seed shuffles, so
    that a short campaign meets every edge the model judges."""
    block, at = divmod(index, BLOCK)
    olds = [OLD_KINDS[(block * OLD_PER_BLOCK + i) % len(OLD_KINDS)] for i in range(OLD_PER_BLOCK)]
    kinds = list(MODEL_KINDS) + olds
    random.Random(f"{seed}-block-{block}").shuffle(kinds)
    return kinds[at]


def make_case(transport: str, seed: int, index: int) -> HostileCase:
    """The case ``index`` of ``seed``: the same for every run."""
    rng = random.Random(f"{seed}-{index}")
    kind = kind_of(seed, index)
    p: dict[str, Any] = {"at": rng.randrange(4), "value": rng.getrandbits(32)}
    if kind == "hello_ack.truncate":
        p["cut"] = rng.randrange(1, 56)
    elif kind == "hello_ack.extend":
        p["extra"] = rng.randrange(1, 200)
    elif kind == "hello_ack.features":
        p["bits"] = rng.choice([0x0010, 0x0100, 0x1000, 0x8000, 0xFFF0])
    elif kind == "hello_ack.count":
        p["which"] = rng.choice(DESCRIPTOR_COUNTS)
        p["count"] = rng.choice([0, 3, 0xFFFFFFFF, 1 << 31])
    elif kind == "hello_ack.head_offset":
        p["skew"] = rng.randrange(1, 8)
    elif kind == "hello_ack.credits":
        p["credits"] = rng.choice([0, 1, 0xFFFF])
    elif kind == "completion.status":
        p["status"] = rng.randrange(12, 0x10000)
    elif kind == "completion.data_length":
        p["extra"] = rng.choice([1, 8, 4096, 1 << 20])
    elif kind == "credits.edge":
        p["credits"] = rng.choice([1, 2, 3])
    elif kind == "completion.reverse":
        p["count"] = rng.choice([2, 3, 4])
    elif kind == "status.defined":
        p["status"] = rng.randrange(1, 12)
    elif kind == "direct_load.window":
        p["mode"] = rng.choice([None, "generation", "valid", "sealed"])
    elif kind == "entry.shown":
        p["clear"] = rng.choice([int(EntryFlag.VALID), int(EntryFlag.SEALED)])
    scripts = MODEL_KINDS.get(kind, tuple(range(5)))
    script = SCRIPTS[scripts[rng.randrange(len(scripts))]]
    if kind == "credits.edge":
        p["unsolicited"] = rng.random() < 0.5     # and a COMPLETION that answers nothing before each
    return HostileCase(f"{transport}-{seed}-{index:06d}", kind, script, p)


def inner(case: HostileCase) -> tuple[Behaviour | None, dict[str, Any]]:
    """The conformance behaviour a model kind borrows, and the checking target's configuration."""
    k, p = case.kind, case.params
    made: dict[str, Callable[[], Behaviour]] = {
        "credits.edge": lambda: Unsolicited(p["credits"], 0.1, p["unsolicited"]),
        "completion.reverse": lambda: B.Reverse(p["count"]),
        "completion.duplicate": B.Duplicate, "completion.unknown": B.Unknown,
        "completion.other_opcode": B.OtherOpcodes, "load.decoy": B.Decoy,
        "direct_load.window": lambda: B.DirectLoadWindow(p["mode"]), "entry.shown": lambda: B.EntryShown(p["clear"]),
        "slot.reads": B.SlotReads, "ring.wrap": lambda: B.RingStart(RING_WRAP_FIRST),
        "table.window": B.TableWindow, "probe.buffers": EdgeProbe}
    configs: dict[str, dict[str, Any]] = {
        "quota.small": {"quota": 3}, "ring.wrap": {"quota": 6}, "addr_le": {"addr_le": True},
        "record.ungranted": {"features": Feature.DIRECT_LOAD | Feature.DIRECT_ALLOC}}
    config = configs.get(k, {})
    return (made[k]() if k in made else None), config


class Unsolicited(B.Grant):
    """Grant few credits and hold each completion; with ``unsolicited``, send a COMPLETION
    for a Request ID never used before each (a credit must not come back with it)."""

    def __init__(self, credits: int, hold: float, unsolicited: bool) -> None:
        super().__init__(credits, hold)
        self.unsolicited = unsolicited

    def complete(self, conn: CheckedConnection, req: AnyMessage, outcome: Outcome,
                 send: Callable[[], None]) -> None:
        if self.unsolicited:
            conn.send_completion(req["request_id"] | 0x5A5A << 48, req["handle"], Status.INTERNAL)
        super().complete(conn, req, outcome, send)


class EdgeProbe(Behaviour):
    """Before each request is executed, the last octet of every buffer its descriptors name
    is reached: RDMA Written for a LOAD's Data Descriptor and a completion record slot, RDMA
    Read for a store's. A refusal is noted: the descriptor claims more than was registered."""

    async def operation(self, conn: CheckedConnection, req: AnyMessage, run: Callable) -> Outcome:
        named = []
        if req["opcode"] in (Opcode.LOAD, Opcode.STORE, Opcode.ALLOC_STORE) \
                and not req["flags"] & RequestFlag.INLINE and req.get("dd.length"):
            named.append(("Data Descriptor", req["opcode"] == Opcode.LOAD, req["dd.stag"],
                          req["dd.offset"] + req["dd.length"] - 1))
        if req["flags"] & RequestFlag.RECORD and "cd.stag" in req and req["opcode"] != Opcode.BIND:
            named.append(("completion record slot", True, req["cd.stag"],
                          req["cd.offset"] + M.COMPLETION_RECORD.size - 1))
        for what, write, stag, last in named:
            edge = await B._probe(conn, write, stag, last, 2.0, B.SETTLE)
            if edge != "placed":
                conn.session.noted.append(("descriptor", f"{OPCODES.describe(req['opcode'])}: the last "
                                           f"octet of its {what} (STag {stag:#x} at {last:#x}) {edge}"))
                return Outcome(Status.INTERNAL)
        return await run()


class Hostile(Behaviour):
    """The checking target deviating as ``case.kind`` says, at request ``params['at']``;
    a model kind hands its deviations to the conformance behaviour it borrows (``inner``)."""

    def __init__(self, case: HostileCase) -> None:
        self.kind, self.p = case.kind, case.params
        self.requests = 0
        self.rng = random.Random(case.name)
        self.inner, self.config = inner(case)
        self.withheld: set[int] = set()       # Block Offsets of answers never sent

    def hello_ack(self, conn: CheckedConnection, body: HelloAck) -> None:
        k, p = self.kind, self.p
        if self.inner is not None:
            self.inner.hello_ack(conn, body)
        elif k == "hello_ack.features":
            body["hello_ack.features"] |= p["bits"]
        elif k == "hello_ack.count" and f"hello_ack.{p['which']}.count" in body:
            counts = cast("dict[str, int]", body)   # the key is one of HelloAck's own .count fields
            counts[f"hello_ack.{p['which']}.count"] = p["count"]
        elif k == "hello_ack.head_offset" and "hello_ack.head.offset" in body:
            body["hello_ack.head.offset"] += p["skew"]
        elif k == "hello_ack.credits":
            body["hello_ack.request_credits"] = p["credits"]

    def hello_ack_octets(self, conn: CheckedConnection, message: bytes) -> bytes:
        if self.kind == "hello_ack.truncate":
            return message[:max(1, len(message) - self.p["cut"])]
        if self.kind == "hello_ack.extend":
            return message + self.rng.randbytes(self.p["extra"])
        return message

    async def operation(self, conn: CheckedConnection, req: AnyMessage, run: Callable) -> Outcome:
        n, self.requests = self.requests, self.requests + 1
        k, opcode = self.kind, req["opcode"]
        answer = None
        if k == "status.defined" and n == self.p["at"]:
            answer = self.p["status"]
        elif k == "load.not_sealed" and opcode == Opcode.LOAD and not req["flags"] & RequestFlag.ALLOW_UNSEALED:
            answer = Status.NOT_SEALED
        elif k == "bind.abandoned" and opcode == Opcode.BIND:
            answer = Status.TICKET_ABANDONED
        if answer is not None:
            conn.session.altered[req["request_id"]] = Altered.NOT_EXECUTED
            return Outcome(answer)
        if self.inner is not None:
            return await self.inner.operation(conn, req, run)
        if n == self.p["at"]:
            if k == "disconnect":
                conn.qp.abort("the hostile target disconnects")
                return Outcome(0)
            if k == "load.outside" and opcode == Opcode.LOAD:
                conn.qp.write(req["dd.stag"], req["dd.offset"] + req["dd.length"], b"\xee" * 8,
                              signaled=False)
        return await run()

    def complete(self, conn: CheckedConnection, req: AnyMessage, outcome: Outcome,
                 send: Callable[[], None]) -> None:
        if self.inner is not None:
            self.inner.complete(conn, req, outcome, send)
            return
        if self.kind == "completion.delay":
            asyncio.get_running_loop().call_later(self.rng.random() * 0.25, send)
            return
        k = self.kind
        hit = len(conn.session.completions) + len(conn.session.altered) == self.p["at"]
        if not hit or k not in OLD_KINDS or not k.startswith("completion."):
            send()
            return
        rid, status, length = req["request_id"], outcome.status, outcome.data_length
        if k in ("completion.drop", "completion.request_id"):
            conn.session.altered[rid] = Altered.WITHHELD
            self.withheld.add(outcome.block_offset)
        if k == "completion.drop":
            return
        if k == "completion.request_id":
            conn.send_completion(self.p["value"] | 1 << 40, req["handle"], status, length,
                                 outcome.block_offset, outcome.generation)
            return
        if k == "completion.status":
            conn.session.altered[rid] = Altered.MISREPORTED
            status = self.p["status"]
        elif k == "completion.data_length":      # past the buffer: a lie the initiator can see
            length = req.get("dd.length", 0) + self.p["extra"]
            if req["opcode"] == Opcode.LOAD:     # elsewhere the text gives it no meaning
                conn.session.altered[rid] = Altered.LENGTH_LIE
        conn.session.completed(rid, status, outcome.block_offset, outcome.generation)
        conn.send_completion(rid, req["handle"], status, length, outcome.block_offset, outcome.generation)

    def read(self, conn: CheckedConnection, access: Access, data: bytes) -> bytes:
        if self.inner is not None:
            return self.inner.read(conn, access, data)
        if self.kind == "ring.garbage" and access.region == "ring":
            return self.rng.randbytes(len(data))
        if self.kind == "ring.torn" and access.region == "ring" and len(data) == M.SLOT_SIZE:
            slot = codec.decode_struct(M.RING_SLOT, data, conn.addr_le)
            if self.rng.random() < 0.6:
                slot["slot.block_offset"] = self.rng.choice([M.SLOT_CONSUMED, slot["slot.block_offset"] ^ 0x1000,
                                                             self.rng.getrandbits(64)])
            return codec.encode_struct(M.RING_SLOT, slot, conn.addr_le)
        if self.kind == "entry.garbage" and access.region == "table" and self.rng.random() < 0.7:
            return self.rng.randbytes(len(data))
        return data

    def noted(self, session: Session) -> None:
        """What the borrowed behaviour saw that only it could (a Read issued early)."""
        if isinstance(self.inner, B.DirectLoadWindow):
            session.noted += [("direct_load_order", why) for why in self.inner.overlapped]
            self.inner.overlapped = []


def runs(script: str) -> list[str]:
    """The runs of a script (``|`` between runs that keep the initiator's state)."""
    return [part.strip() for part in script.split("|")]


async def run_case(ctx: ICtx, case: HostileCase, script: str,
                   earlier_ids: Iterable[bytes] = ()) -> tuple[list[Finding], Model]:
    """The program's runs against the hostile target; what the oracles and the model found."""
    inputs = {"a": os.urandom(1800), "b": os.urandom(3000), "c": os.urandom(300)}
    hostile = Hostile(case)
    await ctx.serve(hostile, **hostile.config)
    model = Model(ctx.transport, inputs, protocol_kept=case.kind in GENTLE, earlier_ids=earlier_ids,
                  reads_honest=case.kind in GENTLE - READS_ALTERED, give_up=ctx.timeout / 2)
    before = bytes(ctx.served.memory.pool_view)
    state = ctx.new_state()
    found = []
    for i, part in enumerate(runs(script)):
        sessions = len(ctx.record.sessions)
        try:
            run = await ctx.run(part, inputs, state=state, connect=False)
        except Unjudged as exc:
            return ([Finding("hang", str(exc))] if "did not exit" in str(exc) else []), model
        if run.exit_code is not None and run.exit_code < 0:
            found.append(Finding("crash", f"killed by signal {-run.exit_code}"))
        if "Traceback (most recent call last)" in run.stderr:
            found.append(Finding("crash", "a traceback: " + run.tail()))
        new = ctx.record.sessions[sessions:]
        for s in new:
            hostile.noted(s)
        model.judge_run(parse(part), new, run, kept_state=i > 0, malformed_ack=case.kind in MALFORMED_ACK)
    base, size = ctx.served.memory.pool_base, ctx.config.block_size
    reached = {offset - base for offset in hostile.withheld}   # blocks a store, BIND or Write named
    for s in ctx.record.sessions:
        reached |= {a.offset - base for a in s.observed if a.kind == "write" and not a.refused}
        reached |= {b["bind.block_offset"] - base for b in s.requests("BIND")}
        reached |= {offset - base for _, _, _, offset in s.completions}
    after = bytes(ctx.served.memory.pool_view)
    stray = [i for i in range(0, len(after), size) if after[i:i + size] != before[i:i + size]
             and not any(i <= r < i + size for r in reached)]
    if stray:
        found.append(Finding("write_outside", "pool blocks changed that no store, BIND or Write of "
                             f"the initiator named: {[hex(x) for x in stray[:4]]}"))
    return found + model.found, model


@dataclass
class Summary:
    cases: int = 0
    findings: list[dict[str, Any]] = field(default_factory=list)
    kinds: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None
    tally: Tally = field(default_factory=Tally)

    @property
    def exit_code(self) -> int:
        return EXIT_HARNESS if self.error else EXIT_FINDING if self.findings else EXIT_OK


class Campaign:
    """Runs cases of one program on one listen address; remembers the Initiator IDs seen,
    so that a fresh initiator repeating an earlier one's is a finding."""

    def __init__(self, program: list[str], url: str, local: str, timeout: float, workdir: Path) -> None:
        self.program, self.url, self.local, self.timeout, self.workdir = program, url, local, timeout, workdir
        self.transport = parse_url(url).transport
        self.ids: list[bytes] = []

    async def one(self, case: HostileCase, script: str,
                  frames: FrameBuffer | None = None) -> tuple[list[Finding], Model]:
        ctx = ICtx(self.program, self.url, self.transport, local=self.local, timeout=self.timeout,
                   frames=frames or FrameBuffer(), workdir=self.workdir / f"{case.name}-{time.monotonic_ns()}")
        try:
            found, model = await run_case(ctx, case, script, self.ids)
            self.ids += model.ids
            return found, model
        finally:
            await ctx.close()

    async def minimise(self, case: HostileCase, oracle: str, budget: int) -> str:
        """The shortest script (statements dropped one at a time) on which ``oracle`` still fires."""
        statements = [(r, st.strip()) for r, part in enumerate(runs(case.script))
                      for st in part.split(";") if st.strip()]
        i = 0
        while i < len(statements) and budget > 0:
            trial = statements[:i] + statements[i + 1:]
            if trial:
                budget -= 1
                found, _ = await self.one(case, joined(trial, len(runs(case.script))))
                if any(f.oracle == oracle for f in found):
                    statements = trial
                    continue
            i += 1
        return joined(statements, len(runs(case.script)))


def joined(statements: list[tuple[int, str]], count: int) -> str:
    """A script of ``count`` runs from (run, statement) pairs."""
    return " | ".join("; ".join(st for r, st in statements if r == n) for n in range(count))


async def campaign(program: list[str], url: str, *, seed: int, count: int, start: int = 0,
                   timeout: float = 10.0, local: str = "", out: Path | None = None,
                   budget: int = 8, replay: str | None = None, stop_at_first: bool = False,
                   progress: Callable[[int, Summary], None] | None = None) -> Summary:
    """Run ``count`` cases of ``seed`` from ``start`` (or the one case ``replay``)."""
    transport = parse_url(url).transport
    workdir = Path(tempfile.mkdtemp(prefix="kbtp-ifuzz-"))
    summary = Summary()
    started = time.monotonic()
    runner = Campaign(program, url, local, timeout, workdir)
    names = [replay] if replay else [f"{transport}-{seed}-{i:06d}" for i in range(start, start + count)]
    try:
        for n, name in enumerate(names, 1):
            case = make_case(*parse_name(name))
            found, model = await runner.one(case, case.script)
            summary.cases += 1
            summary.kinds[case.kind] = summary.kinds.get(case.kind, 0) + 1
            summary.tally.add(model.tally)
            if found:
                oracle = found[0].oracle
                script = await runner.minimise(case, oracle, budget) if not replay else case.script
                frames = FrameBuffer()
                again = (await runner.one(case, script, frames))[0] or found
                record = {"case": case.name, "kind": case.kind, "params": case.params,
                          "script": script, "original_script": case.script,
                          "findings": [asdict(f) for f in again],
                          "replay": f"kbtp fuzz --role initiator --listen URL --replay {case.name}"}
                if out is not None:
                    out.mkdir(parents=True, exist_ok=True)
                    (out / f"{case.name}.json").write_text(json.dumps(record, indent=1))
                    frames.write(out / f"{case.name}.pcap")
                    record["saved"] = str(out / f"{case.name}.json")
                summary.findings.append(record)
            if progress:
                progress(n, summary)
            if found and stop_at_first:
                break
    except OSError as exc:
        summary.error = f"the hostile target cannot listen on {url} ({exc}); pick another --listen"
    except Unjudged as exc:
        summary.error = str(exc)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        summary.seconds = round(time.monotonic() - started, 1)
    return summary


def as_json(summary: Summary) -> str:
    return json.dumps({"cases": summary.cases, "findings": summary.findings, "kinds": summary.kinds,
                       "oracle": summary.tally.as_dict(), "seconds": summary.seconds,
                       "error": summary.error, "exit_code": summary.exit_code}, indent=1)


def table(summary: Summary) -> str:
    lines = [f"kbtp fuzz --role initiator: {summary.cases} case(s) in {summary.seconds:g} s, "
             f"{len(summary.findings)} with findings"]
    for f in summary.findings:
        first = f["findings"][0] if f["findings"] else {"oracle": "?", "detail": ""}
        lines.append(f"  {f['case']} [{f['kind']}] {first['oracle']}: {first['detail']}")
        lines.append(f"      script: {f['script']}")
    return "\n".join(lines + summary.tally.lines())
