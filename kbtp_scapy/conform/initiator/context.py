"""What an initiator case works with: a checking target of its own, and runs of the program.

A case starts the checking target with the configuration and ``Behaviour`` it needs
(``serve``), runs the program under test with an operation script and input files
(``run``), and judges from the run (exit status, results, output files) and from the
target's ``record``. A run that cannot be judged (the program is missing, hangs, or
exits without ever connecting) raises ``Unjudged``: the case is an ERROR with the reason.
"""
from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Callable, Coroutine
from dataclasses import replace
from pathlib import Path
from typing import Any

from ...initiator.script import UNSUPPORTED, parse
from ...target.config import TargetConfig
from ...vocab import Feature
from ..context import FrameBuffer
from ..registry import Case, Fail, Skip
from .observe import Record
from .program import ProgramMissing, Run, run as run_program
from .target import DEVICE_RESPONDER, Behaviour, CheckingTarget

#: The checking target's defaults: small, so a case can fill a quota or a range quickly.
#: Max Inline below the Block Size, so a large store travels by RDMA Read from the
#: initiator's Data Descriptor; many receive buffers, so credits are judged by counting
#: rather than by the transport refusing a request. Every peer is trusted for the direct
#: modes: the initiator under test may connect from any address (an RDMA device's, in the
#: lab), and the Direct Load and Direct Allocation cases need them granted; the checking
#: target's memory holds only the case's own octets (docs/DECISIONS.md, "Trust for the
#: direct modes", is about targets that serve real caches).
BASE = TargetConfig(blocks=64, block_size=4096, max_inline=512, max_initiators=8, quota=8,
                    handles_per_initiator=16, request_credits=64, ticket_timeout_ms=2000,
                    retention_s=30,
                    features=Feature.DIRECT_LOAD | Feature.DIRECT_ALLOC | Feature.RECORD_COMPLETION,
                    hello_timeout_s=5.0, trust=("0.0.0.0/0", "::/0"))

ICASES: list[Case] = []


def icase(id: str, section: str, level: str, requirement: str, *, transport: str | None = None,
          slow: str = "") -> Callable[[Callable[[ICtx], Coroutine[Any, Any, None]]],
                                      Callable[[ICtx], Coroutine[Any, Any, None]]]:
    """Register the decorated coroutine as the initiator case ``id``."""
    def register(fn: Callable[[ICtx], Coroutine[Any, Any, None]]) -> Callable[[ICtx], Coroutine[Any, Any, None]]:
        if any(c.id == id for c in ICASES):
            raise ValueError(f"duplicate case id {id}")
        ICASES.append(Case(id, section, level, " ".join(requirement.split()), fn,  # type: ignore[arg-type]
                           transport=transport, slow=slow))
        return fn
    return register


class Unjudged(Exception):
    """The program under test could not be judged: missing, hanging, or never connecting."""


