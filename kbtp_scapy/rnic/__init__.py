"""A software RDMA NIC: registered memory, queue pairs, and the iWARP and RoCEv2 bindings.

``connect`` and ``listen`` take URLs, so KBTP code never names a binding:
``iwarp://HOST:PORT`` (kernel TCP, MPA revision 2, DDP, RDMAP) and
``roce://HOST[:PORT]`` (UDP, default port 4791, InfiniBand reliable connection, CM MADs).
"""
from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from ..wire.address import Address, parse_url
from .memory import Access, AccessError, ByteOrder, Fault, MemoryRegion, MemoryTable
from .qp import ConnectionLost, QueuePair, Received, ReceiveError, RemoteError

__all__ = ["Access", "AccessError", "Address", "ConnectionLost", "Fault", "Listener",
           "MemoryRegion", "MemoryTable", "QueuePair", "Received", "ReceiveError",
           "RemoteError", "connect", "listen", "memory_table", "parse_url"]


class Listener(Protocol):
    address: Address

    def close(self) -> None: ...

    async def wait_closed(self) -> None: ...


OnConnect = Callable[[QueuePair], Coroutine[Any, Any, None]]


def memory_table(io: str | None = None, order: ByteOrder = "little") -> MemoryTable:
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
