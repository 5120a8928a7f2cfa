"""Running cases: steps against the live sessions, then the oracles; findings minimized.

One ``World`` (two sessions) serves many cases; a case that ends a connection is followed
by a reconnect with the same Initiator ID, and a case with a finding, or one that left
the sessions where the model cannot follow them, by fresh sessions.
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from ..harness import HarnessError
from ..rnic.qp import ConnectionLost, RemoteError
from ..wire.address import parse_url
from .cases import Case, Step
from .findings import Finding
from .oracles import liveness, table_invariants
from .state import Lost, NoAnswer, Rebuild, SetupFault, World
from .steps import Steps


@dataclass
class CaseResult:
    case: Case
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    duration: float = 0.0


def family(step: Step) -> str:
    """The summary's name for a step: its kind, and a mutation's family."""
    return f"mutate.{step['family']}" if step["kind"] == "mutate" else step["kind"]


class Runner(Steps):
    def __init__(self, url: str, options: dict, timeout: float = 10.0, frame_listeners: list | None = None) -> None:
        super().__init__()
        parse_url(url)
        self.url, self.options, self.timeout = url, options, timeout
        self.frame_listeners = frame_listeners
        self._world: World | None = None
        self.families: Counter[str] = Counter()
        self._reconnects = 0

    @property
    def reconnects(self) -> int:
        return self._reconnects + (self._world.reconnects if self._world else 0)

    @property
    def world(self) -> World:
        """The sessions of the current start."""
        if self._world is None:
            raise HarnessError("the fuzzer has no sessions before Runner.start")
        return self._world

    async def start(self) -> None:
        self._world = World(self.url, self.options, self.timeout, self.frame_listeners, self.tally)
        await self._world.open()

    async def restart(self) -> None:
        await self.stop()
        self._reconnects += self.world.reconnects
        await self.start()

    async def stop(self) -> None:
        if self._world is not None:
            await self._world.close(release=True)

    def _taken(self, step: int | None) -> list[Finding]:
        """What session set-up and reconnects showed since the last look (HELLO_ACKs)."""
        found, self.world.findings = self.world.findings, []
        for f in found:
            f.step = step
        return found

    # -- a case --------------------------------------------------------------------------

    async def run_case(self, case: Case, steps: list[Step] | None = None) -> CaseResult:
        """Run the steps (default: the case's), then the oracles. Every step is counted
        in ``families`` when it starts, whether or not its session could be resumed."""
        result = CaseResult(case)
        t0 = time.monotonic()
        result.findings += self._taken(None)
        judged = True
        for i, step in enumerate(case.steps if steps is None else steps):
            self.families[family(step)] += 1
            try:
                await self.world.ensure()
                found = await self._step(step)
                found += await self.repair()
                if self.world.own.known.tickets:     # left unbound: it will be abandoned
                    self.world.spoiled = True
            except Rebuild as exc:
                result.notes.append(f"step {i}: {exc}")
                if not await self._fresh(result):
                    judged = False
                    break
                continue
            except Lost as exc:
                result.findings.append(Finding("liveness", str(exc), i))
                judged = False
                break
            except NoAnswer as exc:
                result.findings.append(Finding("no-answer", str(exc), i))
                self.world.spoiled, judged = True, False
                break
            except (ConnectionLost, RemoteError) as exc:
                result.notes.append(f"step {i}: connection ended ({exc})")
                continue
            for f in found:
                f.step = i
            result.findings += found + self._taken(i)
        if judged:
            result.findings += await self._oracles(result)
        if self.world.spoiled:
            await self._fresh(result)
        result.duration = time.monotonic() - t0
        return result

    async def _fresh(self, result: CaseResult) -> bool:
        """Fresh sessions; when the target fails their set-up (what the case left makes
        it fail), that is a finding of the case."""
        try:
            await self.restart()
            return True
        except SetupFault as fault:
            result.findings.append(fault.finding)
            return False

    async def _step(self, step: Step) -> list[Finding]:
        kind = step["kind"]
        if kind == "reconnect":
            await self.within(self.world.own.ini.goodbye(release=False), "GOODBYE")
            return []
        handler = {"mutate": self.mutate, "valid": self.valid, "rdma": self.rdma, "burst": self.burst,
                   "quota": self.quota, "abandon": self.abandon}.get(kind)
        if handler is None:
            raise HarnessError(f"unknown step kind {kind!r}")
        return await handler(step)

    async def _oracles(self, result: CaseResult) -> list[Finding]:
        w = self.world
        out = await liveness(w) + self._taken(None)
        if any(f.kind == "liveness" for f in out):
            return out
        for _ in range(2):
            try:
                await w.ensure()
                out += self.stray(w.own) + self.stray(w.peer)
                out += await self.known_loads()
                out += await self.within(table_invariants(w), "reading the table and the ring")
                return out + self._taken(None)
            except Rebuild as exc:
                result.notes.append(str(exc))
                if not await self._fresh(result):
                    return out
                w = self.world
            except Lost as exc:
                return out + [Finding("liveness", str(exc))]
            except NoAnswer as exc:
                w.spoiled = True
                return out + [Finding("no-answer", str(exc))]
            except (ConnectionLost, RemoteError) as exc:
                result.notes.append(f"oracle: connection ended ({exc})")
        return out


async def minimize(runner_factory: Callable[[], Runner], case: Case, kinds: set[str], budget: int = 24,
                   progress: Callable[[int, int], None] | None = None) -> list[Step]:
    """Delta debugging over the case's steps: the fewest that still show a finding of
    one of ``kinds`` on fresh sessions; ``progress(tries, steps left)`` after each try."""
    tries = 0

    async def shows(steps: list[Step]) -> bool:
        nonlocal tries
        tries += 1
        r = runner_factory()
        try:
            await r.start()
            res = await r.run_case(case, steps)
            if "setup" in kinds and not any(f.kind == "setup" for f in res.findings):
                await r.restart()          # set-up faults show when the next sessions begin
        except SetupFault:
            return "setup" in kinds
        except HarnessError:      # the target can no longer give fresh sessions
            return False
        finally:
            await r.stop()
            if progress:
                progress(tries, len(steps))
        return any(f.kind in kinds for f in res.findings)

    steps, n = list(case.steps), 2
    if await shows([]):
        return []
    while len(steps) >= 2 and tries < budget:
        chunk = max(1, len(steps) // n)
        reduced = False
        for start in range(0, len(steps), chunk):
            candidate = steps[:start] + steps[start + chunk:]
            if candidate and tries < budget and await shows(candidate):
                steps, n, reduced = candidate, max(n - 1, 2), True
                break
        if not reduced:
            if n >= len(steps) or tries >= budget:
                break
            n = min(len(steps), 2 * n)
    return steps
