"""Socket I/O backends of the RoCEv2 ``Device``: how its datagrams reach the wire.

A backend moves RoCEv2 datagrams (BTH to ICRC) between a ``Device`` and the network:

- ``UdpIO`` (the default): a kernel UDP socket; the host's IP stack owns the address and
  writes the IP and UDP headers, so both ends compute the ICRC over the header Linux
  writes (``wire.roce.Path``);
- ``RawIO`` (``roce_raw.py``): whole Ethernet frames on an AF_PACKET socket; the endpoint
  owns its IP and MAC addresses and writes every header itself.

The ``Device`` reads with ``receive`` (datagram, source (IP, port), and the whole frame
where the backend has it), checks ICRCs with ``check`` and sends with ``send``.
"""
from __future__ import annotations

import errno
import logging
import socket
import struct
from collections.abc import Iterator
from typing import Protocol

from ..wire import roce as w
from .roce_qp import MTUS

log = logging.getLogger(__name__)

Received = tuple[memoryview, tuple[str, int], "memoryview | None"]

_SOCK_BUF = 4 << 20
_SO_NO_CHECK = 11                                     # Linux: IPv4 UDP checksum 0
_IP_MTU_DISCOVER, _IP_PMTUDISC_DO = 10, 2             # Linux: always set DF
_IP_MTU, _IPV6_MTU = 14, 24                           # Linux: the route's MTU
_UDP_NO_CHECK6_TX, _UDP_NO_CHECK6_RX = 101, 102       # Linux: IPv6 zero checksum (RFC 6935)
_IP_RECVERR = 11                                      # Linux: queue ICMP errors (ip(7))
_EE_ERRNO = struct.Struct("=I")                       # sock_extended_err's first field
_ERRORS = 64                                          # queued ICMP errors read per poll


class RoceIO(Protocol):
    """What a ``Device`` needs of its I/O backend."""

    address: tuple[str, int]          # the local (IP, UDP port)
    gid: str                          # the port's GID (annex A17.4.1), as an IPv6 address

    def fileno(self) -> int: ...

    def receive(self, limit: int) -> Iterator[Received]: ...

    def check(self, path: w.Path, data: memoryview, wire: memoryview | None) -> bool: ...

    def tx_path(self, addr: tuple[str, int]) -> w.Path: ...

    def send(self, parts: list, addr: tuple[str, int], path: w.Path) -> None: ...

    async def start(self) -> None: ...

    async def resolve(self, host: str, timeout: float) -> None: ...

    def path_mtu(self, host: str, port: int) -> int: ...

    def report_refusals(self) -> None: ...

    def refused(self) -> list[tuple[str, int]]: ...

    def close(self) -> None: ...


def ib_mtu(link: int, v6: bool) -> int:
    """The largest InfiniBand MTU whose packets fit a link MTU of ``link`` octets, as rxe
    derives it from its netdev. Headers counted: IP, UDP, BTH, the largest extension
    header of a data packet (RETH with ImmDt, 20 octets) and the ICRC."""
    room = link - (40 if v6 else 20) - 8 - 12 - 20 - 4
    return max((m for m in MTUS if m <= room), default=MTUS[0])


def gid_of(host: str) -> str:
    """RoCEv2 GID of an IP address (annex A17.4.1): IPv4-mapped for IPv4, else itself."""
    return f"::ffff:{host}" if ":" not in host else host


def path_mtu(local: str, host: str, port: int) -> int:
    """``ib_mtu`` of the route's link MTU: 1024 on a 1500-octet Ethernet, 4096 on
    loopback or jumbo frames."""
    v6 = ":" in host
    with socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind((local, 0))
            s.connect((host, port))               # sends nothing: it only picks the route
            link = s.getsockopt(socket.IPPROTO_IPV6 if v6 else socket.IPPROTO_IP,
                                _IPV6_MTU if v6 else _IP_MTU)
        except OSError:
            return 1024
    return ib_mtu(link, v6)