class ICtx:
    """One initiator case: ``serve`` a checking target, ``run`` the program against it."""

    def __init__(self, program: list[str], url: str, transport: str, *, local: str,
                 timeout: float, frames: FrameBuffer, workdir: Path,
                 io: dict[str, Any] | None = None) -> None:
        self.program, self.url, self.transport = program, url, transport
        self.io = io or {}           # the checking target's backend: {} (the soft RNIC) or verbs
        self.local, self.timeout, self.frames, self.workdir = local, timeout, frames, workdir
        self.target: CheckingTarget | None = None
        self.notes: list[str] = []
        self.runs: list[Run] = []
        self.budget: asyncio.Timeout | None = None   # the case's, which slow runs extend
        self._n = itertools.count(1)

    @property
    def record(self) -> Record:
        return self.served.record

    async def serve(self, behaviour: Behaviour | None = None, **config: Any) -> CheckingTarget:
        """Start this case's checking target, ``config`` changing the defaults; a SKIP
        where ``behaviour`` changes what Reads return and an RDMA device serves them."""
        await self.close()
        if self.io.get("io") == "verbs" and behaviour is not None \
                and type(behaviour).read is not Behaviour.read:
            self.skip(DEVICE_RESPONDER)
        target = CheckingTarget(replace(BASE, **config), self.transport, behaviour, self.io.get("io"))
        target.frame_listeners.append(self.frames)
        for attempt in range(20):            # the previous case's address may linger a moment
            try:
                await target.start(self.url, **self.io)
                break
            except OSError:
                if attempt == 19:
                    raise
                await asyncio.sleep(0.1)
        self.target = target
        return target

    @property
    def served(self) -> CheckingTarget:
        """The checking target ``serve`` started."""
        assert self.target is not None, "serve() first"
        return self.target

    @property
    def config(self) -> TargetConfig:
        return self.served.config

    def new_state(self) -> Path:
        """A state directory no run used: the program starts as a fresh initiator."""
        path = self.workdir / f"state{next(self._n)}"
        path.mkdir(parents=True)
        return path

    async def run(self, ops: str, inputs: dict[str, bytes] | None = None, *,
                  state: Path | None = None, connect: bool = True) -> Run:
        """Run the program once with ``ops``; ``Unjudged`` when it cannot be judged
        and, with ``connect`` (a conformance case), when it never opened a session, and
        Skip when it reported an operation of ``ops`` UNSUPPORTED."""
        if self.target is None:
            await self.serve()
        n = next(self._n)
        in_dir, out_dir = self.workdir / f"in{n}", self.workdir / f"out{n}"
        in_dir.mkdir(parents=True)
        out_dir.mkdir(parents=True)
        for name, data in (inputs or {}).items():
            (in_dir / name).write_bytes(data)
        state = state or self.new_state()
        sessions = len(self.record.sessions)
        values = {"url": self.url, "local": self.local, "ops": ops, "in": str(in_dir),
                  "out": str(out_dir), "state": str(state), "timeout": f"{self.told:g}"}
        begun = time.monotonic()
        try:
            run = await run_program(self.program, values, lambda started: self.patience(sessions, started))
        except ProgramMissing as exc:
            raise Unjudged(str(exc)) from None
        self.runs.append(run)
        self._extend(run.seconds - self.timeout)
        if run.timed_out:
            waited = round(self.patience(sessions, begun), 1)
            raise Unjudged(f"the program did not exit within {waited:g} s ({self._paced(sessions, begun)}) "
                           f"and was killed with its process group (ops {ops!r}; raise --timeout for a "
                           "slow one)")
        if not connect:
            return run
        statements = [op for st in parse(ops) for op in st]
        missing = sorted({" ".join([op.name, *sorted(op.words)]) for op, (_, _, status)
                          in zip(statements, run.results) if status == UNSUPPORTED})
        if missing:
            self.skip(f"the initiator does not implement {'; '.join(missing)} (reported {UNSUPPORTED})")
        if len(self.record.sessions) == sessions:
            raise Unjudged(f"the program exited with status {run.exit_code} in {run.seconds:.1f} s "
                           f"without connecting to {self.url}: {run.tail()}")
        return run

    @property
    def told(self) -> float:
        """Seconds the program is told it has ({timeout}) to give up by itself."""
        return self.timeout / 2

    def _started_up(self, sessions: int, started: float) -> float | None:
        """Seconds from the program's start to its first connection of this run, if any."""
        new = self.record.sessions[sessions:] if self.target is not None else []
        return max(0.0, new[0].opened - started) if new else None

    def patience(self, sessions: int, started: float) -> float:
        """How long the checker waits for a run that started at ``started``: --timeout
        until the program connects; once it has, s seconds after its start, also 2 s
        more: the time it took to start is its pace on this host, and its exit (an
        interpreter's teardown, say) goes at the same pace. So a correct program that
        uses its whole {timeout} for the operations and again for ending the session (the
        reference bounds the connection, the script and GOODBYE each by it) is never
        called hung, however busy the host."""
        start_up = self._started_up(sessions, started)
        return self.timeout + 2 * (start_up or 0.0)

    def _extend(self, seconds: float) -> None:
        """Give the case's budget ``seconds`` more: a run's slow start is not the case's."""
        when = self.budget.when() if self.budget is not None else None
        if self.budget is not None and when is not None and seconds > 0:
            self.budget.reschedule(when + seconds)

    def _paced(self, sessions: int, begun: float) -> str:
        start_up = self._started_up(sessions, begun)
        told = f"told {{timeout}} {self.told:g} s"
        if start_up is None:
            return f"it never connected; {told}"
        return f"it connected {start_up:.1f} s after its start; {told}"

    async def run_ok(self, ops: str, inputs: dict[str, bytes] | None = None, *,
                     state: Path | None = None) -> Run:
        """``run``, and the program must exit 0 having written one result per operation."""
        run = await self.run(ops, inputs, state=state)
        if run.exit_code != 0:
            raise Fail(f"exit status 0 after {ops!r}", f"status {run.exit_code}: {run.tail()}")
        return run

    @staticmethod
    def check(condition: bool, expected: str, seen: Any) -> None:
        if not condition:
            raise Fail(expected, str(seen))

    def expect_statuses(self, run: Run, expected: list[str], what: str) -> None:
        self.check(run.statuses() == expected, f"{what}: results {' '.join(expected)}",
                   " ".join(run.statuses()) or "no results file")

    def note(self, text: str) -> None:
        self.notes.append(text)

    def skip(self, reason: str) -> None:
        raise Skip(reason)

    async def close(self) -> None:
        if self.target is not None:
            target, self.target = self.target, None
            await target.close()

    def data(self, size: int, tag: int = 0) -> bytes:
        """``size`` octets no other input of the case has: random, tagged by ``tag``."""
        return bytes([tag & 0xFF]) + os.urandom(size - 1)
