"""Running cases against a target: a probe HELLO, then each case with its own sessions.

A case's verdict comes from what it raised: nothing is PASS, ``Fail`` is FAIL (WARN for a
SHOULD), ``Skip`` is SKIP, anything else is ERROR (the harness could not judge). A lost
connection or a request failing where the case did not expect it is the target's doing
(FAIL). The frames of each case are kept in memory and written to a pcap only when the
case did not pass.
"""
from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..initiator import Initiator, KbtpError
from ..initiator.client import ALL_FEATURES
from ..initiator.results import TargetInfo
from ..rnic import parse_url
from ..rnic.pcap import PcapSink
from ..rnic.qp import ConnectionLost, RemoteError
from ..tables.enums import FEATURES
from .context import Ctx, FrameBuffer
from .registry import ERROR, FAIL, PASS, SHOULD, SKIP, WARN, Case, Fail, Skip

CASE_BUDGET = 8      # a whole case may take this many --timeout periods


class HarnessError(Exception):
    """The run could not start or go on: no verdict can be given."""


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


Progress = Callable[[int, int, Outcome], None]


async def probe(url: str, local: str | None, timeout: float) -> TargetInfo:
    """HELLO with every feature requested: what the target offers, for SKIP decisions."""
    options = {"local": local} if local else {}
    try:
        ini = await asyncio.wait_for(Initiator.connect(url, features=ALL_FEATURES, **options), timeout)
    except KbtpError as exc:
        raise HarnessError(f"{url}: the target refused the probe HELLO ({exc.name})") from None
    except (OSError, ConnectionLost, RemoteError, asyncio.TimeoutError) as exc:
        raise HarnessError(f"{url}: cannot reach a KBTP target ({type(exc).__name__}: {exc})") from None
    info = ini.target
    try:
        await asyncio.wait_for(ini.goodbye(release=True), timeout)
    except (ConnectionLost, asyncio.TimeoutError):
        await ini.close()
    return info


def _unmet(case: Case, transport: str, info: TargetInfo) -> str | None:
    if case.transport and case.transport != transport:
        return f"applies to the {case.transport} binding only"
    missing = case.features & ~info.features
    if missing:
        names = "/".join(f.name for f in FEATURES.flags if f.value & missing)
        return f"the target did not offer {names}"
    return None


async def run_case(case: Case, url: str, transport: str, info: TargetInfo, *, timeout: float,
                   local: str | None, pcap_dir: Path | None) -> Outcome:
    started = time.monotonic()
    reason = _unmet(case, transport, info)
    if reason:
        return Outcome(case, SKIP, detail=reason)
    frames = FrameBuffer()
    ctx = Ctx(url, transport, info, timeout=timeout, local=local, frames=frames)
    try:
        await asyncio.wait_for(case.fn(ctx), timeout * CASE_BUDGET)
        out = Outcome(case, PASS)
    except Fail as failed:
        out = Outcome(case, WARN if case.level == SHOULD else FAIL, failed.expected, failed.seen)
    except Skip as skipped:
        out = Outcome(case, SKIP, detail=str(skipped))
    except (ConnectionLost, RemoteError) as exc:
        out = Outcome(case, FAIL, "the connection kept open", f"{type(exc).__name__}: {exc}")
    except KbtpError as exc:
        out = Outcome(case, FAIL, "the request completed OK", str(exc))
    except asyncio.TimeoutError:
        out = Outcome(case, ERROR, detail=f"the case did not end within {timeout * CASE_BUDGET:g} s")
    except Exception as exc:          # the harness could not judge: never a pass
        out = Outcome(case, ERROR, detail=f"{type(exc).__name__}: {exc}")
    try:
        await asyncio.wait_for(ctx.close(), timeout * 2)
    except asyncio.TimeoutError:
        pass
    out.notes, out.duration = ctx.notes, time.monotonic() - started
    if out.verdict in (FAIL, WARN, ERROR) and pcap_dir is not None:
        out.pcap = write_pcap(pcap_dir, case.id, frames)
    return out


def write_pcap(directory: Path, case_id: str, frames: FrameBuffer) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', case_id)}.pcap"
    sink = PcapSink(path)
    for _, frame in frames.frames:
        sink("", frame)
    sink.close()
    return str(path)


async def run(url: str, cases: list[Case], *, timeout: float = 10.0, local: str | None = None,
              pcap_dir: Path | None = None, progress: Progress | None = None) -> tuple[TargetInfo, list[Outcome]]:
    """Probe the target, then run ``cases`` one after the other."""
    try:
        transport = parse_url(url).transport
    except ValueError as exc:
        raise HarnessError(str(exc)) from None
    info = await probe(url, local, timeout)
    outcomes = []
    for i, case in enumerate(cases, 1):
        out = await run_case(case, url, transport, info, timeout=timeout, local=local, pcap_dir=pcap_dir)
        outcomes.append(out)
        if progress:
            progress(i, len(cases), out)
    return info, outcomes
