"""A lossy, reordering UDP relay for tests of the RoCEv2 binding (and of KBTP over it).

Clients send to the relay's address as if it were the target; each client gets its own
back socket towards the target on an address of its own next to the relay's (the relay's
last octet plus one, two, ...), on the same UDP port: RoCEv2 answers the peer's address at
port 4791 whatever port it sent from, so the target tells the clients apart by address.
Every datagram may be dropped (``loss``), held back by ``delay`` seconds so that later ones
overtake it (``reorder``), or dropped by a ``drop`` predicate that tests use to lose one
chosen packet, or rewritten by ``corrupt``. A seed makes a run repeatable, as far as the
event loop's timing allows.

The RoCEv2 ICRC covers the IP addresses and UDP ports, which the relay changes, so it
rewrites the ICRC of every datagram it forwards, as a RoCE-aware NAT would have to.
"""
from __future__ import annotations

import asyncio
import ipaddress
import random
import socket
from collections.abc import Callable

from kbtp_scapy.wire import roce as roce_wire

_IP_MTU_DISCOVER, _IP_PMTUDISC_DO = 10, 2             # Linux: always set DF

Drop = Callable[[str, bytes], bool]
"""``drop(direction, datagram)``: direction is "up" (client to target) or "down"."""
Corrupt = Callable[[str, bytes], bytes]
"""``corrupt(direction, datagram)``: the datagram to forward in its place."""


class Relay:
    """Forward UDP between clients at ``listen`` and the ``target``, losing some."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], *, loss: float = 0.0,
                 reorder: float = 0.0, delay: float = 0.003, seed: int = 0,
                 drop: Drop | None = None, corrupt: Corrupt | None = None) -> None:
        self.listen, self.target = listen, target
        self.loss, self.reorder, self.delay, self.drop = loss, reorder, delay, drop
        self.corrupt = corrupt
        self.rng = random.Random(seed)
        self.stats = {"forwarded": 0, "lost": 0, "dropped": 0, "delayed": 0}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._front: socket.socket | None = None
        self._backs: dict[tuple, socket.socket] = {}

    @property
    def address(self) -> tuple[str, int]:
        return self.listen

    def _socket(self, host: str, port: int,
                on_readable: Callable[[socket.socket], None]) -> socket.socket:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                             socket.SOCK_DGRAM)
        if ":" not in host:   # DF, hence IP ID 0: the header its ICRCs assume
            sock.setsockopt(socket.IPPROTO_IP, _IP_MTU_DISCOVER, _IP_PMTUDISC_DO)
        sock.bind((host, port))
        sock.setblocking(False)
        self._loop.add_reader(sock.fileno(), on_readable, sock)
        return sock

    def start(self) -> Relay:
        """Bind and start forwarding (call from inside the event loop)."""
        self._loop = asyncio.get_running_loop()
        self._front = self._socket(*self.listen, self._from_clients)
        self.listen = self._front.getsockname()[:2]
        return self

    def _from_clients(self, sock: socket.socket) -> None:
        for data, addr in _drain(sock):
            client = addr[:2]
            back = self._backs.get(client)
            if back is None:
                host = str(ipaddress.ip_address(self.listen[0]) + 1 + len(self._backs))
                back = self._backs[client] = self._socket(
                    host, self.listen[1], lambda s, c=client: self._from_target(s, c))
            self._forward("up", data, back, self.target)

    def _from_target(self, sock: socket.socket, client: tuple) -> None:
        for data, _ in _drain(sock):
            self._forward("down", data, self._front, client)

    def _forward(self, direction: str, data: bytes, out: socket.socket, to: tuple) -> None:
        if self.drop is not None and self.drop(direction, data):
            self.stats["dropped"] += 1
            return
        if self.rng.random() < self.loss:
            self.stats["lost"] += 1
            return
        if len(data) >= 16:
            path = roce_wire.Path(out.getsockname()[:2], to[:2])
            data = data[:-4] + roce_wire.ICRC.pack(path.icrc((data[:-4],), len(data)))
        if self.corrupt is not None:
            data = self.corrupt(direction, data)
        self.stats["forwarded"] += 1
        if self.rng.random() < self.reorder:
            self.stats["delayed"] += 1
            self._loop.call_later(self.delay * (0.5 + self.rng.random()), _send, out, data, to)
        else:
            _send(out, data, to)

    def close(self) -> None:
        for sock in [self._front, *self._backs.values()]:
            if sock is not None and sock.fileno() >= 0:
                self._loop.remove_reader(sock.fileno())
                sock.close()
        self._backs.clear()


def _drain(sock: socket.socket, limit: int = 256):
    """What is queued on a non-blocking socket, up to ``limit`` datagrams."""
    for _ in range(limit):
        try:
            yield sock.recvfrom(65536)
        except (BlockingIOError, InterruptedError):
            return


def _send(sock: socket.socket, data: bytes, to: tuple) -> None:
    if sock.fileno() >= 0:
        try:
            sock.sendto(data, to)
        except OSError:
            pass        # a relay loses datagrams anyway
