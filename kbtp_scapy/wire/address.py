"""Where a KBTP peer is: the URL form every tool takes, and the binding's well-known ports.

Defined once here, below everything that opens or names a connection, so that the RNIC,
the capture decoder, the capture builders and the command line agree on them.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

IWARP_PORT = 5420     # NOTES decision 9: KBTP has no port; the tools' default for iWARP
ROCE_PORT = 4791      # IANA's RoCEv2 port

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
