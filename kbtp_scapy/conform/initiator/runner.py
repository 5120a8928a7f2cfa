"""Running initiator cases: each with its own checking target on the listen address and
its own runs of the program, judged as target cases are (``conform/runner.py``)."""
from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path

from ...harness import HarnessError
from ...wire.address import parse_url
from ..context import FrameBuffer, describe
from ..registry import ERROR, FAIL, PASS, SHOULD, SKIP, WARN, Case, Fail, Skip
from ..runner import Listener, Outcome, write_pcap
from .context import ICASES, ICtx, Unjudged

CASE_RUNS = 6        # a case may take this many --timeout periods in all, and what its
                     # runs took past --timeout each (a slow start: ICtx.patience)


def all_cases() -> list[Case]:
    from . import cases  # noqa: F401  (registers every case)
    return list(ICASES)


def default_local(url: str) -> str:
    """RoCEv2: the address the program should send from (the soft RNIC's default)."""
    address = parse_url(url)
    if address.transport != "roce":
        return ""
    from ...rnic.roce import default_local as local_for
    return local_for(address.host)


async def run_case(case: Case, program: list[str], url: str, transport: str, *, local: str,
                   timeout: float, pcap_dir: Path | None, quick: bool, workdir: Path,
                   io: dict | None = None) -> Outcome:
    started = time.monotonic()
    if case.transport and case.transport != transport:
        return Outcome(case, SKIP, detail=f"applies to the {case.transport} binding only")
    if quick and case.slow:
        return Outcome(case, SKIP, detail=f"slow ({case.slow}); left out by --quick")
    frames = FrameBuffer()
    ctx = ICtx(program, url, transport, local=local, timeout=timeout, frames=frames,
               workdir=workdir / case.id, io=io)
    budget = timeout * CASE_RUNS
    try:
        async with asyncio.timeout(budget) as ctx.budget:
            await case.fn(ctx)   # type: ignore[arg-type]
        out = Outcome(case, PASS)
    except Fail as failed:
        out = Outcome(case, WARN if case.level == SHOULD else FAIL, failed.expected, failed.seen)
    except Skip as skipped:
        out = Outcome(case, SKIP, detail=str(skipped))
    except Unjudged as exc:
        out = Outcome(case, ERROR, detail=str(exc))
    except TimeoutError:
        out = Outcome(case, ERROR, detail=f"the case did not end within {budget:g} s; raise --timeout")
    except OSError as exc:
        fix = "check --device and that the --listen address is the device's" if io else "pick another --listen"
        out = Outcome(case, ERROR, detail=f"the checking target cannot listen on {url} "
                                          f"({describe(exc, timeout)}); {fix}")
    except Exception as exc:          # the checker could not judge: never a pass
        out = Outcome(case, ERROR, detail=f"the checker failed ({describe(exc, timeout)}); "
                                          "please report it with the case's pcap")
    try:
        await asyncio.wait_for(ctx.close(), timeout)
    except TimeoutError:
        pass
    out.notes, out.duration = ctx.notes, time.monotonic() - started
    if out.verdict in (FAIL, WARN, ERROR) and pcap_dir is not None:
        out.pcap = write_pcap(pcap_dir, case.id, frames)
    return out


async def run(url: str, program: list[str], cases: list[Case], *, timeout: float = 10.0,
              local: str | None = None, pcap_dir: Path | None = None, quick: bool = False,
              listener: Listener | None = None, keep: Path | None = None,
              io: dict | None = None) -> list[Outcome]:
    """Run ``cases`` one after the other against ``program``; ``keep`` keeps each run's
    directories (inputs, outputs, stderr) there instead of a temporary directory; ``io``
    puts the checking target on an RDMA device ({"io": "verbs", "device": ...})."""
    try:
        transport = parse_url(url).transport
    except ValueError as exc:
        raise HarnessError(str(exc)) from None
    if not program:
        raise HarnessError("no initiator command: give it after '--'")
    listener = listener or Listener()
    if transport != "roce":
        local = ""             # only RoCEv2 puts both ends on one UDP port: iWARP needs none
    elif local is None:
        local = default_local(url)
    workdir = keep or Path(tempfile.mkdtemp(prefix="kbtp-iconform-"))
    outcomes = []
    try:
        for i, case in enumerate(cases, 1):
            listener.started(i, len(cases), case)
            out = await run_case(case, program, url, transport, local=local, timeout=timeout,
                                 pcap_dir=pcap_dir, quick=quick, workdir=workdir, io=io)
            outcomes.append(out)
            listener.finished(i, len(cases), out)
    finally:
        if keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return outcomes
