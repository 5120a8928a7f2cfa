"""The verbs backend: the soft RNIC's QueuePair and MemoryTable over a real RDMA device.

With ``io="verbs"`` the target and initiator run on any device rdma-core drives (the
kernel's rxe and siw, or a NIC): the device moves the data, executes the peer's RDMA
Writes, Reads and atomics on registered memory, and checks every STag itself. The KBTP
logic and its memory formats are those of the soft RNIC; only this layer differs.

pyverbs (rdma-core's Python bindings) does the verbs: one protection domain, completion
queue, completion channel and RC QP per connection, memory regions registered from the
caller's own buffers. librdmacm sets connections up (``rdmacm.py``). On such devices:

- STags are rkeys and Tagged Offsets are virtual addresses (pyverbs registers by address),
  so a region's ``base`` is the address of its first octet;
- a region bound to a connection is a memory region in that connection's protection
  domain, which no other connection can use;
- a buffer the peer may invalidate with Send with Invalidate is a type 2 memory window
  where the device has them (InfiniBand devices cannot invalidate a plain memory region
  remotely), a memory region otherwise (iWARP invalidates those);
- Sends, Writes and Reads go through a registered staging buffer; a WR is signaled at
  least every ``SIGNAL_EVERY`` posts so that the send queue never fills with WRs nobody
  can retire, and completions (in order, as RC guarantees) retire everything before them;
- the completion channel's descriptor drives everything from the event loop.
"""
from __future__ import annotations

import asyncio
import ctypes
import functools
import itertools
import logging
import os
import socket
import sys
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

from ..wire.address import Address
from . import rdmacm
from .memory import Access, ByteOrder, MemoryRegion, MemoryTable
from .qp import ConnectionLost, QueuePair, Received, RemoteError, Verb, WorkRequest

log = logging.getLogger(__name__)

SIGNAL_EVERY = 16           # an unsignaled WR is retired by the next signaled one
SEND_DEPTH = 256
STAGING = 2 << 20           # registered octets per connection for Sends, Writes and Reads
RESOURCES = 16              # RDMA Read / atomic depth asked for in both directions
RECV_BIT = 1 << 62          # wr_id of a receive: RECV_BIT | slot
_U64 = 2**64 - 1
#: rxe (6.1) writes the kernel's IB_WC_WITH_INVALIDATE (1 << 2) into user completions, where
#: libibverbs means IBV_WC_IP_CSUM_OK, which no RC receive carries; siw sets IBV_WC_WITH_INV
_KERNEL_WC_WITH_INVALIDATE = 1 << 2
_IBV_NODE_RNIC = 4


class VerbsError(OSError):
    """The RDMA device or rdma-core cannot do what was asked; the message says what to do."""


@functools.cache
def _pyverbs():
    """pyverbs' modules, or a VerbsError that says how to get them."""
    try:
        import pyverbs.enums as e
        from pyverbs import addr, cq, device, mr, pd, qp, wr
    except ImportError:
        sys.path.append("/usr/lib/python3/dist-packages")   # Debian's python3-pyverbs
        try:
            import pyverbs.enums as e
            from pyverbs import addr, cq, device, mr, pd, qp, wr
        except ImportError as exc:
            raise VerbsError(f"the verbs backend needs rdma-core's pyverbs ({exc}): "
                               "apt-get install python3-pyverbs rdma-core") from None
    return e, cq, device, mr, pd, qp, wr, addr


