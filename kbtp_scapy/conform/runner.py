"""Running cases against a target: a probe HELLO, then each case with its own sessions.

A case's verdict comes from what it raised: nothing is PASS, ``Fail`` is FAIL (WARN for a
SHOULD), ``Skip`` is SKIP, ``Broke`` is FAIL naming the rule the target broke in a step
that only prepared the case, ``SetupFailed`` is ERROR naming a step the checker could not
take, anything else is ERROR (the harness could not judge). A lost connection or a
request failing where the case did not expect it is the target's doing (FAIL). After a
case that did not pass, a target that no longer answers a HELLO, asked twice, went away:
that case FAILs so and the cases left are not run (SKIP). The frames of each case are
kept in memory and written to a pcap only when the case did not pass.
"""
from __future__ import annotations

import asyncio
import errno
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..harness import HarnessError
from ..initiator import Initiator, KbtpError, PeerLimit
from ..initiator.client import ALL_FEATURES
from ..initiator.limits import Limits, connect_deadline
from ..initiator.presence import absent
from ..initiator.results import TargetInfo
from ..rnic.qp import ConnectionLost, RemoteError, foreign
from ..vocab import Feature
from ..wire.address import parse_url
from .context import Ctx, FrameBuffer, RunState, describe, session_options
from .registry import (
    ERROR,
    FAIL,
    PASS,
    SHOULD,
    SKIP,
    WARN,
    Broke,
    Case,
    Fail,
    Rule,
    SetupFailed,
    Skip,
)

CASE_BUDGET = 8      # a whole case may take this many --timeout periods (unless it says)


@dataclass
class Outcome:
    case: Case
    verdict: str
    expected: str = ""
    seen: str = ""
    detail: str = ""
    notes: list[str] = field(default_factory=list)
    pcap: str | None = None
    duration: float = 0.0
    broke: Rule | None = None     # FAIL in a set-up step: the rule the target broke there
    gone_at: str = ""             # the target went away at this case (FAIL there, SKIP after)

    @property
    def not_run(self) -> bool:
        """SKIP because the run could not reach the case (the target went away before it):
        no verdict on the target, so ``--rerun-failed`` runs it again."""
        return self.verdict == SKIP and bool(self.gone_at)


class Listener:
    """What a front end hears of a run; every method may be left as it is."""

    def probed(self, info: TargetInfo, total: int) -> None:
        """The target answered the probe; ``total`` cases follow."""

    def started(self, index: int, total: int, case: Case) -> None:
        """Case ``index`` (from 1) of ``total`` begins."""

    def finished(self, index: int, total: int, outcome: Outcome) -> None:
        """Case ``index`` has its verdict."""

    def gone(self, case: Case, left: int) -> None:
        """The target went away at ``case``: the ``left`` cases after it are not run."""


async def probe(url: str, local: str | None, timeout: float,
                state: RunState | None = None) -> TargetInfo:
    """HELLO with every feature requested: what the target offers, for SKIP decisions."""
    options = session_options(local, state)
    try:        # the RNIC's own set-up waits as long (not its default), so the reason holds
        ini = await asyncio.wait_for(Initiator.connect(url, features=ALL_FEATURES, connect_timeout=timeout,
                                                       **options), connect_deadline(timeout))
    except PeerLimit as exc:          # every case's HELLO fails on it: FAIL (Ctx.connect)
        return exc.target
    except KbtpError as exc:
        raise HarnessError(f"{url}: the target refused the probe HELLO ({exc.name}); if it admits "
                           "few initiators, end other sessions first") from None
    except (TimeoutError, ConnectionLost, RemoteError) as exc:
        if foreign(exc):
            raise HarnessError(f"{url}: {exc}; give the address and port of a KBTP target") from None
        raise HarnessError(f"{url}: cannot reach a KBTP target ({describe(exc, timeout)}); check "
                           "the address and that the target runs, or raise --timeout") from None
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE and local:
            raise HarnessError(f"the local address {local}: already in use; pick another with "
                               "--local") from None
        raise HarnessError(f"{url}: cannot reach a KBTP target ({describe(exc, timeout)}); check "
                           "the address and that the target runs") from None
    info = ini.target
    try:
        await asyncio.wait_for(ini.goodbye(release=True), timeout)
    except (TimeoutError, ConnectionLost):
        await ini.close()
    if state is not None:
        state.retired.append(ini.initiator_id)
    return info


def _unmet(case: Case, transport: str, info: TargetInfo, quick: bool) -> str | None:
    if case.transport and case.transport != transport:
        return f"applies to the {case.transport} binding only"
    missing = case.features & ~info.features
    if missing:
        names = "/".join(n for n, f in Feature.__members__.items() if f & missing)
        return f"the target did not offer {names}"
    if quick and case.slow:
        return f"slow ({case.slow}); left out by --quick"
    return None