class UdpIO:
    """One kernel UDP socket at (host, port); datagrams only, the kernel frames them."""

    def __init__(self, host: str, port: int, stats: dict[str, int]) -> None:
        v6 = ":" in host
        sock = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_DGRAM)
        try:
            if v6:
                sock.setsockopt(socket.IPPROTO_UDP, _UDP_NO_CHECK6_TX, 1)
                sock.setsockopt(socket.IPPROTO_UDP, _UDP_NO_CHECK6_RX, 1)
            else:   # DF set, so the ICRC's pseudo header (Identification 0) is what is sent
                sock.setsockopt(socket.IPPROTO_IP, _IP_MTU_DISCOVER, _IP_PMTUDISC_DO)
                sock.setsockopt(socket.SOL_SOCKET, _SO_NO_CHECK, 1)
            for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
                sock.setsockopt(socket.SOL_SOCKET, opt, _SOCK_BUF)
            sock.bind((host, port))
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.address: tuple[str, int] = sock.getsockname()[:2]
        self.gid = gid_of(self.address[0])
        self.stats = stats
        self._buf = bytearray(65536)
        self._view = memoryview(self._buf)
        self._recverr = False           # report_refusals was called
        self._errors = False            # the last receive saw an error, or nothing

    def __str__(self) -> str:
        return "a UDP socket"

    def fileno(self) -> int:
        return self.sock.fileno()

    def receive(self, limit: int) -> Iterator[Received]:
        """Up to ``limit`` queued datagrams; each view is valid until the next one."""
        sock, buf, view = self.sock, self._buf, self._view
        for i in range(limit):
            try:
                n, addr = sock.recvfrom_into(buf)
            except (BlockingIOError, InterruptedError):
                self._errors |= i == 0          # woken with nothing to read: an error queued?
                return
            except OSError as exc:
                self._errors = True
                log.debug("recvfrom: %s", exc)
                return
            yield view[:n], addr[:2], None

    @staticmethod
    def check(path: w.Path, data: memoryview, wire: memoryview | None) -> bool:
        return path.check(data)

    def tx_path(self, addr: tuple[str, int]) -> w.Path:
        return w.Path(self.address, addr)

    def send(self, parts: list, addr: tuple[str, int], path: w.Path) -> None:
        for _ in range(2):
            try:
                self.sock.sendmsg(parts, (), 0, addr)
            except (BlockingIOError, InterruptedError):
                self.stats["tx_dropped"] = self.stats.get("tx_dropped", 0) + 1
            except ConnectionRefusedError:
                self._errors = True     # an ICMP error about an earlier datagram, said here:
                continue                # this one was not sent, and the error is now taken
            except OSError as exc:
                log.debug("sendmsg to %s: %s", addr, exc)
            return

    async def start(self) -> None:
        """Nothing to do: the kernel owns the address."""

    async def resolve(self, host: str, timeout: float) -> None:
        """Nothing to do: the kernel resolves neighbours."""

    def path_mtu(self, host: str, port: int) -> int:
        return path_mtu(self.address[0], host, port)

    def report_refusals(self) -> None:
        """Have the kernel queue the ICMP errors datagrams draw (IP_RECVERR), so that a
        connect to an address where nothing owns UDP 4791 fails at once, as TCP's does,
        not after its timeout. For a connecting device only: a target's would be told of
        every initiator that went away, which nothing there waits for. IPv4 only: these
        IPv6 datagrams carry a zero UDP checksum (RFC 6935), which a port nobody owns drops
        as a checksum error, drawing no ICMP, so an IPv6 connect waits for its timeout."""
        if ":" not in self.address[0]:
            try:
                self.sock.setsockopt(socket.IPPROTO_IP, _IP_RECVERR, 1)
            except OSError:     # a stack without it (a sandbox's): connects wait their timeout
                return
            self._recverr = True

    def refused(self) -> list[tuple[str, int]]:
        """The destinations (IP, UDP port) that queued ICMP errors say refused a datagram
        (port unreachable), the queue read out: a queued error keeps the socket ready (EPOLLERR)
        and takes receive-buffer room. Read only after a receive that saw an error or
        nothing, so the data path costs no system call more."""
        if not (self._recverr and self._errors):
            return []
        self._errors = False
        found = []
        for _ in range(_ERRORS):
            try:
                _, ancillary, _, addr = self.sock.recvmsg(0, 512, socket.MSG_ERRQUEUE)
            except OSError:                     # EAGAIN: the queue is empty
                break
            for _, _, data in ancillary:
                if len(data) >= 4 and _EE_ERRNO.unpack_from(data)[0] == errno.ECONNREFUSED:
                    found.append((addr[0], addr[1]))
        else:
            self._errors = True                 # more queued: read on at the next poll
        return found

    def close(self) -> None:
        self.sock.close()
