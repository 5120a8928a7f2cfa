"""What can go wrong in talking to a target, named: below the fuzzer's state and its
oracles, which both need it, so that neither imports the other for it."""
from __future__ import annotations

import asyncio

from ..initiator import KbtpError
from ..rnic.qp import ConnectionLost, RemoteError, foreign

TRANSPORT_ERRORS = (OSError, ConnectionLost, RemoteError, asyncio.TimeoutError)


def describe(exc: BaseException, timeout: float | None = None) -> str:
    """What went wrong, never empty: a bare timeout says how long was waited."""
    if isinstance(exc, asyncio.TimeoutError) and not str(exc):
        return f"no answer within {timeout:g} s" if timeout else "no answer in time"
    if isinstance(exc, KbtpError):
        return f"refused with {exc.name}"
    text = str(exc)
    if foreign(exc):
        return text                         # it says what the peer is not
    if isinstance(exc, ConnectionLost):
        return f"the connection ended ({text})" if text else "the connection ended"
    return text or type(exc).__name__
