"""Where a KBTP peer is: the URL form every tool takes, and the binding's well-known ports.

Defined once here, below everything that opens or names a connection, so that the RNIC,
the capture decoder, the capture builders and the command line agree on them.
"""
from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field
from urllib.parse import urlsplit

IWARP_PORT = 5420     # NOTES decision 9: KBTP has no port; the tools' default for iWARP
ROCE_PORT = 4791      # IANA's RoCEv2 port

@dataclass(frozen=True)
class Address:
    transport: str     # "iwarp" or "roce"
    host: str          # an IP address, always
    port: int
    name: str | None = field(default=None, compare=False)   # the host name it was resolved from

    @property
    def resolved(self) -> str | None:
        """``localhost is 127.0.0.1`` when a host name was given, for the tools to say."""
        return f"{self.name} is {self.host}" if self.name else None

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
        if parts.netloc.count(":") > 1 and not parts.netloc.startswith("["):     # iwarp://::1:20408
            raise ValueError(f"{url!r}: write an IPv6 address in brackets: "
                             f"{transport}://[{_ipv6_of(parts.netloc)}]:PORT") from None
        raise ValueError(f"{url!r}: {exc}") from None
    host = parts.hostname or default_host
    name = None
    try:
        ipaddress.ip_address(host)
    except ValueError:
        name, host = host, resolve(host, url)
    if port is None:
        port = IWARP_PORT if transport == "iwarp" else ROCE_PORT
    return Address(transport, host, port, name)


def _ipv6_of(netloc: str) -> str:
    """The IPv6 address in a netloc written without brackets: all of it, or all but a
    trailing ``:PORT``."""
    try:
        return str(ipaddress.IPv6Address(netloc))
    except ValueError:
        return netloc.rsplit(":", 1)[0]


def resolve(name: str, url: str) -> str:
    """A host name's address as the system resolves it (hosts file, DNS): its first IPv4
    address, else its first IPv6 one (DECISIONS: the tools listen on IPv4 by default, and
    ``localhost`` names both); ValueError when it has none."""
    try:
        found = socket.getaddrinfo(name, None, type=socket.SOCK_DGRAM)
    except (socket.gaierror, UnicodeError) as exc:
        why = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        raise ValueError(f"{url!r}: cannot resolve {name!r} ({why})") from None
    v4 = [str(a[4][0]) for a in found if a[0] == socket.AF_INET]
    v6 = [str(a[4][0]) for a in found if a[0] == socket.AF_INET6]
    if not v4 + v6:
        raise ValueError(f"{url!r}: {name!r} has no IP address")
    return (v4 + v6)[0]
