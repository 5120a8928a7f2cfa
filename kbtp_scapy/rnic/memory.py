"""Registered memory of the soft RNIC: regions named by STags, with rights and bounds.

What an RDMA NIC enforces for remote access (RFC 5040 s6.4 and RFC 5042 for iWARP; the
InfiniBand memory-protection rules for RoCEv2): a tagged access names an STag, a Tagged
Offset and a length; the STag must be valid (registered, not invalidated), the range
must lie inside the region, and the region must grant the right the access needs. A
refused access raises ``AccessError`` and touches nothing; the transport turns it into a
NAK or a Terminate. Tagged Offsets are zero-based: the first octet of a region is at
``base`` (0 unless the owner chose otherwise).

A region may be bound to one connection (a memory window, as the Partition STag of
DIRECT_ALLOC is): then only that connection may use it remotely.
"""
from __future__ import annotations

import enum
import os
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from ..ring import masked_add

_U64 = (1 << 64) - 1
ByteOrder = Literal["little", "big"]     # of the RNIC's memory, for atomics


def _random_words() -> Iterator[int]:
    """32-bit values from the OS's CSPRNG, drawn 1,024 at a time: one system call per
    registration would cost more than the rest of it."""
    while True:
        yield from struct.unpack("1024I", os.urandom(4096))


_random = _random_words()
_random_lock = threading.Lock()


def _random_word() -> int:
    """The next random word; a lock, since a target and its checker may share the process
    (tests, catch-rate tools) and a generator entered from two threads at once raises."""
    with _random_lock:
        return next(_random)


class Access(enum.IntFlag):
    """Rights a region grants (verbs' IBV_ACCESS_* / RFC 5040 STag access rights)."""

    LOCAL = 0
    REMOTE_READ = 1
    REMOTE_WRITE = 2
    REMOTE_ATOMIC = 4


_REMOTE_READ, _REMOTE_WRITE, _REMOTE_ATOMIC = (
    int(Access.REMOTE_READ), int(Access.REMOTE_WRITE), int(Access.REMOTE_ATOMIC))


class Fault(enum.Enum):
    """Why a remote access was refused; the transports map each to their error codes."""

    INVALID_STAG = "invalid STag"          # unknown or invalidated (RFC 5040 s7.4.1 0x00/0x01)
    BOUNDS = "base or bounds violation"    # RFC 5040 s7.4.1 0x01 (tagged buffer error)
    ACCESS = "access rights violation"     # RFC 5040 s7.4.1 0x02
    WRONG_CONNECTION = "STag not associated with this connection"  # RFC 5040 0x03
    MISALIGNED = "atomic operand not 8-octet aligned"


class AccessError(Exception):
    """A remote access that a NIC refuses; nothing was read or written."""

    def __init__(self, fault: Fault, stag: int, offset: int, length: int):
        super().__init__(f"{fault.value}: STag 0x{stag:08x} offset 0x{offset:x} length {length}")
        self.fault, self.stag, self.offset, self.length = fault, stag, offset, length


@dataclass(eq=False)
class MemoryRegion:
    """One registration: ``length`` octets of ``buffer`` from ``start``, named by ``stag``."""

    stag: int
    buffer: Any                   # bytearray or mmap: anything a memoryview can write
    access: Access
    start: int = 0
    length: int = 0
    base: int = 0                 # Tagged Offset of the first octet
    connection: object | None = None   # set for a window bound to one connection
    valid: bool = True
    view: memoryview = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.length:
            self.length = len(self.buffer) - self.start
        self.view = memoryview(self.buffer)[self.start:self.start + self.length]

    def local(self, offset: int, length: int) -> memoryview:
        """The octets at Tagged Offset ``offset`` (the owner's own view: no rights checked)."""
        rel = offset - self.base
        if rel < 0 or length < 0 or rel + length > self.length:
            raise AccessError(Fault.BOUNDS, self.stag, offset, length)
        return self.view[rel:rel + length]


