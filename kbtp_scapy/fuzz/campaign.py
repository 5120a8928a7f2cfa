"""A run of many cases (or one replayed), its findings minimized and saved, stoppable by Ctrl-C.

``Control`` carries what the command line wants to hear while the run goes (progress of
cases and of minimization) and lets it stop the run: after ``interrupt()`` the case in
progress is abandoned, a finding being minimized is saved as it was found, the sessions
end with GOODBYE RELEASE and the summary says how far the run got.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..harness import HarnessError
from ..initiator.presence import absent
from ..rnic.pcap import PcapSink
from ..wire.address import parse_url
from . import report
from .cases import Case, corpus_digest, make_case, parse_name
from .corpus import Corpus
from .findings import Finding
from .recent import Recent
from .restart import Restart, restart
from .runner import Runner, minimize
from .state import SetupFault
from .trouble import TRANSPORT_ERRORS, describe


@dataclass
class Run:
    """What every session of a run needs, and what its replay command must repeat."""

    url: str
    options: dict            # Initiator.connect options: local address, raw I/O
    timeout: float
    replay_args: list[str]   # the command-line options that give ``options`` and ``timeout``
    budget: int = 24
    restart: Restart | None = None   # --restart-cmd: start a target that went away again
    corpus: Corpus | None = None     # --seed-corpus: captured requests the cases start from

    def runner(self, frame_listeners: list | None = None) -> Runner:
        return Runner(self.url, self.options, self.timeout, frame_listeners)


RESUME_TRIES = 3      # fresh sessions tried after a finding before the run stops
#: findings that may mean the target went away: look before minimizing against it
SILENT = {"liveness", "no-answer", "setup"}


async def gone(run: Run) -> str | None:
    """Why the target no longer answers a HELLO (asked twice), or None while it does."""
    why = await absent(run.url, run.options, run.timeout)
    return None if why is None else describe(why, run.timeout)


class Control:
    """Progress callbacks and Ctrl-C for a run."""

    def __init__(self, on_case: Callable[[int, report.Summary], None] | None = None,
                 on_minimize: Callable[[str, int, int, int], None] | None = None) -> None:
        self.on_case = on_case or (lambda done, summary: None)
        self.on_minimize = on_minimize or (lambda case, tries, budget, steps: None)
        self.interrupted = False
        self._event: asyncio.Event | None = None

    def interrupt(self) -> None:
        self.interrupted = True
        if self._event is not None:
            self._event.set()

    async def run(self, aw: Awaitable) -> tuple[Any, bool]:
        """``(result, True)``, or ``(None, False)`` when interrupted first (``aw`` cancelled)."""
        if self._event is None:
            self._event = asyncio.Event()
        task = asyncio.ensure_future(aw)
        if self.interrupted:
            task.cancel()
        waiter = asyncio.ensure_future(self._event.wait())
        done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if task in done and not task.cancelled():
            return task.result(), True
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        return None, False


async def _finding(run: Run, control: Control, case: Case, first: list, out: Path | None) -> report.Saved:
    """Minimize on fresh sessions, replay the result once more with a capture, save it."""
    kinds = {f.kind for f in first}

    def tried(tries: int, steps: int) -> None:
        control.on_minimize(case.name, tries, run.budget, steps)

    minimized, done = await control.run(minimize(run.runner, case, kinds, run.budget, tried))
    if not done:
        return report.Saved(case, first, case.steps, False)
    pcap = out / f"{case.name}.pcap" if out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    sink = PcapSink(pcap) if pcap else None
    r = run.runner([sink] if sink else None)
    shown = []
    try:
        await r.start()
        res, done = await control.run(r.run_case(case, minimized))
        shown = [f for f in res.findings if f.kind in kinds] if done else []
        if done and "setup" in kinds and not shown:
            await r.restart()
    except SetupFault as fault:
        shown = [fault.finding] if "setup" in kinds else []
    except HarnessError:
        pass
    finally:
        await r.stop()
        if sink:
            sink.close()
    if not shown:
        return report.Saved(case, first, case.steps, False, pcap_path=str(pcap) if pcap else None)
    return report.Saved(case, shown, minimized, True, pcap_path=str(pcap) if pcap else None)


async def _guarded(run: Run, control: Control, summary: report.Summary, runner: Runner,
                   body: Callable[[], Awaitable[None]]) -> report.Summary:
    """``body()``, ended by a harness error or a fault of the fuzzer as a harness error
    (never a pass); the summary is filled and the sessions released either way."""
    t0 = time.monotonic()
    try:
        await body()
    except HarnessError as exc:
        summary.error = str(exc)
    except Exception as exc:
        summary.error = f"the fuzzer failed: {type(exc).__name__}: {describe(exc, run.timeout)}"
    finally:
        summary.interrupted = control.interrupted
        summary.reconnects, summary.steps, summary.answers = runner.reconnects, +runner.families, +runner.answers
        summary.oracle = runner.tally
        summary.seconds = time.monotonic() - t0
        try:
            await asyncio.wait_for(runner.stop(), 2 * run.timeout)
        except Exception:   # the verdict is already made; a failing GOODBYE changes nothing
            pass
    return summary


async def campaign(run: Run, control: Control, seed: int, count: int, start: int,
                   time_limit: float | None, out: Path | None, max_findings: int) -> report.Summary:
    transport = parse_url(run.url).transport
    summary = report.Summary(run.url, seed, run.replay_args, corpus=run.corpus)
    recent = Recent()
    runner = run.runner([recent])
    t0 = time.monotonic()

    def vanished(case: Case, findings: list[Finding], why: str) -> None:
        """The target went away during ``case``: a finding with the last cases' frames."""
        pcap = out / f"{case.name}.pcap" if out else None
        if pcap:
            recent.write(pcap)
        gone_at = Finding("gone", f"the target went away / stopped answering: a HELLO on a new "
                                  f"connection, tried twice, got {why}")
        saved = report.Saved(case, [*findings, gone_at], case.steps, False,
                             pcap_path=str(pcap) if pcap else None, recent=recent.names)
        if summary.saved and summary.saved[-1].case is case:
            summary.saved.pop()                    # saved before the target went: said again
        if out:
            report.save(out, summary, saved)
        summary.saved.append(saved)
        summary.gone_at = case.name
        summary.stopped = f"the target went away at case {case.name}"

    async def resumed(case: Case) -> bool:
        """Fresh sessions after ``case``; a target that keeps failing their set-up after a
        finding was saved stops the run (the finding says why), never as a harness error."""
        fault = None
        for _ in range(RESUME_TRIES):
            try:
                _, done = await control.run(runner.restart())
                return done
            except SetupFault as exc:
                fault = exc.finding
        assert fault is not None              # every one of the RESUME_TRIES (> 0) failed
        summary.stopped = (f"the target failed the set-up of fresh sessions {RESUME_TRIES} times after "
                           f"case {case.name} ({fault.detail})")
        return False

    async def cases() -> None:
        try:
            _, done = await control.run(runner.start())
        except SetupFault as fault:          # before any case: a finding without steps
            first = make_case(transport, seed, start, run.corpus)
            saved = report.Saved(Case(first.name, seed, start, []), [fault.finding], [], True)
            if out:
                report.save(out, summary, saved)
            summary.saved.append(saved)
            done = await resumed(first)
        index = start
        while True:
            try:
                went = await each_case(done, index)
            except (HarnessError, *TRANSPORT_ERRORS):    # it answered at the start: gone since?
                why = await gone(run) if at else None
                if why is None:
                    raise
                vanished(at[0], [], why)
                went = True
            if not went or not await restarted():
                return
            index = at[0].index + 1
            done = await resumed(at[0])

    async def restarted() -> bool:
        """The target went away: with --restart-cmd, start it again and go on."""
        if run.restart is None:
            return False
        why, done = await control.run(restart(run.restart, run.url, run.options, run.timeout))
        if not done:
            return False
        if why is not None:
            summary.stopped = f"the target went away at case {summary.gone_at} and did not come back: {why}"
            return False
        summary.restarts += 1
        summary.stopped = ""
        return True

    at: list[Case] = []               # the case running, once the sessions began

    async def each_case(done: bool, first: int) -> bool:
        """Cases from ``first`` on; True when the target went away (during ``at[0]``)."""
        for index in range(first, start + count):
            if not done:
                return False
            if time_limit is not None and time.monotonic() - t0 > time_limit:
                summary.stopped = f"--time-limit {time_limit:g} s reached"
                return False
            case = make_case(transport, seed, index, run.corpus)
            at[:] = [case]
            recent.begin(case.name)
            res, done = await control.run(runner.run_case(case))
            if not done:
                return False
            summary.cases += 1
            kinds = {f.kind for f in res.findings}
            if kinds & SILENT and (why := await gone(run)):
                vanished(case, res.findings, why)
                return True
            if res.findings:
                saved = await _finding(run, control, case, res.findings, out)
                if out:
                    report.save(out, summary, saved)
                summary.saved.append(saved)
                if max_findings and len(summary.saved) >= max_findings:
                    summary.stopped = f"--max-findings {max_findings} reached"
                    return False
                done = await resumed(case)
            control.on_case(index - start + 1, summary)
        return False
    return await _guarded(run, control, summary, runner, cases)