def address_of(buffer: Any, start: int = 0) -> int:
    """The virtual address of octet ``start`` of a writable buffer (bytearray, mmap)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer)) + start


def _fds() -> dict[int, str]:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass
    return out


def _comp_channel(ctx):
    """A pyverbs CompChannel and its file descriptor, which pyverbs does not expose:
    the descriptor the new channel added to this process (uverbs' event file)."""
    _, cq, *_ = _pyverbs()
    before = _fds()
    channel = cq.CompChannel(ctx)
    new = [fd for fd, link in _fds().items()
           if link == "anon_inode:[infinibandevent]" and before.get(fd) != link]
    if len(new) != 1:
        channel.close()
        raise VerbsError("cannot find the completion channel's file descriptor")
    return channel, new[0]


#: Devices whose memory windows do not bound a peer's access (vendor ID: driver). Linux
#: rxe (6.1) checks a remote access against the range of the MR under a type 2 window, not
#: the window's, so a peer reaches the whole arena; the initiator checker's probe one octet
#: past a LOAD descriptor was placed. There every remotely accessible buffer is an MR of its
#: own, exactly its length (docs/DECISIONS.md, "Memory windows on rxe").
UNBOUNDED_WINDOWS = {0xFFFFFF: "rxe"}


class Device:
    """One RDMA device, opened once per process: what it can do, for the target's offer."""

    _open: dict[str, Device] = {}

    def __init__(self, name: str) -> None:
        e, _, device, *_ = _pyverbs()
        names = {d.name.decode(): d for d in device.get_device_list()}
        if name not in names:
            raise VerbsError(f"no RDMA device {name!r} (have: {', '.join(names) or 'none'})")
        self.name = name
        self.ctx = device.Context(name=name)
        attr = self.ctx.query_device()
        self.transport = "iwarp" if names[name].node_type == _IBV_NODE_RNIC else "roce"
        self.atomics = attr.atomic_caps != e.IBV_ATOMIC_NONE
        self.memory_windows = bool(attr.device_cap_flags & e.IBV_DEVICE_MEM_WINDOW_TYPE_2B) \
            and attr.max_mw > 0 and attr.vendor_id not in UNBOUNDED_WINDOWS
        self.max_rd_atomic = min(RESOURCES, attr.max_qp_rd_atom or RESOURCES)
        self.active_mtu = self.ctx.query_port(1).active_mtu

    @classmethod
    def open(cls, name: str) -> Device:
        dev = cls._open.get(name)
        if dev is None:
            dev = cls._open[name] = Device(name)
        return dev

    def lacks(self) -> dict[str, str]:
        """What this device cannot do that KBTP features need: feature -> why."""
        out = {}
        if not self.atomics:
            out["DIRECT_ALLOC"] = f"{self.name} has no atomic operations (FetchAdd on Head)"
        if self.transport == "iwarp" and self.atomics:
            out["DIRECT_ALLOC"] = (f"{self.name} has no RFC 7306 masked FetchAdd "
                                   "(verbs offer only the unmasked one)")
        return out


class VerbsMemory(MemoryTable):
    """Registered memory on a device: a region is an MR (or an MW) of a connection's
    protection domain; STags are rkeys, Tagged Offsets virtual addresses."""

    def __init__(self, order: ByteOrder = "little") -> None:
        super().__init__(order)
        self.qp: VerbsQP | None = None     # for regions bound to no connection (initiator)
        self._objects: dict[int, tuple[Any, Any]] = {}   # stag -> (mr, mw or None)
        self._slab: _Slab | None = None

    def default_base(self, buffer: Any, start: int = 0) -> int:
        return address_of(buffer, start)

    def buffer(self, size: int) -> Any:
        """Where memory windows bind (InfiniBand devices), a piece of memory registered
        once, so a request's buffer costs a window and its bind, not a registration."""
        qp = self.qp
        if qp is None or not qp.dev.memory_windows or size > _Slab.ARENA:
            return bytearray(size)
        if self._slab is None:
            self._slab = _Slab(qp)
        return self._slab.take(size)

    def register(self, buffer: Any, access: Access = Access.LOCAL, *, start: int = 0,
                 length: int = 0, base: int = 0, connection: object | None = None,
                 stag: int | None = None) -> MemoryRegion:
        e, _, _, mr, *_ = _pyverbs()
        qp = connection if connection is not None else self.qp
        if not isinstance(qp, VerbsQP):
            raise VerbsError("verbs memory is registered on a connection: connect first")
        if stag is not None:
            raise ValueError("the device chooses STags")
        length = length or len(buffer) - start
        addr = address_of(buffer, start)
        if base not in (0, addr):
            raise ValueError("on a verbs device the Tagged Offset is the buffer's address")
        flags = 0
        if access & Access.REMOTE_READ:
            flags |= e.IBV_ACCESS_REMOTE_READ
        if access & Access.REMOTE_WRITE:
            flags |= e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
        if access & Access.REMOTE_ATOMIC:
            flags |= e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_ATOMIC
        window = connection is None and access and qp.dev.memory_windows
        rights = flags
        arena = self._slab.arena_of(addr, length) if window and self._slab else None
        if arena is not None:
            region_mr = None                  # the slab's arena is registered already
        else:
            if window:
                flags |= e.IBV_ACCESS_MW_BIND | e.IBV_ACCESS_LOCAL_WRITE
            region_mr = arena = _register(mr, qp.pd, length, flags, addr)
        mw = None
        key = arena.rkey
        if window:
            # A fresh window each time: one bound through the send queue cannot be bound
            # again with pyverbs (rxe checks the rkey the application knows, which only
            # ibv_bind_mw, a type 1 call, updates).
            mw = mr.MW(qp.pd, e.IBV_MW_TYPE_2)
            key = qp.bind_window(mw, arena, addr, length, rights & ~e.IBV_ACCESS_LOCAL_WRITE)
        region = MemoryRegion(key, buffer, access, start, length, addr, connection)
        self._regions[key] = region
        self._objects[key] = (region_mr, mw)
        return region

    def _release(self, stag: int) -> None:
        mr, mw = self._objects.pop(stag, (None, None))
        if mw is not None:
            mw.close()
        if mr is not None:
            mr.close()

    def deregister(self, stag: int) -> None:
        region = self._regions.get(stag)
        super().deregister(stag)
        self._release(stag)
        if region is not None and self._slab is not None:
            self._slab.give(region.buffer)

    def invalidate(self, stag: int) -> bool:
        """The owner's own invalidation: the device forgets the STag."""
        valid = super().invalidate(stag)
        self._release(stag)
        return valid

    def invalidated(self, stag: int) -> None:
        """The peer's Send with Invalidate revoked ``stag`` (the device did it)."""
        region = self._regions.get(stag)
        if region is not None:
            region.valid = False


class _Slab:
    """Buffers carved from arenas registered once (with MW_BIND), in power-of-two sizes
    kept for reuse: what a request's memory window binds to."""

    ARENA = 4 << 20

    def __init__(self, qp: VerbsQP) -> None:
        self.qp = qp
        self.arenas: list[tuple[int, int, Any, bytearray]] = []    # (address, end, MR, memory)
        self.free: dict[int, list[memoryview]] = {}
        self.size_of: dict[int, int] = {}                        # chunk address -> size class
        self._cursor = self.ARENA                                # the last arena is full

    def take(self, size: int) -> memoryview:
        cls = max(64, 1 << (size - 1).bit_length())
        chunks = self.free.get(cls)
        chunk = chunks.pop() if chunks else self._carve(cls)
        return chunk[:size]

    def _carve(self, cls: int) -> memoryview:
        if self._cursor + cls > self.ARENA:
            e, _, _, mr, *_ = _pyverbs()
            memory = bytearray(self.ARENA)
            addr = address_of(memory)
            arena_mr = _register(mr, self.qp.pd, self.ARENA, e.IBV_ACCESS_LOCAL_WRITE
                                 | e.IBV_ACCESS_MW_BIND, addr)
            self.arenas.append((addr, addr + self.ARENA, arena_mr, memory))
            self._cursor = 0
        addr, _, _, memory = self.arenas[-1]
        chunk = memoryview(memory)[self._cursor:self._cursor + cls]
        self.size_of[addr + self._cursor] = cls
        self._cursor += cls
        return chunk

    def arena_of(self, addr: int, length: int) -> Any:
        for start, end, arena_mr, _ in self.arenas:
            if start <= addr and addr + length <= end:
                return arena_mr
        return None

    def give(self, buffer: Any) -> None:
        """A chunk back for the next ``take`` (anything else is not ours: ignored)."""
        if not isinstance(buffer, memoryview):
            return
        addr = address_of(buffer)
        cls = self.size_of.get(addr)
        if cls is not None:
            base = buffer.obj
            start = addr - address_of(base)
            self.free.setdefault(cls, []).append(memoryview(base)[start:start + cls])


def _register(mr, pd, length: int, flags: int, addr: int):
    """An MR, or a VerbsError that says why not (pinned memory is limited per process)."""
    try:
        return mr.MR(pd, length, flags, address=addr)
    except Exception as exc:
        why = str(exc)
        if "Errno: 12" in why:
            why = (f"cannot pin {length} more octets (RLIMIT_MEMLOCK; every connection pins "
                   "what it registers): raise it, e.g. 'ulimit -l unlimited'")
        raise VerbsError(f"memory registration failed: {why}") from None


class _Staging:
    """A registered buffer handed out in order and given back in order, as RC retires WRs
    (a span given back early is one just taken whose post failed: the newest)."""

    def __init__(self, size: int) -> None:
        self.buffer = bytearray(size)
        self.view = memoryview(self.buffer)
        self.address = address_of(self.buffer)
        self.size = size
        self.spans: deque[tuple[int, int]] = deque()      # (offset, octets), oldest first

    def take(self, n: int) -> int | None:
        """An offset of ``n`` free octets (8-aligned), or None while there is no room."""
        n = max(8, (n + 7) & ~7)
        if not self.spans:
            at = 0 if n <= self.size else None
        else:
            first = self.spans[0][0]
            last, length = self.spans[-1]
            head = last + length
            if last >= first:                     # not wrapped: room after head, then before first
                at = head if self.size - head >= n else 0 if first >= n else None
            else:                                 # wrapped: room between head and first
                at = head if first - head >= n else None
        if at is not None:
            self.spans.append((at, n))
        return at

    def give(self, at: int, n: int) -> None:
        span = (at, max(8, (n + 7) & ~7))
        if self.spans and self.spans[0] == span:
            self.spans.popleft()
        elif self.spans and self.spans[-1] == span:
            self.spans.pop()
        else:
            self.spans.remove(span)


def _wc_status(status: int) -> str:
    fn = rdmacm.libverbs().ibv_wc_status_str
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_char_p
    return fn(status).decode()


class VerbsQP(QueuePair):
    """One RC connection on a device: a QueuePair whose verbs the device executes."""

    def __init__(self, memory: MemoryTable, dev: Device, cm_id: rdmacm.CmId, *,
                 recv_size: int = 4096, posted: int = 0, depth: int = 64) -> None:
        e, cq, _, mr, pd, qp, w, _ = _pyverbs()
        super().__init__(memory, recv_size=recv_size, posted=0)
        self.dev, self.cm_id = dev, cm_id
        self.transport = dev.transport
        self.masked_atomics = dev.transport == "iwarp"
        self.atomics = dev.atomics and not self.masked_atomics   # verbs: unmasked only
        # InfiniBand invalidates windows, not plain MRs (see VerbsMemory); iWARP both
        self.remote_invalidate = dev.transport == "iwarp" or dev.memory_windows
        self._loop = asyncio.get_running_loop()
        self.pd = pd.PD(dev.ctx)
        self.channel, self._fd = _comp_channel(dev.ctx)
        self._rq = max(depth, posted)
        self.cq = cq.CQ(dev.ctx, SEND_DEPTH + self._rq + 16, None, self.channel, 0)
        cap = qp.QPCap(max_send_wr=SEND_DEPTH, max_recv_wr=self._rq, max_send_sge=1,
                       max_recv_sge=1)
        self.qp = qp.QP(self.pd, qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq,
                                                 rcq=self.cq, cap=cap, sq_sig_all=0))
        self.qpn = self.qp.qp_num
        self._recv = bytearray(self._rq * recv_size)
        self._recv_view = memoryview(self._recv)
        self._recv_mr = _register(mr, self.pd, len(self._recv), e.IBV_ACCESS_LOCAL_WRITE,
                                  address_of(self._recv))
        self._free_slots = deque(range(self._rq))
        # Work requests are built once and reused: each pyverbs object costs a logger lookup,
        # and post_send/post_recv copy them into the device's queue anyway.
        self._recv_wrs = [w.RecvWR(RECV_BIT | slot, 1, [w.SGE(
            self._recv_mr.buf + slot * recv_size, recv_size, self._recv_mr.lkey)])
            for slot in range(self._rq)]
        self._want_recv = 0                      # asked for, not yet on the RQ
        self._staging = _Staging(STAGING)
        self._staging_mr = _register(mr, self.pd, STAGING, e.IBV_ACCESS_LOCAL_WRITE,
                                     self._staging.address)
        self._sge = w.SGE(self._staging.address, 0, self._staging_mr.lkey)
        self._swr = w.SendWR(0, e.IBV_WR_SEND, 1, 0, [self._sge], 0)
        self._swr.sg_list = self._sge            # the WR now reads the one SGE we update
        self._ids = itertools.count(1)
        self._hw: deque[tuple[int, WorkRequest | None, int, int]] = deque()  # posted WRs
        self._backlog: deque[WorkRequest] = deque()
        self._unsignaled = 0
        self._closing = False
        self._torn_down = False
        self._cm_events: asyncio.Queue[rdmacm.CmEvent] = asyncio.Queue()
        self.established = asyncio.Event()
        if isinstance(memory, VerbsMemory) and memory.qp is None:
            memory.qp = self
        self.cq.req_notify()
        self._loop.add_reader(self._fd, self._on_cq_event)
        self._modify(e.IBV_QPS_INIT)
        self.post_recv(posted)
        cm_id.on_event = self._cm_event

    # -- QP states, as librdmacm drives its own QPs ---------------------------------------

    def _modify(self, state: int, *, responder_resources: int | None = None,
                initiator_depth: int | None = None) -> None:
        e, _, _, _, _, qp, _, addr = _pyverbs()
        raw, mask = self.cm_id.init_qp_attr(state)
        a = qp.QPAttr(qp_state=state)
        if mask & e.IBV_QP_ACCESS_FLAGS:
            a.qp_access_flags = raw.qp_access_flags
        if mask & e.IBV_QP_PKEY_INDEX:
            a.pkey_index = raw.pkey_index
        if mask & e.IBV_QP_PORT:
            a.port_num = raw.port_num
        if mask & e.IBV_QP_AV:
            ah = raw.ah_attr
            gid = bytes(ah.dgid).hex()
            route = addr.GlobalRoute(dgid=addr.GID(":".join(gid[i:i + 4] for i in range(0, 32, 4))),
                                     flow_label=ah.flow_label, sgid_index=ah.sgid_index,
                                     hop_limit=ah.hop_limit, traffic_class=ah.traffic_class)
            a.ah_attr = addr.AHAttr(gr=route, is_global=ah.is_global, dlid=ah.dlid, sl=ah.sl,
                                    src_path_bits=ah.src_path_bits, port_num=ah.port_num)
        for bit, name in ((e.IBV_QP_PATH_MTU, "path_mtu"), (e.IBV_QP_TIMEOUT, "timeout"),
                          (e.IBV_QP_RETRY_CNT, "retry_cnt"), (e.IBV_QP_RNR_RETRY, "rnr_retry"),
                          (e.IBV_QP_RQ_PSN, "rq_psn"), (e.IBV_QP_SQ_PSN, "sq_psn"),
                          (e.IBV_QP_MIN_RNR_TIMER, "min_rnr_timer"),
                          (e.IBV_QP_DEST_QPN, "dest_qp_num"),
                          (e.IBV_QP_MAX_QP_RD_ATOMIC, "max_rd_atomic"),
                          (e.IBV_QP_MAX_DEST_RD_ATOMIC, "max_dest_rd_atomic")):
            if mask & bit:
                setattr(a, name, getattr(raw, name))
        if mask & e.IBV_QP_MAX_DEST_RD_ATOMIC and responder_resources is not None:
            a.max_dest_rd_atomic = responder_resources
        if mask & e.IBV_QP_MAX_QP_RD_ATOMIC and initiator_depth is not None:
            a.max_rd_atomic = initiator_depth
        if mask:
            self.qp.modify(a, mask & ~0x1e00000)   # bits 21-24: never exposed by libibverbs

    def ready(self, responder_resources: int, initiator_depth: int) -> None:
        """INIT (again, with the connection's resources), RTR, RTS."""
        e = _pyverbs()[0]
        self._modify(e.IBV_QPS_INIT)
        self._modify(e.IBV_QPS_RTR, responder_resources=responder_resources)
        self._modify(e.IBV_QPS_RTS, initiator_depth=initiator_depth)

    def conn_param(self, responder_resources: int, initiator_depth: int) -> rdmacm.ConnParam:
        return rdmacm.ConnParam(responder_resources=responder_resources,
                                initiator_depth=initiator_depth, retry_count=7,
                                rnr_retry_count=7, qp_num=self.qpn)

    def _cm_event(self, event: rdmacm.CmEvent) -> None:
        if event.type == rdmacm.Event.ESTABLISHED:
            self.established.set()
        elif event.type in (rdmacm.Event.DISCONNECTED, rdmacm.Event.DEVICE_REMOVAL):
            self.cm_id.disconnect()      # the DREP (RoCE) to the peer's DREQ
            self.lost(ConnectionLost("the peer closed the connection"
                                     if not self._closing else "closed locally",
                                     how="local" if self._closing else "dreq"))
        elif event.type == rdmacm.Event.TIMEWAIT_EXIT:
            pass
        self._cm_events.put_nowait(event)

    async def cm_event(self, timeout: float) -> rdmacm.CmEvent:
        return await asyncio.wait_for(self._cm_events.get(), timeout)

    # -- receive queue -------------------------------------------------------------------

    def post_recv(self, count: int = 1) -> None:
        self._want_recv += count
        while self._want_recv and self._free_slots and not self._torn_down:
            slot = self._free_slots.popleft()
            try:
                self.qp.post_recv(self._recv_wrs[slot])
            except Exception as exc:
                self._free_slots.appendleft(slot)
                self.lost(ConnectionLost(f"post_recv failed: {exc}"))
                return
            self._want_recv -= 1
            self._posted += 1

    # -- send queue ----------------------------------------------------------------------

    def _transmit(self, wr: WorkRequest) -> None:
        if self._backlog or len(self._hw) >= SEND_DEPTH - 2:
            self._backlog.append(wr)
            return
        self._post(wr)

    def _post(self, wr: WorkRequest) -> None:
        e = _pyverbs()[0]
        verb = wr.verb
        atomic = verb is Verb.FETCH_ADD or verb is Verb.COMPARE_SWAP
        if atomic and (not self.dev.atomics or wr.mask is not None):
            what = "atomic operations" if not self.dev.atomics else "masked FetchAdd (RFC 7306)"
            self.complete(wr, error=RemoteError(f"{self.dev.name} has no {what}"))
            return
        size = wr.length if verb is Verb.READ else 8 if atomic else len(wr.payload)
        at = self._staging.take(size)
        if at is None:
            if not self._hw:
                self.complete(wr, error=RemoteError(f"{size} octets exceed the staging buffer"))
                return
            self._backlog.appendleft(wr)     # wait for completions to give space back
            return
        if size and (verb is Verb.SEND or verb is Verb.WRITE):
            self._staging.view[at:at + size] = wr.payload
        self._sge.addr, self._sge.length = self._staging.address + at, size
        self._unsignaled += 1
        signaled = (wr.future is not None or self._unsignaled >= SIGNAL_EVERY
                    or len(self._hw) >= SEND_DEPTH - 4 or self._closing)
        flags = e.IBV_SEND_SIGNALED if signaled else 0
        if wr.solicited:
            flags |= e.IBV_SEND_SOLICITED
        seq = next(self._ids)
        swr, imm = self._swr, 0
        if verb is Verb.SEND:
            op = e.IBV_WR_SEND
            if wr.invalidate is not None:
                op, imm = e.IBV_WR_SEND_WITH_INV, wr.invalidate
                # libsiw takes the STag to invalidate from wr.rdma.rkey, not from
                # invalidate_rkey (rdma-core 44 to this day); rxe reads invalidate_rkey.
                swr.set_wr_rdma(wr.invalidate, 0)
            elif wr.imm is not None:
                op, imm = e.IBV_WR_SEND_WITH_IMM, socket.htonl(wr.imm)
        elif verb is Verb.WRITE:
            op = e.IBV_WR_RDMA_WRITE
            if wr.imm is not None:
                op, imm = e.IBV_WR_RDMA_WRITE_WITH_IMM, socket.htonl(wr.imm)
            swr.set_wr_rdma(wr.stag, wr.offset)
        elif verb is Verb.READ:
            op = e.IBV_WR_RDMA_READ
            swr.set_wr_rdma(wr.stag, wr.offset)
        elif verb is Verb.FETCH_ADD:
            op = e.IBV_WR_ATOMIC_FETCH_AND_ADD
            swr.set_wr_atomic(wr.stag, wr.offset, wr.add & _U64)
        else:
            op = e.IBV_WR_ATOMIC_CMP_AND_SWP
            swr.set_wr_atomic(wr.stag, wr.offset, wr.compare, wr.add & _U64)
        swr.wr_id, swr.opcode, swr.imm_data, swr.send_flags = seq, op, imm, flags
        if signaled:
            self._unsignaled = 0
        try:
            self.qp.post_send(swr)
        except Exception as exc:
            self._staging.give(at, size)
            self.lost(ConnectionLost(f"post_send failed: {exc}"))
            return
        self._hw.append((seq, wr, at, size))
        self.stats[f"tx_{verb.value}"] += 1

    def bind_window(self, mw: Any, region_mr: Any, addr: int, length: int, access: int) -> int:
        """Bind a type 2 memory window to this QP (a WR of the send queue); its rkey."""
        e, _, _, mr, _, _, w, _ = _pyverbs()
        seq = next(self._ids)
        swr = w.SendWR(seq, e.IBV_WR_BIND_MW, 0, 0, None, 0)
        swr.set_bind_wr(mw, mr.MWBindInfo(region_mr, addr, length, access))
        self.qp.post_send(swr)
        self._hw.append((seq, None, 0, -1))
        self._unsignaled += 1
        return swr.rkey

    # -- completions ---------------------------------------------------------------------

    def _on_cq_event(self) -> None:
        try:
            self.channel.get_cq_event(self.cq)
            self.cq.ack_events(1)
        except Exception:
            return
        self.cq.req_notify()
        self._poll()

    def _poll(self) -> None:
        e = _pyverbs()[0]
        while not self._torn_down:
            n, wcs = self.cq.poll(32)
            for wc in wcs:
                if wc.wr_id & RECV_BIT:
                    self._received_wc(e, wc)
                else:
                    self._send_wc(e, wc)
            if n < 32:
                break
        while self._backlog and len(self._hw) < SEND_DEPTH - 2 and self.error is None:
            before = len(self._backlog)
            self._post(self._backlog.popleft())
            if len(self._backlog) >= before:
                break                          # no staging space yet

    def _received_wc(self, e, wc) -> None:
        slot = wc.wr_id & ~RECV_BIT
        self._posted -= 1
        if wc.status != e.IBV_WC_SUCCESS:
            self._free_slots.append(slot)
            if wc.status != e.IBV_WC_WR_FLUSH_ERR:
                self.lost(ConnectionLost(f"receive failed: {_wc_status(wc.status)}", how="qp_error"))
            else:
                self.lost(ConnectionLost("the connection ended"))
            return
        self.stats["recv"] += 1
        if wc.opcode == e.IBV_WC_RECV_RDMA_WITH_IMM:
            self._free_slots.append(slot)
            self._deliver(Received(b"", imm=socket.ntohl(wc.imm_data), write_imm=True))
            return
        at = slot * self.recv_size
        payload = bytes(self._recv_view[at:at + wc.byte_len])
        self._free_slots.append(slot)
        invalidated = imm = None
        if wc.wc_flags & (e.IBV_WC_WITH_INV | _KERNEL_WC_WITH_INVALIDATE):
            invalidated = wc.imm_data
            if isinstance(self.memory, VerbsMemory):
                self.memory.invalidated(invalidated)
        elif wc.wc_flags & e.IBV_WC_WITH_IMM:
            imm = socket.ntohl(wc.imm_data)
        self._deliver(Received(payload, invalidated, imm))

    def _send_wc(self, e, wc) -> None:
        failed = wc.status != e.IBV_WC_SUCCESS
        while self._hw and self._hw[0][0] <= wc.wr_id:
            seq, wr, at, size = self._hw.popleft()
            this = seq == wc.wr_id
            if wr is None:                        # a memory window bind
                if failed and this:
                    self.lost(ConnectionLost(f"memory window bind failed: {_wc_status(wc.status)}"))
                    return
                continue
            if failed and this:
                error: BaseException
                if wc.status == e.IBV_WC_WR_FLUSH_ERR:
                    error = ConnectionLost("the connection ended")
                elif wc.status in (e.IBV_WC_REM_ACCESS_ERR, e.IBV_WC_REM_INV_REQ_ERR,
                                   e.IBV_WC_REM_OP_ERR):
                    error = RemoteError(f"the peer refused the {wr.verb.value}: "
                                        f"{_wc_status(wc.status)}")
                else:
                    error = ConnectionLost(_wc_status(wc.status), how="qp_error")
                self._staging.give(at, size)
                self.complete(wr, error=error)
                self.lost(error if isinstance(error, ConnectionLost)
                          else ConnectionLost(str(error), how="qp_error"))
                return
            result: bytearray | int | None = None
            if wr.verb is Verb.READ:
                result = bytearray(self._staging.view[at:at + size])
            elif wr.verb in (Verb.FETCH_ADD, Verb.COMPARE_SWAP):
                result = int.from_bytes(self._staging.view[at:at + 8], sys.byteorder)
            self._staging.give(at, size)
            self.complete(wr, result)

    # -- connection ----------------------------------------------------------------------

    def lost(self, error: BaseException) -> None:
        first = self.error is None
        super().lost(error)
        if first:
            self._loop.call_soon(self._teardown)

    def _teardown(self) -> None:
        """Give back everything the connection holds on the device."""
        if self._torn_down:
            return
        self._torn_down = True
        try:
            self._loop.remove_reader(self._fd)
        except Exception:
            pass
        self._backlog.clear()
        self._hw.clear()
        for obj in (self.qp, self._recv_mr, self._staging_mr):
            try:
                obj.close()
            except Exception:
                pass
        if isinstance(self.memory, VerbsMemory):
            for stag, region in list(self.memory._regions.items()):
                if region.connection is self or (region.connection is None and self.memory.qp is self):
                    self.memory._release(stag)
        for obj in (self.cq, self.channel, self.pd):
            try:
                obj.close()
            except Exception:
                pass
        self.cm_id.destroy()

    async def _shutdown(self) -> None:
        """Let what is posted finish, then DREQ (RoCE) or FIN (iWARP), and wait a little
        for the peer's answer."""
        self._closing = True
        if self._hw or self._backlog:
            try:
                await asyncio.wait_for(self.write(0, 0, b""), 5)
            except (TimeoutError, ConnectionLost, RemoteError):
                pass
        if self.error is None and self.cm_id.disconnect():
            e = _pyverbs()[0]
            try:
                self.qp.modify(_pyverbs()[5].QPAttr(qp_state=e.IBV_QPS_ERR), e.IBV_QP_STATE)
            except Exception:
                pass
            deadline = self._loop.time() + 2
            while self.error is None and (left := deadline - self._loop.time()) > 0:
                try:
                    await self.cm_event(left)
                except TimeoutError:
                    break