class MemoryTable:
    """The STags of one RNIC (a protection domain): register, look up, invalidate.

    ``order`` is the RNIC's memory byte order for atomics (RFC 7306 s5.2 and the
    InfiniBand atomics operate on the 64-bit word in the responder's native order).
    """

    def __init__(self, order: ByteOrder = "little") -> None:
        self.order = order
        self._regions: dict[int, MemoryRegion] = {}

    def register(self, buffer: Any, access: Access = Access.LOCAL, *, start: int = 0,
                 length: int = 0, base: int = 0, connection: object | None = None,
                 stag: int | None = None) -> MemoryRegion:
        """Register a buffer; a fresh random STag is chosen unless one is given.

        The low 8 bits are the consumer key and the upper 24 the index, as on iWARP and
        InfiniBand; random indices keep STags unguessable (RFC 5042 s5.1).
        """
        while stag is None or stag in self._regions or stag == 0:
            stag = _random_word()
        region = MemoryRegion(stag, buffer, access, start, length, base, connection)
        self._regions[stag] = region
        return region

    def register_indirect(self, make: Callable[[int], MemoryRegion]) -> MemoryRegion:
        """Register a region that is not one run of one buffer (an indirect key, as mlx5's
        KLM lists): ``make`` builds it for a fresh STag (rnic/chains/alias.py)."""
        stag = None
        while stag is None or stag in self._regions or stag == 0:
            stag = _random_word()
        region = self._regions[stag] = make(stag)
        return region

    def deregister(self, stag: int) -> None:
        region = self._regions.pop(stag, None)
        if region is not None:
            region.valid = False

    def invalidate(self, stag: int) -> bool:
        """Invalidate an STag (Send with Invalidate, or the owner's own call).

        Returns False when the STag is unknown or already invalid, which a transport
        reports as an error of the Send with Invalidate (RFC 5040 s6.10).
        """
        region = self._regions.get(stag)
        if region is None or not region.valid:
            return False
        region.valid = False
        return True

    def get(self, stag: int) -> MemoryRegion | None:
        return self._regions.get(stag)

    def buffer(self, size: int) -> Any:
        """A fresh writable buffer for a region to register (a verbs device hands out
        memory it has registered already, so that registering it costs no system call)."""
        return bytearray(size)

    def default_base(self, buffer: Any, start: int = 0) -> int:
        """The Tagged Offset the first octet of ``buffer[start:]`` gets when registered
        without a ``base``: 0 here (zero-based), its virtual address on a verbs device."""
        return 0

    def remote(self, stag: int, offset: int, length: int, right: int,
               connection: object | None = None) -> memoryview:
        """The octets a remote access may touch, or ``AccessError``."""
        region = self._regions.get(stag)
        if region is None or not region.valid:
            raise AccessError(Fault.INVALID_STAG, stag, offset, length)
        if region.connection is not None and region.connection is not connection:
            raise AccessError(Fault.WRONG_CONNECTION, stag, offset, length)
        if not region.access._value_ & right:     # as ints: IntFlag arithmetic is slow
            raise AccessError(Fault.ACCESS, stag, offset, length)
        return region.local(offset, length)

    def remote_read(self, stag: int, offset: int, length: int,
                    connection: object | None = None) -> bytes:
        return bytes(self.remote(stag, offset, length, _REMOTE_READ, connection))

    def remote_write(self, stag: int, offset: int, data: bytes | memoryview,
                     connection: object | None = None) -> None:
        self.remote(stag, offset, len(data), _REMOTE_WRITE, connection)[:] = data

    def atomic(self, stag: int, offset: int, connection: object | None = None) -> memoryview:
        """The 8-octet operand of an atomic; RFC 7306 and InfiniBand require alignment."""
        if offset % 8:
            raise AccessError(Fault.MISALIGNED, stag, offset, 8)
        return self.remote(stag, offset, 8, _REMOTE_ATOMIC, connection)

    def fetch_add(self, view: memoryview, add: int, mask: int | None = None) -> int:
        """Fetch and Add on an operand, returning the original value.

        ``mask`` None is InfiniBand's unmasked add; otherwise RFC 7306 masked FetchAdd.
        The RNIC runs one operation at a time, which is what makes it atomic.
        """
        original = int.from_bytes(view, self.order)
        new = (original + add) & _U64 if mask is None else masked_add(original, add, mask)
        view[:] = new.to_bytes(8, self.order)
        return original

    def compare_swap(self, view: memoryview, compare: int, swap: int) -> int:
        original = int.from_bytes(view, self.order)
        if original == compare:
            view[:] = (swap & _U64).to_bytes(8, self.order)
        return original
