"""A real target on loopback for tests: runs in its own thread and event loop.

Tests talk to it over real sockets with the real initiator, and inspect its registered
memory afterwards (``call`` runs a coroutine in the target's loop). Every test gets its
own loopback addresses, so RoCEv2's fixed UDP port never collides between tests.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from kbtp_scapy.target import Target, TargetConfig
from kbtp_scapy.wire.address import Address

#: each pytest-xdist worker (gw0, gw1, ...) counts in a range of its own: 15,000 addresses,
#: the first four workers' in 127.44/16, each further worker's in 127.(200 + worker)/16
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
_NET = 44 if _WORKER < 4 else 200 + _WORKER
_hosts = itertools.count(1 + 15000 * (_WORKER if _WORKER < 4 else 0))


def fresh_hosts(count: int = 2) -> list[str]:
    """Unused loopback addresses, 127.44.x.y (each test its own, on every worker)."""
    out = []
    for _ in range(count):
        n = next(_hosts)
        out.append(f"127.{_NET}.{n // 250}.{n % 250 + 1}")
    return out


@contextlib.contextmanager
def deaf_roce(host: str) -> Iterator[str]:
    """``host``'s UDP 4791 owned by a socket that reads nothing: a RoCEv2 target that never
    answers. Where nothing owns the port, the kernel's ICMP port unreachable ends a connect
    at once instead."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as deaf:
        deaf.bind((host, 4791))
        yield f"roce://{host}"


class TargetThread:
    def __init__(self, transport: str, config: TargetConfig | None = None, *,
                 hosts: list[str] | None = None, port: int | None = None,
                 frame_listeners: list | None = None, **options: Any) -> None:
        self.transport = transport
        self.host, *self.initiator_hosts = hosts or fresh_hosts(6)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.target: Target = self.call(self._make(config or TargetConfig()))
        self.target.frame_listeners.extend(frame_listeners or ())
        if port is None:
            port = 0 if transport == "iwarp" else 4791
        self.address: Address = self.call(self.target.start(f"{transport}://{self.host}:{port}", **options))
        self.url = str(self.address)

    async def _make(self, config: TargetConfig) -> Target:
        return Target(config, self.transport)

    def call(self, coro: Awaitable, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def _close_devices(self) -> None:
        """The RoCEv2 devices of this loop: a connection that just ended holds its device
        for a moment (DREQ and its retries), and the loop stops before that ends."""
        from kbtp_scapy.rnic import roce
        for dev in list(roce._devices.values()):
            if dev.loop is self.loop:
                dev.close()

    def run(self, func: Callable[[], Any]) -> Any:
        """Run a plain function in the target's loop thread (its state is not thread-safe)."""
        async def wrapper():
            return func()
        return self.call(wrapper())

    def connect_options(self, index: int = 0) -> dict[str, Any]:
        """Options for ``Initiator.connect``: on RoCEv2 each initiator its own address."""
        return {"local": self.initiator_hosts[index]} if self.transport == "roce" else {}

    def stop(self) -> None:
        self.call(self.target.close())
        self.run(self._close_devices)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()
