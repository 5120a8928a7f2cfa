"""RoCEv2 binding of the soft RNIC: devices, CM connection set-up, connect and listen.

A ``Device`` is one RNIC port at a local (IP, port), shared by every queue pair of the
process at that address. Its I/O backend (``roce_io.py``) is a kernel UDP socket by
default, or with ``io="raw"`` an AF_PACKET socket on an interface where the endpoint owns
its IP and MAC addresses (``roce_raw.py``). It reads datagrams in batches, checks each
ICRC, hands QP1's CM MADs to the connection manager and the rest to the QP the BTH names;
after a batch each touched QP sends its coalesced ACK and whatever its window now admits.
The queue pairs themselves (the reliable connection) are in ``roce_qp.py``.
"""
from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from ..wire import roce as w
from ..wire.address import ROCE_PORT, Address
from ..wire.roce import MASK24
from . import cm
from .admission import HalfOpen
from .memory import MemoryTable
from .qp import ConnectionLost
from .roce_io import RoceIO, UdpIO
from .roce_qp import CM_INTERVAL, MTUS, RoceQP

log = logging.getLogger(__name__)

RESOURCES = 16            # responder resources / initiator depth announced in REQ and REP
PATHS = 1024              # paths cached per device (each QP keeps its own as well)
UNSOLICITED = 64          # answers per second to CM MADs that name no connection or service


