"""A hostile target for fuzzing initiators: ``kbtp fuzz --role initiator``.

Each case is drawn from its name (``iwarp-SEED-INDEX``), so a seed gives the same cases
and a finding replays by name. A case is one run of the program under test with an
operation script, against a checking target that deviates in one way (a ``Hostile``
``kind``): malformed HELLO_ACKs (lengths, features not requested, descriptor Counts
out of range, a Head Tagged Offset not a multiple of 8), completions with wrong or
unknown Request IDs, Data Lengths past the buffer or statuses out of range, ring slots
of garbage and torn reads, RDMA Writes outside the descriptors, and stalls and
disconnects at any request.

The oracles: the program neither crashes (a signal, or a traceback on stderr) nor hangs
(it must give up by itself within the run's time); it never reports data as valid that
the checker did not serve as valid (a load reported OK returns what was stored); and
it never writes outside what it was granted (every RDMA Write through the Partition
STag, none refused), nor reads or adds outside it (no access the RNIC refuses). A
finding is minimised by dropping statements of the script while the same oracle still
fires, and saved as JSON and pcap.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

from ... import codec
from ...initiator.script import parse
from ...tables import memory as M
from ...target.operations import Outcome
from ...vocab import AnyMessage, HelloAck, Opcode
from ...wire.address import parse_url
from ..context import FrameBuffer
from .context import ICtx, Unjudged
from .observe import Access
from .target import Behaviour, CheckedConnection

SCRIPTS = [
    "alloc_store 0 @a seal; load 0 @ra; free 0",
    "alloc_store 0 @a seal; alloc_store 1 @b seal noinline; load 0 @ra & load 1 @rb; free 1",
    "alloc_store 0 @a seal; direct_load 0 @ra; load 0 @rb",
    "direct_alloc 0 @a; load 0 @ra; direct_load 0 @rb; free 0",
    "alloc_store 2 @b seal; direct_alloc 0 @a & load 2 @rb; direct_load 0 @ra",
]
KINDS = ("hello_ack.truncate", "hello_ack.extend", "hello_ack.features", "hello_ack.count",
         "hello_ack.head_offset", "hello_ack.credits", "completion.request_id",
         "completion.data_length", "completion.status", "completion.drop", "disconnect",
         "ring.garbage", "ring.torn", "entry.garbage", "load.outside")
DESCRIPTOR_COUNTS = ("table", "pool", "partition", "ring", "head")
EXIT_OK, EXIT_FINDING, EXIT_HARNESS = 0, 1, 2


@dataclass
class HostileCase:
    name: str
    kind: str
    script: str
    params: dict[str, Any] = field(default_factory=dict)


def parse_name(name: str) -> tuple[str, int, int]:
    transport, seed, index = name.rsplit("-", 2)
    return transport, int(seed), int(index)


def make_case(transport: str, seed: int, index: int) -> HostileCase:
    """The case ``index`` of ``seed``: the same for every run."""
    rng = random.Random(f"{seed}-{index}")
    kind = KINDS[rng.randrange(len(KINDS))]
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
    script = SCRIPTS[rng.randrange(len(SCRIPTS))]
    return HostileCase(f"{transport}-{seed}-{index:06d}", kind, script, p)


class Hostile(Behaviour):
    """The checking target deviating as ``case.kind`` says, at request ``params['at']``."""

    def __init__(self, case: HostileCase) -> None:
        self.kind, self.p = case.kind, case.params
        self.requests = 0
        self.rng = random.Random(case.name)

    def hello_ack(self, conn: CheckedConnection, body: HelloAck) -> None:
        k, p = self.kind, self.p
        if k == "hello_ack.features":
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
        if n == self.p["at"]:
            if self.kind == "disconnect":
                conn.qp.abort("the hostile target disconnects")
                return Outcome(0)
            if self.kind == "load.outside" and req["opcode"] == Opcode.LOAD:
                conn.qp.write(req["dd.stag"], req["dd.offset"] + req["dd.length"], b"\xee" * 8,
                              signaled=False)
        return await run()

    def complete(self, conn: CheckedConnection, req: AnyMessage, outcome: Outcome,
                 send: Callable[[], None]) -> None:
        hit = len(conn.session.completions) == self.p["at"]
        k = self.kind
        if not hit or not k.startswith("completion."):
            send()
            return
        if k == "completion.drop":
            conn.session.completed(req["request_id"], -1, outcome.block_offset)
            return
        rid, status, length = req["request_id"], outcome.status, outcome.data_length
        if k == "completion.request_id":
            rid = self.p["value"] | 1 << 40
        elif k == "completion.status":
            status = self.p["status"]
        elif k == "completion.data_length":      # past the buffer: a lie the initiator can see
            length = req.get("dd.length", 0) + self.p["extra"]
        conn.session.completed(req["request_id"], status, outcome.block_offset)
        conn.send_completion(rid, req["handle"], status, length, outcome.block_offset, outcome.generation)

    def read(self, conn: CheckedConnection, access: Access, data: bytes) -> bytes:
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


def expected_data(script: str, inputs: dict[str, bytes]) -> dict[str, bytes]:
    """Output file -> the data a load reported OK must hold (the last store to its handle)."""
    stored: dict[int, bytes] = {}
    out: dict[str, bytes] = {}
    for statement in parse(script):
        for op in statement:
            if op.handle is None or op.file is None and op.name != "free":
                continue
            if op.name in ("alloc_store", "store", "direct_alloc") and op.file:
                stored[op.handle] = inputs[op.file]
            elif op.name in ("load", "direct_load") and op.file and op.handle in stored:
                out[op.file] = stored[op.handle]
            elif op.name == "free":
                stored.pop(op.handle, None)
    return out


@dataclass
class Finding:
    oracle: str          # crash, hang, invalid_data, write_outside
    detail: str


async def run_case(ctx: ICtx, case: HostileCase, script: str) -> list[Finding]:
    """One run of the program against the hostile target; what the oracles found."""
    inputs = {"a": os.urandom(1800), "b": os.urandom(3000)}
    await ctx.serve(Hostile(case))
    before = bytes(ctx.served.memory.pool_view)
    try:
        run = await ctx.run(script, inputs, connect=False)
    except Unjudged as exc:
        return [Finding("hang", str(exc))] if "did not exit" in str(exc) else []
    found = []
    if run.exit_code is not None and run.exit_code < 0:
        found.append(Finding("crash", f"killed by signal {-run.exit_code}"))
    if "Traceback (most recent call last)" in run.stderr:
        found.append(Finding("crash", "a traceback: " + run.tail()))
    want = expected_data(script, inputs)
    ops = [op for st in parse(script) for op in st]
    for op, (name, _, status) in zip(ops, run.results):
        if status == "OK" and op.file in want and run.output(op.file) != want[op.file]:
            got = run.output(op.file) or b""
            found.append(Finding("invalid_data", f"{name} {op.handle} reported OK with {len(got)} "
                                 f"octets that are not the {len(want[op.file])} stored"))
    base, size = ctx.served.memory.pool_base, ctx.config.block_size
    reached: set[int] = set()            # blocks a store, a BIND or a partition Write named
    for s in ctx.record.sessions:
        for a in s.accesses:
            if a.kind == "write" and (a.refused or a.region != "partition"):
                found.append(Finding("write_outside", f"an RDMA Write to the {a.region} STag "
                                     f"{a.stag:#x} at {a.offset:#x}" + (f" ({a.refused})" if a.refused else "")))
            elif a.kind == "write":
                reached.add(a.offset - base)
            elif a.refused and not a.duplicate:
                found.append(Finding("access_outside", f"an RDMA {a.kind} of {a.length} octets at "
                                     f"{a.offset:#x} of the {a.region} STag {a.stag:#x} ({a.refused})"))
        reached |= {b["bind.block_offset"] - base for b in s.requests("BIND")}
        reached |= {offset - base for _, _, _, offset in s.completions}
    after = bytes(ctx.served.memory.pool_view)
    stray = [i for i in range(0, len(after), size) if after[i:i + size] != before[i:i + size]
             and not any(i <= r < i + size for r in reached)]
    if stray:
        found.append(Finding("write_outside", "pool blocks changed that no store, BIND or Write of "
                             f"the initiator named: {[hex(x) for x in stray[:4]]}"))
    return found


@dataclass
class Summary:
    cases: int = 0
    findings: list[dict[str, Any]] = field(default_factory=list)
    kinds: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None

    @property
    def exit_code(self) -> int:
        return EXIT_HARNESS if self.error else EXIT_FINDING if self.findings else EXIT_OK


async def _one(program: list[str], url: str, transport: str, local: str, timeout: float,
               workdir: Path, case: HostileCase, script: str,
               frames: FrameBuffer | None = None) -> list[Finding]:
    ctx = ICtx(program, url, transport, local=local, timeout=timeout, frames=frames or FrameBuffer(),
               workdir=workdir / f"{case.name}-{time.monotonic_ns()}")
    try:
        return await run_case(ctx, case, script)
    finally:
        await ctx.close()


async def minimise(one: Callable, case: HostileCase, oracle: str, budget: int) -> str:
    """The shortest script (statements dropped one at a time) on which ``oracle`` still fires."""
    statements = [s.strip() for s in case.script.split(";") if s.strip()]
    i = 0
    while i < len(statements) and budget > 0:
        trial = statements[:i] + statements[i + 1:]
        if trial:
            budget -= 1
            if any(f.oracle == oracle for f in await one(case, "; ".join(trial))):
                statements = trial
                continue
        i += 1
    return "; ".join(statements)


async def campaign(program: list[str], url: str, *, seed: int, count: int, start: int = 0,
                   timeout: float = 10.0, local: str = "", out: Path | None = None,
                   budget: int = 8, replay: str | None = None,
                   progress: Callable[[int, Summary], None] | None = None) -> Summary:
    """Run ``count`` cases of ``seed`` from ``start`` (or the one case ``replay``)."""
    transport = parse_url(url).transport
    workdir = Path(tempfile.mkdtemp(prefix="kbtp-ifuzz-"))
    summary = Summary()
    started = time.monotonic()

    async def one(case: HostileCase, script: str, frames: FrameBuffer | None = None) -> list[Finding]:
        return await _one(program, url, transport, local, timeout, workdir, case, script, frames)

    names = [replay] if replay else [f"{transport}-{seed}-{i:06d}" for i in range(start, start + count)]
    try:
        for n, name in enumerate(names, 1):
            case = make_case(*parse_name(name))
            found = await one(case, case.script)
            summary.cases += 1
            summary.kinds[case.kind] = summary.kinds.get(case.kind, 0) + 1
            if found:
                oracle = found[0].oracle
                script = await minimise(one, case, oracle, budget) if not replay else case.script
                frames = FrameBuffer()
                again = await one(case, script, frames) or found
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
                       "seconds": summary.seconds, "error": summary.error,
                       "exit_code": summary.exit_code}, indent=1)


def table(summary: Summary) -> str:
    lines = [f"kbtp fuzz --role initiator: {summary.cases} case(s) in {summary.seconds:g} s, "
             f"{len(summary.findings)} with findings"]
    for f in summary.findings:
        first = f["findings"][0] if f["findings"] else {"oracle": "?", "detail": ""}
        lines.append(f"  {f['case']} [{f['kind']}] {first['oracle']}: {first['detail']}")
        lines.append(f"      script: {f['script']}")
    return "\n".join(lines)