def load_case(what: str, corpus: Corpus | None = None) -> Case:
    """A case by name (regenerated, from the same seed corpus only) or from a saved
    finding's JSON (its minimized steps)."""
    path = Path(what)
    if path.suffix == ".json" and path.exists():
        doc = json.loads(path.read_text())
        _, seed, index = parse_name(doc["case"])
        return Case(doc["case"], seed, index, doc["minimized_steps"] or doc["steps"])
    transport, seed, index = parse_name(what)
    made, given = corpus_digest(what), corpus.digest if corpus else None
    if made != given:
        raise ValueError(f"the case was made {f'from seed corpus {made}' if made else 'without a seed corpus'}, "
                         f"{f'--seed-corpus gives {given}' if given else 'no --seed-corpus is given'}")
    return make_case(transport, seed, index, corpus)


async def replay_case(run: Run, control: Control, case: Case) -> report.Summary:
    """One case on fresh sessions, with no minimization."""
    summary = report.Summary(run.url, case.seed, run.replay_args, corpus=run.corpus)
    runner = run.runner()

    async def one() -> None:
        try:
            _, done = await control.run(runner.start())
            if not done:
                return
            res, done = await control.run(runner.run_case(case))
            if done and not res.findings:
                _, done = await control.run(runner.restart())   # a set-up fault the case leaves
        except SetupFault as fault:
            summary.cases = 1
            summary.saved.append(report.Saved(case, [fault.finding], case.steps, True))
            return
        if done:
            summary.cases = 1
            if res.findings:
                summary.saved.append(report.Saved(case, res.findings, case.steps, True))
    return await _guarded(run, control, summary, runner, one)