# -- connect and listen ----------------------------------------------------------------------

_channels: dict[asyncio.AbstractEventLoop, rdmacm.Channel] = {}


def _channel() -> rdmacm.Channel:
    loop = asyncio.get_running_loop()
    ch = _channels.get(loop)
    if ch is None or not ch.ptr:
        ch = _channels[loop] = rdmacm.Channel()
        loop.add_reader(ch.fd, ch.dispatch)
    return ch


def _check_device(cm_id: rdmacm.CmId, device: str | None, transport: str, where: str) -> Device:
    name = cm_id.device_name
    if name is None:
        raise VerbsError(f"{where} is on no RDMA device")
    if device is not None and name != device:
        raise VerbsError(f"{where} belongs to RDMA device {name}, not {device}")
    dev = Device.open(name)
    if dev.transport != transport:
        raise VerbsError(f"RDMA device {name} is {dev.transport}, not {transport}: "
                           f"use {dev.transport}://")
    return dev


def _qp_options(recv_size: int = 4096, posted: int = 0, frame_listeners=(), device: str | None = None,
                connect_timeout: float = 10.0, io: str = "verbs", **_ignored) -> tuple[dict, str | None, float]:
    return {"recv_size": recv_size, "posted": posted}, device, connect_timeout


async def connect(transport: str, host: str, port: int, memory: MemoryTable, *,
                  local: str | None = None, **options) -> VerbsQP:
    """Resolve, connect and establish an RC connection through librdmacm."""
    qp_options, device, timeout = _qp_options(**options)
    where = f"{transport}://{host}:{port}"
    events: asyncio.Queue[rdmacm.CmEvent] = asyncio.Queue()
    cm_id = rdmacm.CmId(_channel())
    cm_id.on_event = events.put_nowait
    ms = int(timeout * 1000)
    qp: VerbsQP | None = None

    async def expect(*wanted: rdmacm.Event) -> rdmacm.CmEvent:
        try:
            ev = await asyncio.wait_for(events.get(), timeout)
        except TimeoutError:
            raise TimeoutError(f"{where}: no answer from the RDMA CM within {timeout:g} s") from None
        if ev.type == rdmacm.Event.REJECTED:
            raise ConnectionRefusedError(f"{where} rejected the connection (no KBTP target "
                                         "listening there?)")
        if ev.type not in wanted:
            raise ConnectionError(f"{where}: {ev}")
        return ev

    try:
        await _resolve(cm_id, local, host, port, timeout, events, where)
        dev = _check_device(cm_id, device, transport, f"the route to {host}")
        cm_id.resolve_route(ms)
        await expect(rdmacm.Event.ROUTE_RESOLVED)
        qp = VerbsQP(memory, dev, cm_id, **qp_options)
        cm_id.on_event = events.put_nowait            # until established
        res = dev.max_rd_atomic
        cm_id.connect(qp.conn_param(res, res))
        ev = await expect(rdmacm.Event.CONNECT_RESPONSE, rdmacm.Event.ESTABLISHED)
        if ev.type == rdmacm.Event.CONNECT_RESPONSE:
            qp.ready(min(res, ev.initiator_depth or res), min(res, ev.responder_resources or res))
            cm_id.establish()
    except BaseException:
        if qp is not None:
            qp.lost(ConnectionLost("connection set-up failed"))
        else:
            cm_id.destroy()
        raise
    cm_id.on_event = qp._cm_event
    qp.established.set()
    qp.local, qp.remote = cm_id.local, cm_id.remote
    return qp


