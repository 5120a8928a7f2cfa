"""The checker's own pace, set against the times the target advertised.

A ticket not bound within the Ticket Timeout of HELLO_ACK is abandoned. When a case that
takes tickets sees one treated as abandoned (BIND refused, the Partition STag gone, usage
given back), it must know whose slowness that was. The checker's clock decides: from
just before its FetchAdd went out to the answer that judged the target. Under the
Ticket Timeout, no correct target can have abandoned the ticket, since its clock starts
when the FetchAdd arrives or later (when it notices Head moved): the failure is the
target's. Past it, a busy checker host may have let the ticket expire: the case is a
SKIP saying so, never a FAIL. A case that needs many tickets at once takes as many as
its measured round trip lets it take well inside the Ticket Timeout (``fitting``).
"""
from __future__ import annotations

import asyncio
import statistics
from types import TracebackType

from ..initiator import Initiator
from ..tables.memory import SLOT_SIZE
from .registry import Fail, Skip

#: Share of the Ticket Timeout within which the checker judges: a tenth is left for the
#: two hosts' clock rates and the target's timer grain.
SURE = 0.9
#: Share of the Ticket Timeout the tickets of a case may take at the measured pace; the
#: rest is for the requests that judge them and a pace that varies on a busy host.
BUDGET = 0.25
#: Round trips measured for the pace; the middle one counts (the first ones on a new
#: connection may wait behind the target's own set-up of it).
SAMPLES = 5


class NoAnswer(Fail):
    """No answer at all within the checker's wait: never excused by the checker's pace."""


def ticket_timeout(ini: Initiator) -> float:
    return ini.target.ticket_timeout_ms / 1000


class TicketWindow:
    """``with TicketWindow(ini, what):`` around taking tickets and judging what the target
    did with them: a failure seen after the tickets could have expired is a SKIP."""

    def __init__(self, ini: Initiator, what: str) -> None:
        self.ini, self.what = ini, what
        self.started = 0.0

    def elapsed(self) -> float:
        return asyncio.get_running_loop().time() - self.started

    def __enter__(self) -> TicketWindow:
        self.started = asyncio.get_running_loop().time()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if isinstance(exc, Fail) and not isinstance(exc, NoAnswer):
            took, limit = self.elapsed(), SURE * ticket_timeout(self.ini)
            if took >= limit:
                raise Skip(f"{self.what} took the checker {took:.2f} s, past {limit:.2f} s of the "
                           f"Ticket Timeout ({self.ini.target.ticket_timeout_ms} ms): a ticket may "
                           f"have expired through the checker's own slowness (it saw: {exc})") from None


async def round_trip(ini: Initiator) -> float:
    """Seconds of the median of ``SAMPLES`` one-sided round trips to the target (an RDMA
    Read of the session's first ring slot): the pace a FetchAdd goes at."""
    f = ini.target.fields
    loop = asyncio.get_running_loop()
    took = []
    for _ in range(SAMPLES):
        start = loop.time()
        await ini.qp.read(f["ring.stag"], f["ring.offset"], SLOT_SIZE)
        took.append(loop.time() - start)
    return statistics.median(took)


def fitting(ini: Initiator, pace: float) -> int:
    """Tickets the checker can take one after another within ``BUDGET`` of the Ticket
    Timeout at ``pace`` seconds a round trip."""
    return int(BUDGET * ticket_timeout(ini) / max(pace, 1e-6))
