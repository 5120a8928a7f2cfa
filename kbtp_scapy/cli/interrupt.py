"""Ctrl-C that ends a run early and keeps what it measured: the first one asks the run to
stop (it finishes what is in hand and returns its results, marked partial), a second one
aborts as Ctrl-C always does. SIGTERM (a CI job's timeout, ``timeout 300 kbtp ...``) counts
as a Ctrl-C, so a run killed so still writes its reports; the exit status tells them apart
(``status``: 130 for Ctrl-C, 143 for SIGTERM)."""
from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import TypeVar

T = TypeVar("T")

#: the signals that stopped this run, the first one first
_received: list[signal.Signals] = []


def status() -> int:
    """The exit status of a run stopped early: 128 + the first signal's number (130 if none
    was seen here: Ctrl-C raised KeyboardInterrupt on its own)."""
    return 128 + (_received[0] if _received else signal.SIGINT)


def how() -> str:
    """What stopped the run, in the words of its messages."""
    return "SIGTERM" if _received and _received[0] == signal.SIGTERM else "Ctrl-C"


def terminate_as_interrupt() -> None:
    """From now on SIGTERM does what Ctrl-C does, for the tools that keep their partial
    results on ``except KeyboardInterrupt``: it calls SIGINT's handler of the moment, so
    under ``asyncio.run`` the main task is cancelled first (its tasks end cleanly), then
    KeyboardInterrupt is raised."""
    def raised(signum: int, frame: FrameType | None) -> None:
        if _received:   # stopping already: timeout(1) sends SIGTERM to the command and then
            return      # to its process group, one stop twice, not a second Ctrl-C
        _received.append(signal.Signals(signum))
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler):
            handler(signal.SIGINT, frame)
        else:                               # SIGINT ignored (a background job): stop all the same
            raise KeyboardInterrupt
    try:
        signal.signal(signal.SIGTERM, raised)
    except ValueError:                      # not the main thread
        pass


def run_stoppable(coro_factory: Callable[[], Awaitable[T]], interrupt: Callable[[], None]) -> T:
    """``asyncio.run`` the coroutine, calling ``interrupt`` on the first Ctrl-C or SIGTERM."""
    async def main() -> T:
        loop = asyncio.get_running_loop()

        def interrupted(sig: signal.Signals) -> None:
            _received.append(sig)
            interrupt()
            loop.remove_signal_handler(signal.SIGINT)      # a second Ctrl-C: KeyboardInterrupt
            loop.remove_signal_handler(signal.SIGTERM)     # a second SIGTERM is the same stop
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # sent twice (timeout(1) does so)
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, interrupted, sig)
        except (NotImplementedError, RuntimeError, ValueError):   # not the main thread
            pass
        return await coro_factory()
    return asyncio.run(main())