#: the kernel's address resolution timeout per attempt: Linux (6.1) waits for a neighbour
#: update or this timeout, and an update that comes before the request is queued is missed
RESOLVE_ATTEMPT_MS = 1000


async def _resolve(cm_id: rdmacm.CmId, local: str | None, host: str, port: int, timeout: float,
                   events: asyncio.Queue, where: str) -> None:
    """rdma_resolve_addr in attempts of RESOLVE_ATTEMPT_MS until ``timeout``: with a cold ARP
    cache, the first attempt can miss the neighbour update and sit out its whole timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        cm_id.resolve_addr(local, host, port, RESOLVE_ATTEMPT_MS)
        try:
            ev = await asyncio.wait_for(events.get(), max(0.1, deadline - loop.time()))
        except TimeoutError:
            raise TimeoutError(f"{where}: no answer from the RDMA CM within {timeout:g} s") from None
        if ev.type == rdmacm.Event.ADDR_RESOLVED:
            return
        if ev.type != rdmacm.Event.ADDR_ERROR or loop.time() >= deadline:
            raise ConnectionError(f"{where}: cannot resolve {host} ({ev})")


class VerbsListener:
    """Accepts RC connections on an rdma_cm port: every CONNECT_REQUEST gets a QP of its own."""

    def __init__(self, transport: str, host: str, port: int, memory: MemoryTable,
                 on_connect: Callable[[VerbsQP], Coroutine[Any, Any, None]], options: dict) -> None:
        self.transport, self.memory, self.on_connect = transport, memory, on_connect
        self.qp_options, self.device, self.timeout = _qp_options(**options)
        self.cm_id = rdmacm.CmId(_channel())
        self.cm_id.bind(host, port)
        self.dev = _check_device(self.cm_id, self.device, transport, f"{host}")
        self.cm_id.listen()
        self.cm_id.on_event = self._event
        self.lacks = self.dev.lacks()
        self.address = Address(transport, host, self.cm_id.local[1])
        self.tasks: set[asyncio.Task] = set()
        self._closed = asyncio.Event()

    def _event(self, event: rdmacm.CmEvent) -> None:
        if event.new_id is None:
            return
        if self._closed.is_set():
            event.new_id.reject()
            event.new_id.destroy()
            return
        task = asyncio.get_running_loop().create_task(self._accept(event.new_id, event))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _accept(self, cm_id: rdmacm.CmId, req: rdmacm.CmEvent) -> None:
        qp = None
        peer = cm_id.remote[0]
        try:
            name = cm_id.device_name
            assert name is not None        # librdmacm binds a connection request's id to its device
            qp = VerbsQP(self.memory, Device.open(name), cm_id, **self.qp_options)
            res = qp.dev.max_rd_atomic
            responder, initiator = min(res, req.initiator_depth or res), min(res, req.responder_resources or res)
            qp.ready(responder, initiator)
            cm_id.accept(qp.conn_param(responder, initiator))
            log.debug("accepted %s on %s, QP %d", peer, qp.dev.name, qp.qpn)
            await asyncio.wait_for(qp.established.wait(), self.timeout)
        except TimeoutError:
            log.info("connection from %s not set up: not established within %g s", peer, self.timeout)
            if qp is not None:
                qp.lost(ConnectionLost("connection set-up failed"))
            return
        except Exception as exc:
            log.info("connection from %s not set up: %s", peer, exc or type(exc).__name__)
            if qp is not None:
                qp.lost(ConnectionLost("connection set-up failed"))
            else:
                cm_id.reject()
                cm_id.destroy()
            return
        qp.local, qp.remote = cm_id.local, cm_id.remote
        try:
            await self.on_connect(qp)
        except Exception:
            log.exception("on_connect failed")

    def close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self.cm_id.destroy()

    async def wait_closed(self) -> None:
        await self._closed.wait()