class _Bucket:
    """A token bucket: at most ``rate`` events a second, in bursts of ``rate``."""

    def __init__(self, rate: float) -> None:
        self.rate, self.tokens, self.at = rate, rate, 0.0
        self.dropped = 0

    def take(self, now: float) -> bool:
        self.tokens = min(self.rate, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        self.dropped += 1
        return False


class Device:
    """One RNIC port at a local (IP, UDP port) with its QPs and its QP1, over an I/O backend.

    Every packet goes to UDP port ``peer_port`` (4791) of the peer's address, whatever
    port the peer sends from: in RoCEv2 the destination port is always 4791 and the source
    port is entropy for ECMP (rxe picks one per QP), which identifies nothing. So QPs and
    CM exchanges are told apart by address and QP number, and the ICRC of a packet is
    checked over the ports it really carried."""

    def __init__(self, loop: asyncio.AbstractEventLoop, host: str, port: int,
                 io: dict | None = None, peer_port: int = ROCE_PORT) -> None:
        self.loop = loop
        self._unsolicited = _Bucket(UNSOLICITED)   # DREPs and REJs to unknown comm IDs and services
        self.stats: dict[str, int] = {}
        self.io_options = dict(io or {})
        self.io: RoceIO = _backend(host, port, self.stats, self.io_options)
        self.address: tuple[str, int] = self.io.address
        self.peer_port = peer_port
        self.netns = _netns()
        self.users = 0
        self.closed = False
        self.qps: dict[int, RoceQP] = {}
        self.conns: dict[int, RoceQP] = {}          # by our local communication ID
        self.accepting: dict[tuple, tuple[RoceQP, bytes]] = {}   # by (peer, its comm ID)
        self.connecting: dict[int, tuple[asyncio.Future, tuple[str, int]]] = {}  # and whereto
        self.services: dict[int, RoceListener] = {}
        self._paths: dict[tuple, tuple[w.Path, w.Path]] = {}
        self._ud_psn = secrets.randbits(24)
        loop.add_reader(self.io.fileno(), self.poll)

    # -- users ---------------------------------------------------------------------------

    def attach(self, qp: RoceQP) -> int:
        """A fresh QP number (24 bits, never 0 or 1) for ``qp``."""
        qpn = 0
        while qpn < 2 or qpn in self.qps:
            qpn = secrets.randbits(24)
        self.qps[qpn] = qp
        self.users += 1
        return qpn

    def detach(self, qp: RoceQP) -> None:
        if self.qps.get(qp.qpn) is qp:
            del self.qps[qp.qpn]
            self.conns.pop(qp.comm_id, None)
            self.release()

    def release(self) -> None:
        self.users -= 1
        if self.users <= 0:
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if _devices.get((self.loop, *self.address)) is self:
            del _devices[self.loop, *self.address]
        if not self.loop.is_closed():
            self.loop.remove_reader(self.io.fileno())
        self.io.close()

    # -- datagrams -----------------------------------------------------------------------

    def send(self, parts: list, addr: tuple[str, int]) -> None:
        self.io.send(parts, addr, self.paths(addr)[0])

    def paths(self, addr: tuple[str, int]) -> tuple[w.Path, w.Path]:
        """(to ``addr``, from ``addr``)."""
        pair = self._paths.get(addr)
        if pair is None:
            if len(self._paths) >= PATHS:     # MADs from any number of (spoofed) sources
                self._paths.clear()
            pair = self._paths[addr] = (self.io.tx_path(addr), w.Path(addr, self.address))
        return pair

    def peer(self, addr: tuple[str, int]) -> tuple[str, int]:
        """Where packets to the sender of a packet from ``addr`` go: its RoCEv2 port."""
        return addr[0], self.peer_port

    def bind(self, qp: RoceQP, addr: tuple[str, int]) -> None:
        """Give a QP set up towards ``addr`` this device's paths (the backend's framing)."""
        qp._tx, qp._rx = self.paths(addr)
        qp._rx_from = addr

    @staticmethod
    def _frame(path: w.Path, data: memoryview, wire: memoryview | None) -> bytes:
        """The frame a datagram came in: as received where the backend saw it."""
        return bytes(wire) if wire is not None else path.frame(bytes(data), path.last_id)

    def poll(self) -> None:
        """Read what is queued (bounded), then let the touched QPs flush."""
        qps, check = self.qps, self.io.check
        touched: set[RoceQP] = set()
        for data, addr, wire in self.io.receive(256):
            n = len(data)
            if n < 16:
                continue
            dqpn = w.U32.unpack_from(data, 4)[0] & MASK24
            qp = qps.get(dqpn)
            if qp is None:
                if dqpn == w.CM_QPN:
                    self._mad(data, n, addr, wire)
                else:
                    self.stats["unknown_qp"] = self.stats.get("unknown_qp", 0) + 1
                continue
            if addr != qp._rx_from:
                if addr[0] != qp.remote[0]:
                    qp.stats["foreign"] += 1
                    continue
                qp._rx, qp._rx_from = self.paths(addr)[1], addr   # the peer's source port
            assert qp._rx is not None           # set with _rx_from, which addr matches
            if not check(qp._rx, data, wire):
                qp.stats["icrc_errors"] += 1
                continue
            qp.stats["frames_rx"] += 1
            qp.rx_ns = time.perf_counter_ns()
            if qp.frame_listeners:
                qp.frame("rx", self._frame(qp._rx, data, wire), qp.rx_ns)
            qp.receive(data, n)
            touched.add(qp)
        for qp in touched:
            qp.flush()
        for addr in self.io.refused():
            self._refused(addr)

    def _refused(self, addr: tuple[str, int]) -> None:
        """Nothing owns UDP port ``addr[1]`` at ``addr[0]``: connects to it fail now (a REQ
        resent there would draw the same answer until the timeout)."""
        for future, target in self.connecting.values():
            if target == addr and not future.done():
                future.set_exception(ConnectionRefusedError(
                    f"nothing owns UDP port {addr[1]} at {addr[0]} (ICMP port unreachable), "
                    "so no RoCEv2 target is there"))

    # -- connection management on QP1 (IB 12.6, 12.9; MADs as UD SEND ONLY) ------------

    def mad_datagram(self, msg: cm.CmMessage, addr: tuple[str, int]) -> bytes:
        """A UD SEND ONLY to QP1 with DETH carrying ``msg`` (IB 13.5.1, 12.6)."""
        head = w.BTH_DETH.pack(w.UD_SEND_ONLY, 0, w.DEFAULT_PKEY, w.CM_QPN, self._ud_psn,
                               w.CM_QKEY, w.CM_QPN)
        self._ud_psn = (self._ud_psn + 1) & MASK24
        return b"".join(w.seal(self.paths(addr)[0], [head, cm.encode(msg)], 0))

    def send_datagram(self, datagram: bytes, addr: tuple[str, int],
                      listeners: Iterable) -> None:
        self.send([datagram], addr)
        ns = time.perf_counter_ns()
        for listener in listeners:
            listener("tx", self.paths(addr)[0].frame(datagram), ns)

    def send_mad(self, msg: cm.CmMessage, addr: tuple[str, int], listeners: Iterable) -> None:
        """CM MADs are unreliable datagrams: callers retransmit (IB 12.9.2)."""
        self.send_datagram(self.mad_datagram(msg, addr), addr, listeners)

    def send_dreq(self, qp: RoceQP) -> None:
        self.send_mad(cm.CmMessage(cm.CmAttr.DREQ, secrets.randbits(64),
                                   local_comm_id=qp.comm_id, remote_comm_id=qp.remote_comm_id,
                                   remote_qpn=qp.remote_qpn), qp.remote, qp.frame_listeners)

    def _mad(self, data: memoryview, n: int, addr: tuple[str, int],
             wire: memoryview | None) -> None:
        rx = self.paths(addr)[1]
        if not self.io.check(rx, data, wire) or data[0] != w.UD_SEND_ONLY:
            self.stats["bad_mads"] = self.stats.get("bad_mads", 0) + 1
            return
        if w.U32.unpack_from(data, 12)[0] != w.CM_QKEY:
            return
        frame = bytes(data)
        msg = cm.decode(frame[20:n - 4 - (data[1] >> 4 & 3)])
        if msg is None:
            return
        attr = msg.attr
        if attr == cm.CmAttr.REQ:
            self._req(msg, self.peer(addr), self._frame(rx, data, wire))
            return
        addr = self.peer(addr)
        qp = self.conns.get(msg.remote_comm_id)
        if qp is not None and qp.frame_listeners:
            qp.frame("rx", self._frame(rx, data, wire))
        if attr in (cm.CmAttr.REP, cm.CmAttr.REJ):
            future, _ = self.connecting.get(msg.remote_comm_id, (None, None))
            if future is not None and not future.done():
                future.set_result((msg, addr))
            elif qp is not None and attr == cm.CmAttr.REP and qp.established:
                self._rtu(qp, msg)                  # our RTU was lost: REP came again
        elif attr == cm.CmAttr.RTU:
            if qp is not None and qp.remote_qpn:
                qp.establish()
        elif attr == cm.CmAttr.DREQ:
            listeners = qp.frame_listeners if qp is not None else ()
            if qp is None and not self._unsolicited.take(self.loop.time()):
                return          # a DREQ for no connection of ours, from anywhere: rate-limited
            self.send_mad(cm.CmMessage(cm.CmAttr.DREP, msg.transaction_id,
                                       local_comm_id=msg.remote_comm_id,
                                       remote_comm_id=msg.local_comm_id), addr, listeners)
            if qp is not None and qp.remote_comm_id == msg.local_comm_id:
                qp.peer_closed()
        elif (attr == cm.CmAttr.DREP and qp is not None and qp._drep is not None
              and not qp._drep.done()):
            qp._drep.set_result(None)

    def _rtu(self, qp: RoceQP, rep: cm.CmMessage) -> None:
        self.send_mad(cm.CmMessage(cm.CmAttr.RTU, rep.transaction_id,
                                   local_comm_id=qp.comm_id, remote_comm_id=rep.local_comm_id),
                      qp.remote, qp.frame_listeners)

    def _req(self, msg: cm.CmMessage, addr: tuple[str, int], frame: bytes) -> None:
        """A REQ: answer a repeat with the same REP, refuse unknown services with REJ."""
        key = (addr, msg.local_comm_id)
        known = self.accepting.get(key)
        if known is not None:
            qp, rep = known
            qp.frame("rx", frame)
            self.send_datagram(rep, addr, qp.frame_listeners)
            return
        listener = self.services.get(msg.service_id)
        if listener is None or msg.transport_type != 0:
            for fl in listener.frame_listeners if listener is not None else ():
                fl("rx", frame, time.perf_counter_ns())
            if not self._unsolicited.take(self.loop.time()):
                return          # the source is not authenticated: not a 1:1 reflector
            self.send_mad(cm.CmMessage(cm.CmAttr.REJ, msg.transaction_id,
                                       remote_comm_id=msg.local_comm_id,
                                       local_comm_id=secrets.randbits(32),
                                       reject_reason=8 if listener is None else 2),
                          addr, ())
            return
        listener.accept(self, msg, addr, frame)


_devices: dict[tuple[asyncio.AbstractEventLoop, str, int], Device] = {}


def _backend(host: str, port: int, stats: dict[str, int], io: dict) -> RoceIO:
    """The I/O backend ``io`` (from ``_options``) names: {} for a UDP socket."""
    if not io:
        return UdpIO(host, port, stats)
    from .roce_raw import RawIO
    return RawIO(host, port, stats, **{k: v for k, v in io.items() if k != "io"})


def _netns() -> int:
    """This thread's network namespace: the same address may be in use in two."""
    try:
        return os.stat("/proc/thread-self/ns/net").st_ino
    except OSError:
        return 0


def _device(host: str, port: int, io: dict, peer_port: int = ROCE_PORT) -> Device:
    """The device at (host, port) of this event loop, opened on first use, with one use
    taken for the caller, who gives it back with ``release()``: a device whose last QP
    goes while the caller is still setting up must stay open. A raw device owns its IP
    address: no other device of the process in the same network namespace may use it
    (EADDRINUSE)."""
    loop = asyncio.get_running_loop()
    host = str(ipaddress.ip_address(host))
    for other in list(_devices.values()):
        if other.loop.is_closed():
            other.close()      # left behind by an event loop that has ended
    dev = _devices.get((loop, host, port)) if port else None
    if dev is not None and (dev.io_options != io or dev.peer_port != peer_port):
        dev = None             # the same address through another backend: refused below
    if dev is None:
        raw, netns = io.get("io") == "raw", _netns()
        for other in list(_devices.values()):
            if (other.netns == netns and other.address[0] == host
                    and (raw or other.io_options.get("io") == "raw")):
                raise OSError(errno.EADDRINUSE, f"{host} is already owned by this process "
                                                f"through {other.io}")
        dev = Device(loop, host, port, io, peer_port)
        _devices[(loop, *dev.address)] = dev
    dev.users += 1
    return dev


async def _started(dev: Device) -> None:
    """Wait until the device's backend may use its address; give the caller's use back
    if not."""
    try:
        await dev.io.start()
    except BaseException:
        dev.release()
        raise


class RoceListener:
    """Accepts RC connections for one rdma_cm service ID (the port) on a device."""

    def __init__(self, device: Device, port: int, memory: MemoryTable, on_connect: Callable,
                 qp_options: dict, setup: dict) -> None:
        self._dev = device
        self._memory = memory
        self._on_connect = on_connect
        self._options = qp_options
        self._cm_timeout = setup["cm_timeout"]
        self._cm_retries = setup["cm_retries"]
        self.half_open: HalfOpen | None = setup["half_open"]
        self.frame_listeners = list(qp_options.get("frame_listeners", ()))
        self.address = Address("roce", device.address[0], port)
        self.service_id = cm.rdma_cm_service_id(port)
        self.tasks: set[asyncio.Task] = set()
        self._resends: set[asyncio.Task] = set()      # REP retransmission until RTU
        self._closed = asyncio.Event()

    def accept(self, dev: Device, req: cm.CmMessage, addr: tuple[str, int],
               frame: bytes) -> None:
        """Create the QP a REQ asks for and answer REP until RTU (IB 12.9.5), if the
        half-open caps leave room; otherwise drop the REQ unanswered (counted): its source
        is not authenticated, so an answer would make the target a reflector, and a real
        peer's CM sends its REQ again."""
        ticket = None
        if self.half_open is not None:
            ticket = self.half_open.enter(addr[0])
            if ticket is None:
                return
        qp = RoceQP(self._memory, dev, **{**self._options, "mtu": req.path_mtu})
        qp.admission = ticket
        if ticket is not None:
            ticket.evict = qp.abort
        qp.frame("rx", frame)
        qp.setup(addr, req.local_qpn, req.starting_psn, req.path_mtu)
        dev.bind(qp, addr)
        qp.remote_comm_id = req.local_comm_id
        dev.conns[qp.comm_id] = qp
        rep = dev.mad_datagram(cm.CmMessage(
            cm.CmAttr.REP, req.transaction_id, local_comm_id=qp.comm_id,
            remote_comm_id=req.local_comm_id, local_qpn=qp.qpn, starting_psn=qp.start_psn,
            responder_resources=min(RESOURCES, req.initiator_depth or RESOURCES),
            initiator_depth=min(RESOURCES, req.responder_resources or RESOURCES),
            rnr_retry_count=qp.rnr_retry), addr)
        key = (addr, req.local_comm_id)
        dev.accepting[key] = (qp, rep)
        qp.on_established = self._established
        dev.send_datagram(rep, addr, qp.frame_listeners)
        resend = dev.loop.create_task(self._until_rtu(dev, qp, rep, key))
        self._resends.add(resend)
        resend.add_done_callback(self._resends.discard)

    async def _until_rtu(self, dev: Device, qp: RoceQP, rep: bytes, key: tuple) -> None:
        """REP again after each CM timeout without RTU (or a first packet), at most
        ``cm_retries`` times (IB 12.9.5: a REP per repeated REQ comes on top, answered by
        Device._req); then the set-up has failed. So a REQ that never gets its RTU costs
        1 + cm_retries REPs, however many REQs arrive."""
        for attempt in range(self._cm_retries + 1):
            await asyncio.sleep(self._cm_timeout)
            if qp.established or qp.error is not None or dev.closed:
                break
            if attempt < self._cm_retries:
                dev.send_datagram(rep, qp.remote, qp.frame_listeners)
        if not qp.established and qp.error is None:
            if self.half_open is not None:
                self.half_open.refused["cm_timeout"] += 1
            qp.lost(ConnectionLost("no RTU from the peer"))
        # answer repeated REQs with the same REP a while longer
        dev.loop.call_later(self._cm_timeout, dev.accepting.pop, key, None)

    def _established(self, qp: RoceQP) -> None:
        if self._closed.is_set():
            return
        task = qp._loop.create_task(self._on_connect(qp))
        self.tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("on_connect failed", exc_info=task.exception())

    def close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            for resend in self._resends:
                resend.cancel()
            if self._dev.services.get(self.service_id) is self:
                del self._dev.services[self.service_id]
            self._dev.release()

    async def wait_closed(self) -> None:
        await self._closed.wait()


def _options(recv_size: int = 4096, posted: int = 0, mtu: int = 0, ack_timeout: float = 0.05,
             retry_count: int = 7, rnr_retry: int = 7, rnr_timer: int = 16, window: int = 128,
             frame_listeners: Iterable = (), connect_timeout: float = 5.0, io: str = "udp",
             iface: str | None = None, addr: str | None = None, udp_checksum: bool = False,
             traffic_class: int = 0, udp_port: int = ROCE_PORT,
             peer_udp_port: int = ROCE_PORT, cm_timeout: float = 1.0, cm_retries: int = 2,
             half_open: HalfOpen | None = None
             ) -> tuple[dict, float, dict, tuple[int, int], dict]:
    """QP options, the connection timeout, the I/O backend's options, the ports and the
    listener's set-up limits.

    ``io="raw"`` sends whole frames on interface ``iface`` as ``addr`` ("IP" or "IP/MAC"),
    with UDP checksums when ``udp_checksum`` and IP TOS / Traffic Class ``traffic_class``
    (ECN bits included); see ``roce_raw.RawIO``. ``udp_port`` is the device's own UDP
    port and ``peer_udp_port`` the one every packet goes to: both 4791 but in tests that
    put two devices on one address (IPv6 loopback). A listener resends REP every
    ``cm_timeout`` seconds, ``cm_retries`` times, and takes a slot of ``half_open`` for
    each connection in set-up (``rnic/admission.py``)."""
    if mtu and mtu not in MTUS:
        raise ValueError(f"mtu must be one of {MTUS}")
    if not 0 <= rnr_retry <= 7 or not 0 <= retry_count <= 7 or not 0 <= rnr_timer <= 31:
        raise ValueError("retry_count and rnr_retry are 3-bit, rnr_timer a 5-bit code")
    if cm_timeout <= 0 or cm_retries < 0:
        raise ValueError("cm_timeout must be positive and cm_retries at least 0")
    if io == "raw":
        if not iface or not addr:
            raise ValueError("io='raw' needs iface and addr")
        from .roce_raw import parse_addr
        parse_addr(addr)
        io_options = {"io": "raw", "iface": iface, "addr": addr,
                      "udp_checksum": bool(udp_checksum), "traffic_class": traffic_class}
    elif io == "udp":
        if iface or addr or udp_checksum or traffic_class:
            raise ValueError("iface, addr, udp_checksum and traffic_class need io='raw'")
        io_options = {}
    else:
        raise ValueError(f"io must be 'udp' or 'raw', not {io!r}")

    return ({"recv_size": recv_size, "posted": posted, "mtu": mtu, "ack_timeout": ack_timeout,
             "retry_count": retry_count, "rnr_retry": rnr_retry, "rnr_timer": rnr_timer,
             "window": window, "frame_listeners": tuple(frame_listeners)}, connect_timeout,
            io_options, (udp_port, peer_udp_port),
            {"cm_timeout": cm_timeout, "cm_retries": cm_retries, "half_open": half_open})


def default_local(host: str) -> str:
    """The local address ``connect`` prefers: on IPv4 loopback a different address than the
    target's, so both may own UDP port 4791 (127.0.0.2 for 127.0.0.1, else 127.0.0.1; when
    that one's port is taken, ``connect`` picks a free one);
    elsewhere the source address the kernel would route from (no packet is sent)."""
    addr = ipaddress.ip_address(host)
    if addr.is_loopback:
        if addr.version == 6:
            return "::1"
        return "127.0.0.2" if host == "127.0.0.1" else "127.0.0.1"
    with socket.socket(socket.AF_INET6 if addr.version == 6 else socket.AF_INET,
                       socket.SOCK_DGRAM) as probe:
        probe.connect((host, ROCE_PORT))
        own = probe.getsockname()[0]
    if own == str(addr):
        raise OSError(errno.EADDRINUSE, f"{host} is an address of this host, and RoCEv2 puts "
                                        "both ends on UDP port 4791: send from another "
                                        "address of the host (local=, --local ADDR)")
    return own


#: random loopback sources tried when the default one's UDP port is taken
LOOPBACK_TRIES = 32
_noted: set[str] = set()       # defaults found taken and said so, once per process


async def _source(host: str, local: str | None, udp_port: int, io: dict, peer_port: int) -> Device:
    """The started device to connect from: ``local``'s; or, to an IPv4 loopback target with
    no ``local``, the first of the default source and random 127.0.0.0/8 addresses whose
    UDP port is free, so that two users or CI jobs on one host never collide at UDP 4791
    (a device of this process at that address is shared, as always)."""
    if local is not None or io or ipaddress.ip_address(host).version != 4 \
            or not ipaddress.ip_address(host).is_loopback:
        dev = _device(str(ipaddress.ip_address(local or default_local(host))), udp_port, io, peer_port)
        await _started(dev)
        return dev
    preferred = default_local(host)
    tries = [preferred] + [f"127.{secrets.randbelow(256)}.{secrets.randbelow(256)}."
                           f"{secrets.randbelow(254) + 1}" for _ in range(LOOPBACK_TRIES)]
    for candidate in (c for c in tries if c != host):
        try:
            dev = _device(candidate, udp_port, io, peer_port)
            await _started(dev)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            continue
        if candidate != preferred and preferred not in _noted:
            _noted.add(preferred)
            log.warning("note: %s UDP port %d is taken; sending from %s instead (choose one "
                        "with --local ADDR)", preferred, udp_port, candidate)
        return dev
    raise OSError(errno.EADDRINUSE, f"UDP port {udp_port} is taken on {preferred} and on "
                                    f"{LOOPBACK_TRIES} other loopback addresses")


async def connect(host: str, port: int, memory: MemoryTable, *, local: str | None = None,
                  **options) -> RoceQP:
    """REQ, REP, RTU with the listener of rdma_cm port ``port`` at ``host``; returns an
    established QP. The CM MADs and the connection's packets go to UDP port 4791 of
    ``host`` (``peer_udp_port``); with ``io="raw"`` the local address is ``addr``'s IP.
    Raises ``ConnectionRefusedError`` on REJ and ``TimeoutError`` when no REP comes (or,
    raw, no ARP or NDP answer) within ``connect_timeout``."""
    qp_options, timeout, io, (udp_port, peer_port), _ = _options(**options)
    host = str(ipaddress.ip_address(host))
    if io:
        from .roce_raw import parse_addr
        own = parse_addr(io["addr"])[0]
        if local is not None and str(ipaddress.ip_address(local)) != own:
            raise ValueError(f"local {local} is not the raw endpoint's address {own}")
        local = own
    dev = await _source(host, local, udp_port, io, peer_port)
    dev.io.report_refusals()
    local = dev.address[0]
    target = (host, peer_port)
    try:
        await asyncio.wait_for(dev.io.resolve(host, timeout), timeout)
        qp_options["mtu"] = qp_options["mtu"] or dev.io.path_mtu(host, peer_port)
        qp = RoceQP(memory, dev, **qp_options)
    finally:
        dev.release()          # the QP holds the device from here, or nothing does
    dev.conns[qp.comm_id] = qp
    loop = dev.loop
    cm_port = secrets.randbelow(61000 - 32768) + 32768    # our rdma_cm port, as Linux picks one
    req = cm.CmMessage(
        cm.CmAttr.REQ, secrets.randbits(64), local_comm_id=qp.comm_id,
        service_id=cm.rdma_cm_service_id(port), local_qpn=qp.qpn, starting_psn=qp.start_psn,
        path_mtu=qp.mtu, responder_resources=RESOURCES, initiator_depth=RESOURCES,
        local_gid=local, remote_gid=host, retry_count=qp.retry_count,
        rnr_retry_count=qp.rnr_retry,
        flow_label=cm.rdma_cm_flow_label(cm_port, port),
        private_data=cm.rdma_cm_private_data(local, host, cm_port))
    future = loop.create_future()
    dev.connecting[qp.comm_id] = future, target
    deadline = loop.time() + timeout
    try:
        while not future.done():
            dev.send_mad(req, target, qp.frame_listeners)
            wait = min(CM_INTERVAL, deadline - loop.time())
            if wait <= 0:
                raise TimeoutError(f"no CM REP from roce://{host}:{port} within {timeout:g} s "
                                   f"(no RoCEv2 target there, or UDP {peer_port} blocked?)")
            await asyncio.wait([future], timeout=wait)
        rep, addr = future.result()
    except BaseException:
        qp.lost(ConnectionLost("connection set-up failed"))
        raise
    finally:
        dev.connecting.pop(qp.comm_id, None)
    if rep.attr == cm.CmAttr.REJ:
        qp.lost(ConnectionLost("rejected"))
        reason = "no listener on that rdma_cm port" if rep.reject_reason == 8 else \
            f"reason {rep.reject_reason}"
        raise ConnectionRefusedError(f"roce://{host}:{port} rejected the REQ ({reason})")
    qp.setup(addr, rep.local_qpn, rep.starting_psn, qp.mtu)
    dev.bind(qp, addr)
    qp.remote_comm_id = rep.local_comm_id
    dev._rtu(qp, rep)
    qp.establish()
    return qp


async def listen(host: str, port: int, memory: MemoryTable,
                 on_connect: Callable[[RoceQP], Coroutine[Any, Any, None]], **options) -> RoceListener:
    """Accept connections for rdma_cm port ``port`` at ``host`` (UDP 4791, or
    ``udp_port``); with ``io="raw"``, ``host`` is ``addr``'s IP."""
    qp_options, _, io, (udp_port, peer_port), setup = _options(**options)
    if ipaddress.ip_address(host).is_unspecified:
        raise ValueError("listen on a specific address: the ICRC covers it (annex A17)")
    if not 0 < port < 65536:
        raise ValueError("the rdma_cm port must be 1 to 65535")
    dev = _device(host, udp_port, io, peer_port)
    await _started(dev)        # the use _device took is the listener's
    listener = RoceListener(dev, port, memory, on_connect, qp_options, setup)
    if listener.service_id in dev.services:
        dev.release()
        raise OSError(errno.EADDRINUSE, f"roce://{host}:{port} already has a listener")
    dev.services[listener.service_id] = listener
    return listener