async def run_case(case: Case, url: str, transport: str, info: TargetInfo, *, timeout: float,
                   local: str | None, pcap_dir: Path | None, quick: bool = False,
                   state: RunState | None = None) -> Outcome:
    started = time.monotonic()
    reason = _unmet(case, transport, info, quick)
    if reason:
        return Outcome(case, SKIP, detail=reason)
    frames = FrameBuffer()
    ctx = Ctx(url, transport, info, timeout=timeout, local=local, frames=frames, run=state)
    budget = case.budget or timeout * CASE_BUDGET
    try:
        await asyncio.wait_for(case.fn(ctx), budget)
        out = Outcome(case, PASS)
    except Fail as failed:
        out = Outcome(case, WARN if case.level == SHOULD else FAIL, failed.expected, failed.seen)
    except Skip as skipped:
        out = Outcome(case, SKIP, detail=str(skipped))
    except Broke as broke:
        out = Outcome(case, FAIL, broke.expected, broke.seen, broke=broke.rule,
                      detail=f"set-up step {broke.step} (the case's own requirement was not reached)")
    except SetupFailed as setup:
        out = Outcome(case, ERROR, setup.expected, setup.seen,
                      detail=f"set-up step failed ({setup.step}), so the requirement could not be "
                             "judged")
    except (ConnectionLost, RemoteError, ConnectionError) as exc:
        out = Outcome(case, FAIL, "the connection kept open", describe(exc, timeout))
    except KbtpError as exc:
        out = Outcome(case, FAIL, "the request completed OK", str(exc) or exc.name)
    except TimeoutError:
        out = Outcome(case, ERROR, detail=f"the case did not end within {budget:g} s; raise "
                                          "--timeout for a slow target")
    except Exception as exc:          # the harness could not judge: never a pass
        out = Outcome(case, ERROR, detail=f"the checker failed ({describe(exc, timeout)}); "
                                          "please report it with the case's pcap")
    try:
        await asyncio.wait_for(ctx.close(), timeout * 2)
    except TimeoutError:
        pass
    out.notes, out.duration = ctx.notes, time.monotonic() - started
    if out.verdict in (FAIL, WARN, ERROR) and pcap_dir is not None:
        out.pcap = write_pcap(pcap_dir, case.id, frames)
    return out


def write_pcap(directory: Path, case_id: str, frames: FrameBuffer) -> str:
    path = directory / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', case_id)}.pcap"
    frames.write(path)
    return str(path)


async def run(url: str, cases: list[Case], *, timeout: float = 10.0, local: str | None = None,
              pcap_dir: Path | None = None, quick: bool = False,
              listener: Listener | None = None,
              limits: Limits | None = None) -> tuple[TargetInfo, list[Outcome]]:
    """Probe the target, then run ``cases`` one after the other; ``limits`` bound what its
    HELLO_ACKs may make the checker spend (the initiator's defaults when None)."""
    try:
        transport = parse_url(url).transport
    except ValueError as exc:
        raise HarnessError(str(exc)) from None
    listener = listener or Listener()
    state = RunState(limits)
    info = await probe(url, local, timeout, state)
    listener.probed(info, len(cases))
    outcomes: list[Outcome] = []
    for i, case in enumerate(cases, 1):
        listener.started(i, len(cases), case)
        out = await run_case(case, url, transport, info, timeout=timeout, local=local,
                             pcap_dir=pcap_dir, quick=quick, state=state)
        why = await gone(url, local, timeout, state) if out.verdict in (FAIL, ERROR) else None
        if why:
            out = went_away(out, why)
        outcomes.append(out)
        listener.finished(i, len(cases), out)
        if why:
            outcomes += [Outcome(c, SKIP, detail=f"not run: the target went away at {case.id}",
                                 gone_at=case.id) for c in cases[i:]]
            listener.gone(case, len(cases) - i)
            break
    return info, outcomes


async def gone(url: str, local: str | None, timeout: float, state: RunState) -> str | None:
    """Why the target no longer answers a HELLO (asked twice), or None while it does."""
    why = await absent(url, {"local": local} if local else {}, timeout, opened=state.retired.append)
    return None if why is None else describe(why, timeout)


def went_away(out: Outcome, why: str) -> Outcome:
    """``out``'s case, FAILed by the target that went away while it ran."""
    seen = f"{out.seen}; then " if out.seen else ""
    return Outcome(out.case, FAIL, "a target that keeps answering",
                   f"{seen}the target went away / stopped answering: a HELLO on a new connection, "
                   f"tried twice, got {why}", notes=out.notes, pcap=out.pcap,
                   duration=out.duration, gone_at=out.case.id)
