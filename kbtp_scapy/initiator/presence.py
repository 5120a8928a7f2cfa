"""Whether a target is still there: how the checkers tell a target that went away mid-run
from one that only misbehaved."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ..rnic.qp import ConnectionLost, RemoteError
from .client import Initiator
from .results import KbtpError


async def absent(url: str, options: dict[str, Any], timeout: float, *, pause: float = 1.0,
                 opened: Callable[[bytes], None] | None = None) -> BaseException | None:
    """What kept a HELLO on a new connection from being answered, asked twice ``pause``
    seconds apart before the target is called gone (a moment's slowness is no absence);
    None while it answers, whatever its HELLO_ACK says. ``opened`` hears the Initiator ID
    of a session the question opened (ended at once with GOODBYE RELEASE)."""
    why: BaseException | None = None
    for attempt in range(2):
        if attempt:
            await asyncio.sleep(pause)
        try:
            ini = await asyncio.wait_for(Initiator.connect(url, features=0, **options), timeout)
        except KbtpError:
            return None
        except (TimeoutError, ConnectionLost, RemoteError, OSError) as exc:
            why = exc
            continue
        try:
            await asyncio.wait_for(ini.goodbye(release=True), timeout)
        except (TimeoutError, ConnectionLost, RemoteError, OSError):
            await ini.close()
        if opened is not None:
            opened(ini.initiator_id)
        return None
    return why
