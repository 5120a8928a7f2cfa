"""A software RDMA NIC: registered memory, queue pairs, and the iWARP and RoCEv2 bindings.

``connect`` and ``listen`` take URLs, so KBTP code never names a binding:
``iwarp://HOST:PORT`` (kernel TCP, MPA revision 2, DDP, RDMAP) and
``roce://HOST[:PORT]`` (UDP, default port 4791, InfiniBand reliable connection, CM MADs).
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol
from urllib.parse import urlsplit

from .memory import Access, AccessError, Fault, MemoryRegion, MemoryTable
from .qp import ConnectionLost, QueuePair, Received, ReceiveError, RemoteError

IWARP_PORT = 5420     # NOTES decision 9: KBTP has no port; the tools' default for iWARP
ROCE_PORT = 4791      # IANA's RoCEv2 port

__all__ = ["Access", "AccessError", "Address", "ConnectionLost", "Fault", "Listener",
           "MemoryRegion", "MemoryTable", "QueuePair", "Received", "ReceiveError",
           "RemoteError", "connect", "listen", "memory_table", "parse_url"]


@dataclass(frozen=True)
class Address:
    transport: str     # "iwarp" or "roce"
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.transport}://{host}:{self.port}"


def parse_url(url: str, default_host: str = "127.0.0.1") -> Address:
    """``iwarp://127.0.0.1:5420``, ``roce://[::1]``, ``roce://127.0.0.2``; ValueError if bad."""
    parts = urlsplit(url if "://" in url else f"//{url}")
    transport = parts.scheme or ""
    if transport not in ("iwarp", "roce"):
        raise ValueError(f"{url!r}: the scheme must be iwarp:// or roce://")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{url!r}: {exc}") from None
    host = parts.hostname or default_host
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{url!r}: {host!r} is not an IP address") from None
    if port is None:
        port = IWARP_PORT if transport == "iwarp" else ROCE_PORT
    return Address(transport, host, port)


class Listener(Protocol):
    address: Address

    def close(self) -> None: ...

    async def wait_closed(self) -> None: ...


OnConnect = Callable[[QueuePair], Awaitable[None]]


def memory_table(io: str | None = None, order: str = "little") -> MemoryTable:
    """The registered memory for an I/O backend: the soft RNIC's, or a device's (``verbs``)."""
    if io == "verbs":
        from .verbs import VerbsMemory
        return VerbsMemory(order)
    return MemoryTable(order)


async def connect(url: str | Address, memory: MemoryTable, **options) -> QueuePair:
    """Open a reliable connection to a listening peer; ``options`` go to the binding
    (``io="verbs"``: an RDMA device through rdma-core, ``device=`` to name it)."""
    address = url if isinstance(url, Address) else parse_url(url)
    if options.get("io") == "verbs":
        from . import verbs
        return await verbs.connect(address.transport, address.host, address.port, memory,
                                   **options)
    if address.transport == "iwarp":
        from . import iwarp
        return await iwarp.connect(address.host, address.port, memory, **options)
    from . import roce
    return await roce.connect(address.host, address.port, memory, **options)


async def listen(url: str | Address, memory: MemoryTable, on_connect: OnConnect,
                 **options) -> Listener:
    """Accept connections; ``on_connect`` runs as a task for each new QueuePair."""
    address = url if isinstance(url, Address) else parse_url(url)
    if options.get("io") == "verbs":
        from . import verbs
        return verbs.VerbsListener(address.transport, address.host, address.port, memory,
                                   on_connect, options)
    if address.transport == "iwarp":
        from . import iwarp
        return await iwarp.listen(address.host, address.port, memory, on_connect, **options)
    from . import roce
    return await roce.listen(address.host, address.port, memory, on_connect, **options)
