"""Two network namespaces joined by a veth pair, for tests of the raw RoCEv2 backend.

``Link()`` creates them (names unique per process and call) and ``close()`` deletes them;
``enter(ns)`` moves the calling thread into a namespace (sockets it opens stay there) and
back, ``move(ns)`` for good. Tests skip, with the reason, where namespaces cannot be
made (not root, no ``ip``).
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest

_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
_count = itertools.count()


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns")


def move(ns: str) -> None:
    """Move this thread into network namespace ``ns`` for the rest of its life."""
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        _setns(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def enter(ns: str) -> Iterator[None]:
    """Run the block with this thread in network namespace ``ns``."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        _setns(target)
        yield
    finally:
        _setns(home)
        os.close(home)
        os.close(target)


class Link:
    """Namespaces ``a`` and ``b``, veth ``ifa`` in a (no address) and ``ifb`` in b."""

    def __init__(self) -> None:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            pytest.skip("network namespaces need root and iproute2's ip")
        tag = f"{os.getpid() % 100000}{next(_count)}"
        self.a, self.b = f"kbtpA{tag}", f"kbtpB{tag}"
        self.ifa, self.ifb = f"kva{tag}", f"kvb{tag}"
        try:
            ip("netns", "add", self.a)
            ip("netns", "add", self.b)
            ip("link", "add", self.ifa, "netns", self.a, "type", "veth", "peer", "name",
               self.ifb, "netns", self.b)
            for ns, dev in ((self.a, self.ifa), (self.b, self.ifb), (self.a, "lo"),
                            (self.b, "lo")):
                ip("-n", ns, "link", "set", dev, "up")
        except (OSError, subprocess.CalledProcessError) as exc:
            self.close()
            pytest.skip(f"cannot create network namespaces: "
                        f"{getattr(exc, 'stderr', '') or exc}".strip())

    def address_b(self, *addrs: str) -> None:
        """Configure addresses (with prefix) on b's side, without DAD delay for IPv6."""
        for addr in addrs:
            ip("-n", self.b, "addr", "add", addr, "dev", self.ifb,
               *(["nodad"] if ":" in addr else []))

    def close(self) -> None:
        for ns in (self.a, self.b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20, check=False)
