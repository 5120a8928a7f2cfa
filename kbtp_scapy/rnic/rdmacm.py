"""librdmacm's connection manager, asynchronously, for the verbs backend.

rdma-core's Python bindings (pyverbs) drive the verbs themselves, but their rdma_cm
objects are made for synchronous use: an event does not say which connection it is for
and the event channel's file descriptor is not exposed, so a server with several
connections cannot be written on them, nor can an event loop wait for events. This module
binds the few librdmacm calls a connection needs with ctypes, one event channel per event
loop, and hands each event to the ``CmId`` it names. The QPs are pyverbs objects created
by the caller and driven through their states as librdmacm drives its own QPs
(``rdma_init_qp_attr``, then ``ibv_modify_qp``), passing their numbers in the connection
parameters.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import enum
import errno
import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Callable

RDMA_PS_TCP = 0x0106
RDMA_MAX_RESP_RES = RDMA_MAX_INIT_DEPTH = 0xFF


class Event(enum.IntEnum):
    """``enum rdma_cm_event_type``."""

    ADDR_RESOLVED = 0
    ADDR_ERROR = 1
    ROUTE_RESOLVED = 2
    ROUTE_ERROR = 3
    CONNECT_REQUEST = 4
    CONNECT_RESPONSE = 5
    CONNECT_ERROR = 6
    UNREACHABLE = 7
    REJECTED = 8
    ESTABLISHED = 9
    DISCONNECTED = 10
    DEVICE_REMOVAL = 11
    MULTICAST_JOIN = 12
    MULTICAST_ERROR = 13
    ADDR_CHANGE = 14
    TIMEWAIT_EXIT = 15


class _Gid(ctypes.Structure):
    _fields_ = [("subnet_prefix", ctypes.c_uint64), ("interface_id", ctypes.c_uint64)]


class _SockaddrStorage(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 16)]       # 128 octets, 8-aligned


class _IbAddr(ctypes.Structure):
    _fields_ = [("sgid", _Gid), ("dgid", _Gid), ("pkey", ctypes.c_uint16)]


class _Route(ctypes.Structure):
    _fields_ = [("src", _SockaddrStorage), ("dst", _SockaddrStorage), ("ibaddr", _IbAddr),
                ("path_rec", ctypes.c_void_p), ("num_paths", ctypes.c_int)]


class _Channel(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int)]


class _CmId(ctypes.Structure):
    _fields_ = [("verbs", ctypes.c_void_p), ("channel", ctypes.POINTER(_Channel)),
                ("context", ctypes.c_void_p), ("qp", ctypes.c_void_p), ("route", _Route),
                ("ps", ctypes.c_int), ("port_num", ctypes.c_uint8)]


class ConnParam(ctypes.Structure):
    """``struct rdma_conn_param``."""

    _fields_ = [("private_data", ctypes.c_void_p), ("private_data_len", ctypes.c_uint8),
                ("responder_resources", ctypes.c_uint8), ("initiator_depth", ctypes.c_uint8),
                ("flow_control", ctypes.c_uint8), ("retry_count", ctypes.c_uint8),
                ("rnr_retry_count", ctypes.c_uint8), ("srq", ctypes.c_uint8),
                ("qp_num", ctypes.c_uint32)]


class _UdParam(ctypes.Structure):       # only for the union's size
    _fields_ = [("private_data", ctypes.c_void_p), ("rest", ctypes.c_uint8 * 48)]


class _Param(ctypes.Union):
    _fields_ = [("conn", ConnParam), ("ud", _UdParam)]


class _Event(ctypes.Structure):
    _fields_ = [("id", ctypes.POINTER(_CmId)), ("listen_id", ctypes.POINTER(_CmId)),
                ("event", ctypes.c_int), ("status", ctypes.c_int), ("param", _Param)]


class _AhAttr(ctypes.Structure):
    _fields_ = [("dgid", ctypes.c_uint8 * 16), ("flow_label", ctypes.c_uint32),
                ("sgid_index", ctypes.c_uint8), ("hop_limit", ctypes.c_uint8),
                ("traffic_class", ctypes.c_uint8), ("dlid", ctypes.c_uint16),
                ("sl", ctypes.c_uint8), ("src_path_bits", ctypes.c_uint8),
                ("static_rate", ctypes.c_uint8), ("is_global", ctypes.c_uint8),
                ("port_num", ctypes.c_uint8)]


class QpAttr(ctypes.Structure):
    """``struct ibv_qp_attr`` as ``rdma_init_qp_attr`` fills it."""

    _fields_ = [("qp_state", ctypes.c_int), ("cur_qp_state", ctypes.c_int),
                ("path_mtu", ctypes.c_int), ("path_mig_state", ctypes.c_int),
                ("qkey", ctypes.c_uint32), ("rq_psn", ctypes.c_uint32),
                ("sq_psn", ctypes.c_uint32), ("dest_qp_num", ctypes.c_uint32),
                ("qp_access_flags", ctypes.c_uint), ("cap", ctypes.c_uint32 * 5),
                ("ah_attr", _AhAttr), ("alt_ah_attr", _AhAttr),
                ("pkey_index", ctypes.c_uint16), ("alt_pkey_index", ctypes.c_uint16),
                ("en_sqd_async_notify", ctypes.c_uint8), ("sq_draining", ctypes.c_uint8),
                ("max_rd_atomic", ctypes.c_uint8), ("max_dest_rd_atomic", ctypes.c_uint8),
                ("min_rnr_timer", ctypes.c_uint8), ("port_num", ctypes.c_uint8),
                ("timeout", ctypes.c_uint8), ("retry_cnt", ctypes.c_uint8),
                ("rnr_retry", ctypes.c_uint8), ("alt_port_num", ctypes.c_uint8),
                ("alt_timeout", ctypes.c_uint8), ("rate_limit", ctypes.c_uint32)]


class CmError(OSError):
    """A librdmacm call failed; ``errno`` says why."""


_lib: ctypes.CDLL | None = None
_verbs: ctypes.CDLL | None = None


def _load() -> ctypes.CDLL:
    global _lib, _verbs
    if _lib is None:
        name = ctypes.util.find_library("rdmacm") or "librdmacm.so.1"
        try:
            lib = ctypes.CDLL(name, use_errno=True)
            verbs = ctypes.CDLL(ctypes.util.find_library("ibverbs") or "libibverbs.so.1")
        except OSError as exc:
            raise CmError(errno.ENOENT, f"librdmacm is not installed ({exc}): "
                                        "apt-get install rdma-core librdmacm1") from None
        P = ctypes.POINTER
        for fn, args, res in [
            ("rdma_create_event_channel", [], P(_Channel)),
            ("rdma_destroy_event_channel", [P(_Channel)], None),
            ("rdma_create_id", [P(_Channel), P(P(_CmId)), ctypes.c_void_p, ctypes.c_int], ctypes.c_int),
            ("rdma_destroy_id", [P(_CmId)], ctypes.c_int),
            ("rdma_bind_addr", [P(_CmId), ctypes.c_void_p], ctypes.c_int),
            ("rdma_listen", [P(_CmId), ctypes.c_int], ctypes.c_int),
            ("rdma_resolve_addr", [P(_CmId), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int], ctypes.c_int),
            ("rdma_resolve_route", [P(_CmId), ctypes.c_int], ctypes.c_int),
            ("rdma_connect", [P(_CmId), P(ConnParam)], ctypes.c_int),
            ("rdma_accept", [P(_CmId), P(ConnParam)], ctypes.c_int),
            ("rdma_reject", [P(_CmId), ctypes.c_void_p, ctypes.c_uint8], ctypes.c_int),
            ("rdma_establish", [P(_CmId)], ctypes.c_int),
            ("rdma_disconnect", [P(_CmId)], ctypes.c_int),
            ("rdma_get_cm_event", [P(_Channel), P(P(_Event))], ctypes.c_int),
            ("rdma_ack_cm_event", [P(_Event)], ctypes.c_int),
            ("rdma_init_qp_attr", [P(_CmId), P(QpAttr), P(ctypes.c_int)], ctypes.c_int),
            ("rdma_set_option", [P(_CmId), ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                 ctypes.c_size_t], ctypes.c_int),
            ("rdma_event_str", [ctypes.c_int], ctypes.c_char_p),
        ]:
            f = getattr(lib, fn)
            f.argtypes, f.restype = args, res
        verbs.ibv_get_device_name.argtypes = [ctypes.c_void_p]
        verbs.ibv_get_device_name.restype = ctypes.c_char_p
        _lib, _verbs = lib, verbs
    return _lib


def libverbs() -> ctypes.CDLL:
    """libibverbs, loaded with librdmacm by ``_load``."""
    _load()
    assert _verbs is not None
    return _verbs


def _check(ret: int, what: str) -> None:
    if ret != 0:
        code = ctypes.get_errno()
        raise CmError(code, f"{what}: {os.strerror(code) if code else 'failed'}")


def sockaddr(host: str, port: int) -> ctypes.Array:
    """A ``struct sockaddr_in`` or ``sockaddr_in6`` for librdmacm."""
    ip = ipaddress.ip_address(host)
    if ip.version == 4:
        raw = struct.pack("=H", socket.AF_INET) + struct.pack("!H", port) + ip.packed + bytes(8)
    else:
        raw = struct.pack("=H", socket.AF_INET6) + struct.pack("!HI", port, 0) + ip.packed + bytes(4)
    return ctypes.create_string_buffer(raw, 128)


def _unsockaddr(storage: _SockaddrStorage) -> tuple[str, int]:
    raw = bytes(storage)
    family = struct.unpack_from("=H", raw)[0]
    port = struct.unpack_from("!H", raw, 2)[0]
    if family == socket.AF_INET:
        return str(ipaddress.IPv4Address(raw[4:8])), port
    if family == socket.AF_INET6:
        return str(ipaddress.IPv6Address(raw[8:24])), port
    return "", 0


class CmId:
    """One ``rdma_cm_id``: a listener or one connection. Events for it go to ``on_event``."""

    def __init__(self, channel: Channel, ptr: ctypes._Pointer | None = None) -> None:
        self.channel = channel
        if ptr is None:
            ptr = ctypes.POINTER(_CmId)()
            _check(_load().rdma_create_id(channel.ptr, ctypes.byref(ptr), None, RDMA_PS_TCP),
                   "rdma_create_id")
        self.ptr = ptr
        self.on_event: Callable[[CmEvent], None] | None = None
        channel.ids[ctypes.addressof(ptr.contents)] = self

    # -- what the id is bound to ---------------------------------------------------------

    @property
    def device_name(self) -> str | None:
        """The RDMA device this id is bound to (after bind, address resolution or a
        connection request)."""
        verbs = self.ptr.contents.verbs
        if not verbs:
            return None
        device = ctypes.c_void_p.from_address(verbs).value   # ibv_context.device comes first
        return libverbs().ibv_get_device_name(device).decode()

    @property
    def port_num(self) -> int:
        return self.ptr.contents.port_num

    @property
    def local(self) -> tuple[str, int]:
        return _unsockaddr(self.ptr.contents.route.src)

    @property
    def remote(self) -> tuple[str, int]:
        return _unsockaddr(self.ptr.contents.route.dst)

    # -- calls -----------------------------------------------------------------------------

    def bind(self, host: str, port: int) -> None:
        _check(_load().rdma_bind_addr(self.ptr, sockaddr(host, port)), f"bind to {host}:{port}")

    def listen(self, backlog: int = 64) -> None:
        _check(_load().rdma_listen(self.ptr, backlog), "rdma_listen")

    def resolve_addr(self, src: str | None, dst: str, port: int, timeout_ms: int) -> None:
        _check(_load().rdma_resolve_addr(self.ptr, sockaddr(src, 0) if src else None,
                                         sockaddr(dst, port), timeout_ms),
               f"resolving {dst}")

    def resolve_route(self, timeout_ms: int) -> None:
        _check(_load().rdma_resolve_route(self.ptr, timeout_ms), "rdma_resolve_route")

    def connect(self, param: ConnParam) -> None:
        _check(_load().rdma_connect(self.ptr, ctypes.byref(param)), "rdma_connect")

    def accept(self, param: ConnParam) -> None:
        _check(_load().rdma_accept(self.ptr, ctypes.byref(param)), "rdma_accept")

    def reject(self) -> None:
        _load().rdma_reject(self.ptr, None, 0)

    def establish(self) -> None:
        _check(_load().rdma_establish(self.ptr), "rdma_establish")

    def disconnect(self) -> bool:
        """DREQ (RoCE) or FIN (iWARP); False when there is no connection to end."""
        return _load().rdma_disconnect(self.ptr) == 0

    def init_qp_attr(self, state: int) -> tuple[QpAttr, int]:
        """The attributes (and mask) the CM says a QP moving to ``state`` needs."""
        attr, mask = QpAttr(), ctypes.c_int(0)
        attr.qp_state = state
        _check(_load().rdma_init_qp_attr(self.ptr, ctypes.byref(attr), ctypes.byref(mask)),
               "rdma_init_qp_attr")
        return attr, mask.value

    def destroy(self) -> None:
        if self.ptr:
            self.channel.ids.pop(ctypes.addressof(self.ptr.contents), None)
            _load().rdma_destroy_id(self.ptr)
            self.ptr = ctypes.POINTER(_CmId)()


class CmEvent:
    """What an event carried, copied out before it is acknowledged."""

    def __init__(self, raw: _Event, channel: Channel) -> None:
        self.type = Event(raw.event) if raw.event in Event._value2member_map_ else raw.event
        self.status = raw.status
        self.id_address = ctypes.addressof(raw.id.contents) if raw.id else 0
        self.listen_address = ctypes.addressof(raw.listen_id.contents) if raw.listen_id else 0
        conn = raw.param.conn
        self.responder_resources = conn.responder_resources
        self.initiator_depth = conn.initiator_depth
        self.new_id: CmId | None = None
        if self.type == Event.CONNECT_REQUEST and raw.id:
            self.new_id = CmId(channel, ctypes.pointer(raw.id.contents))

    def __str__(self) -> str:
        name = self.type.name if isinstance(self.type, Event) else str(self.type)
        if self.status:
            reason = os.strerror(-self.status) if self.status < 0 else f"status {self.status}"
            return f"{name} ({reason})"
        return name


class Channel:
    """One ``rdma_event_channel``, non-blocking, read when its descriptor is readable."""

    def __init__(self) -> None:
        lib = _load()
        self.ptr = lib.rdma_create_event_channel()
        if not self.ptr:
            code = ctypes.get_errno()
            raise CmError(code, "cannot open /dev/infiniband/rdma_cm: "
                                f"{os.strerror(code) if code else 'no RDMA CM'} "
                                "(is the rdma_ucm module loaded?)")
        self.fd = self.ptr.contents.fd
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) | os.O_NONBLOCK)
        self.ids: dict[int, CmId] = {}

    def dispatch(self) -> None:
        """Take every pending event, acknowledge it, and hand it to its id."""
        lib = _load()
        while self.ptr:
            raw = ctypes.POINTER(_Event)()
            if lib.rdma_get_cm_event(self.ptr, ctypes.byref(raw)) != 0:
                return      # EAGAIN: nothing more now
            try:
                event = CmEvent(raw.contents, self)
            finally:
                lib.rdma_ack_cm_event(raw)
            owner = self.ids.get(event.listen_address if event.new_id else event.id_address)
            if owner is not None and owner.on_event is not None:
                owner.on_event(event)
            elif event.new_id is not None:
                event.new_id.reject()
                event.new_id.destroy()

    def close(self) -> None:
        if self.ptr:
            for cm_id in list(self.ids.values()):
                cm_id.destroy()
            _load().rdma_destroy_event_channel(self.ptr)
            self.ptr = ctypes.POINTER(_Channel)()
