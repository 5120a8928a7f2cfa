"""Ctrl-C that ends a run early and keeps what it measured: the first one asks the run to
stop (it finishes what is in hand and returns its results, marked partial), a second one
aborts as Ctrl-C always does."""
from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def run_stoppable(coro_factory: Callable[[], Awaitable[T]], interrupt: Callable[[], None]) -> T:
    """``asyncio.run`` the coroutine, calling ``interrupt`` on the first Ctrl-C."""
    async def main() -> T:
        loop = asyncio.get_running_loop()

        def interrupted() -> None:
            interrupt()
            loop.remove_signal_handler(signal.SIGINT)      # a second Ctrl-C: KeyboardInterrupt
        try:
            loop.add_signal_handler(signal.SIGINT, interrupted)
        except (NotImplementedError, RuntimeError, ValueError):   # not the main thread
            pass
        return await coro_factory()
    return asyncio.run(main())
