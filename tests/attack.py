"""An attacker of KBTP targets that shares no code with them (issue 23).

Every octet it sends is framed here from the published texts alone, with the standard library:
KBTP from the specification and ``NOTES.md`` section 2, MPA (RFC 5044, v2 of RFC 6581), DDP
(RFC 5041) and RDMAP (RFC 5040) on a TCP socket, and RoCEv2 (InfiniBand Architecture
Specification, Annex A17: BTH, DETH, AETH, the ICRC; chapter 12: the CM MADs; rdma_cm's
private data) on a UDP socket. It imports nothing of ``kbtp_scapy`` and none of the test
helpers that do (``tests/test_attack.py`` checks that), so a defence the target has can only
be shown by the target's behaviour, and a framing mistake the target shares with its own
client cannot hide one. The well-behaved clients of the attack tests are the project's
``Initiator``: they are the users the attacks must not hurt.
"""
from __future__ import annotations

import asyncio
import secrets
import socket
import struct
import threading
import time
import zlib

# -- CRC32c (Castagnoli, RFC 3385), for MPA -------------------------------------------

_POLY = 0x82F63B78            # the reflected Castagnoli polynomial


def _table() -> list[int]:
    out = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ _POLY if c & 1 else c >> 1
        out.append(c)
    return out


_CRC32C = _table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for octet in data:
        crc = _CRC32C[(crc ^ octet) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


# -- KBTP messages (NOTES.md section 2) ------------------------------------------------

HELLO, HELLO_ACK, LOAD, STORE, ALLOC_STORE, FREE, COMPLETION, GOODBYE = (
    0x01, 0x02, 0x10, 0x11, 0x12, 0x13, 0x20, 0x30)
INLINE, SEAL, INVALIDATE = 0x0001, 0x0002, 0x0008
RELEASE = 0x0001
DIRECT_LOAD, DIRECT_ALLOC = 0x0001, 0x0002
STATUS = {0: "OK", 1: "INVALID_HANDLE", 2: "STALE_GENERATION", 3: "NOT_VALID", 4: "ALREADY_BOUND",
          5: "NO_SPACE", 6: "SEALED", 7: "NOT_SEALED", 8: "TOO_LARGE", 9: "MALFORMED",
          10: "INTERNAL", 11: "TICKET_ABANDONED"}        # the specification's "Status Codes"
_HEAD = struct.Struct(">BBHQQHH")        # Version, Opcode, Flags, Request ID, Handle, Generation, Status
_DESC = struct.Struct(">IQI")            # STag, Tagged Offset, Length (or Count, or reserved)
_ACK = struct.Struct(">HHIIIQII")        # HELLO_ACK's body before its descriptors


def header(opcode: int, flags: int = 0, request_id: int = 0, handle: int = 0) -> bytes:
    return _HEAD.pack(1, opcode, flags, request_id, handle, 0, 0)


def hello(initiator_id: bytes | None = None, credits: int = 32, features: int = 0) -> bytes:
    return header(HELLO) + struct.pack(">HH16s", features, credits,
                                       initiator_id or secrets.token_bytes(16))


def goodbye(release: bool = True) -> bytes:
    return header(GOODBYE, RELEASE if release else 0)


def free(request_id: int, handle: int) -> bytes:
    return header(FREE, 0, request_id, handle)


def load(request_id: int, handle: int, stag: int = 0, offset: int = 0, length: int = 4096,
         flags: int = 0) -> bytes:
    """LOAD into the initiator's buffer (``stag``, ``offset``, ``length``)."""
    return header(LOAD, flags, request_id, handle) + _DESC.pack(stag, offset, length)


def alloc_store(request_id: int, handle: int, data: bytes, seal: bool = False) -> bytes:
    """ALLOC_STORE with the data inline: STag and Tagged Offset zero, Length the data's."""
    return (header(ALLOC_STORE, INLINE | (SEAL if seal else 0), request_id, handle)
            + _DESC.pack(0, 0, len(data)) + data)


def parse(message: bytes) -> dict:
    """The common header's fields of any KBTP message, and a HELLO_ACK's or COMPLETION's body."""
    if len(message) < _HEAD.size:
        return {"short": message.hex()}
    _, opcode, flags, rid, handle, generation, status = _HEAD.unpack_from(message)
    out = {"size": len(message), "opcode": opcode, "flags": flags, "request_id": rid, "handle": handle,
           "generation": generation, "status": STATUS.get(status, hex(status))}
    if opcode == HELLO_ACK and len(message) >= _HEAD.size + _ACK.size:
        names = ("features", "credits", "block_size", "max_inline", "quota", "handle_base",
                 "handle_count", "ticket_timeout")
        out.update(zip(names, _ACK.unpack_from(message, _HEAD.size)))
        at = _HEAD.size + _ACK.size
        if out["features"] & DIRECT_LOAD and len(message) >= at + 48:
            # Table descriptor, Table Base Handle, 8 reserved octets, Pool descriptor
            out["table"] = _DESC.unpack_from(message, at)
            out["pool"] = _DESC.unpack_from(message, at + 32)
            at += 48
        if out["features"] & DIRECT_ALLOC and len(message) >= at + 48:
            # Partition (Count: the quota), Ring (Count: N) and Head (Count: 1) descriptors
            out["partition"], out["ring"], out["head"] = (_DESC.unpack_from(message, at + k) for k in (0, 16, 32))
    elif opcode == COMPLETION and len(message) >= 40:
        out["length"], _, out["block_offset"] = struct.unpack_from(">IIQ", message, _HEAD.size)
    return out


# -- iWARP: MPA, DDP, RDMAP ------------------------------------------------------------

WRITE, READ_REQUEST, READ_RESPONSE, SEND, SEND_INV, SEND_SE, SEND_SE_INV, TERMINATE = range(8)
ATOMIC_REQUEST, ATOMIC_RESPONSE, FETCH_ADD = 10, 11, 0       # RFC 7306
SENDS = (SEND, SEND_INV, SEND_SE, SEND_SE_INV)
_MPA_CRC, _MPA_ENHANCED = 0x40, 0x10           # MPA frame flags (RFC 5044, RFC 6581)
_P2P, _WRITE_RTR = 0x8000, 0x8000              # RFC 6581 section 5: IRD's and ORD's top bits
_TAGGED, _LAST, _DDP_V1, _RDMAP_V1 = 0x80, 0x40, 0x01, 0x40
UNTAGGED_LEN, TAGGED_LEN = 18, 14              # DDP + RDMAP headers (RFC 5041 section 4)


def mpa_request(ird: int = 16, ord_: int = 16) -> bytes:
    """An MPA v2 Request with CRCs, no markers, peer-to-peer with a zero-length Write as RTR."""
    private = struct.pack(">HH", _P2P | ird, _WRITE_RTR | ord_)
    return b"MPA ID Req Frame" + bytes([_MPA_CRC | _MPA_ENHANCED, 2]) + struct.pack(">H", len(private)) + private


def fpdu(ulpdu: bytes) -> bytes:
    """MPA framing: the ULPDU's length, the ULPDU, pad to four octets, CRC32c LSB first."""
    framed = struct.pack(">H", len(ulpdu)) + ulpdu
    framed += bytes(-len(framed) % 4)
    return framed + struct.pack("<I", crc32c(framed))


def untagged(opcode: int, queue: int, msn: int, payload: bytes, offset: int = 0) -> bytes:
    return fpdu(struct.pack(">BBIIII", _LAST | _DDP_V1, _RDMAP_V1 | opcode, 0, queue, msn, offset)
                + payload)


def tagged(opcode: int, stag: int, offset: int, payload: bytes) -> bytes:
    return fpdu(struct.pack(">BBIQ", _TAGGED | _LAST | _DDP_V1, _RDMAP_V1 | opcode, stag, offset)
                + payload)


def send(message: bytes, msn: int) -> bytes:
    """A Send on queue 0; ``msn`` counts Sends from 1."""
    return untagged(SEND, 0, msn, message)


def rtr() -> bytes:
    """The ready-to-receive of RFC 6581: a zero-length RDMA Write."""
    return tagged(WRITE, 0, 0, b"")


def read_request(msn: int, stag: int, offset: int, size: int, sink: int = 0x77) -> bytes:
    """An RDMA Read Request (queue 1, RFC 5040 section 4.4): ``size`` octets at (``stag``,
    ``offset``) into the sink STag ``sink``; ``msn`` counts Read Requests from 1."""
    return untagged(READ_REQUEST, 1, msn, struct.pack(">IQIIQ", sink, 0, size, stag, offset))


def atomic_fetch_add(msn: int, request_id: int, stag: int, offset: int, add: int, mask: int = 0) -> bytes:
    """An RFC 7306 FetchAdd (queue 1, counted with the Read Requests): ``add`` added to the
    64 bits at (``stag``, ``offset``), a carry stopped above each bit set in ``mask``."""
    return untagged(ATOMIC_REQUEST, 1, msn, struct.pack(">IIIQQQQQ", FETCH_ADD, request_id, stag, offset,
                                                       add, mask, 0, 0))


def ring_add_mask(slots: int) -> int:
    """The Add Mask of the ring counters (NOTES.md section 2) for a ring of ``slots`` = 2**n."""
    n = slots.bit_length() - 1
    return 1 << 63 | 1 << 31 | 1 << (n + 3)


TICKET_ADD = 0x0000000100000010        # one ticket, one 16-octet slot


class Fpdu:
    """One FPDU as it came: RDMAP opcode, tagged or not, Last, the STag (tagged) and payload."""

    def __init__(self, ulpdu: bytes) -> None:
        self.tagged, self.last = bool(ulpdu[0] & _TAGGED), bool(ulpdu[0] & _LAST)
        self.opcode = ulpdu[1] & 0x0F
        self.stag = struct.unpack_from(">I", ulpdu, 2)[0] if self.tagged else None
        self.payload = ulpdu[TAGGED_LEN if self.tagged else UNTAGGED_LEN:]

    def __repr__(self) -> str:
        return f"Fpdu(opcode={self.opcode}, tagged={self.tagged}, {len(self.payload)} octets)"


class MpaStream:
    """A TCP connection that has done the MPA exchange and sent the RTR."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.msn = self.read_msn = 0         # Sends; Read and Atomic Requests

    @classmethod
    async def open(cls, host: str, port: int, local: str | None = None, timeout: float = 5,
                   rtr_after: float = 0.0) -> MpaStream:
        """Connected: TCP, the MPA Request and Reply, and the RTR ``rtr_after`` seconds
        after the Reply."""
        reader, writer = await asyncio.open_connection(host, port,
                                                       local_addr=(local, 0) if local else None)
        writer.write(mpa_request())
        await cls.read_reply(reader, timeout)
        await asyncio.sleep(rtr_after)
        writer.write(rtr())
        return cls(reader, writer)

    @staticmethod
    async def read_reply(reader: asyncio.StreamReader, timeout: float) -> bytes:
        reply = await asyncio.wait_for(reader.readexactly(20), timeout)
        assert reply[:16] == b"MPA ID Rep Frame", reply
        assert not reply[16] & 0x20, f"MPA Reply with Reject: {reply.hex()}"
        return await asyncio.wait_for(reader.readexactly(struct.unpack(">H", reply[18:20])[0]), timeout)

    @property
    def closed(self) -> bool:
        """The target ended the connection (seen even while reading is paused)."""
        return self.writer.transport.is_closing() or self.reader.at_eof()

    async def wait_closed(self, timeout: float) -> bool:
        """Read (and drop) what comes until the target ends the connection or ``timeout``
        passes: whether it ended."""
        await self.fpdus(timeout)
        return self.closed

    def say(self, message: bytes) -> None:
        """A KBTP message as a Send."""
        self.msn += 1
        self.writer.write(send(message, self.msn))

    async def next(self, timeout: float) -> Fpdu:
        """The next FPDU, its CRC checked; TimeoutError, IncompleteReadError at the end."""
        length = await asyncio.wait_for(self.reader.readexactly(2), timeout)
        ulen = struct.unpack(">H", length)[0]
        rest = await asyncio.wait_for(self.reader.readexactly(ulen + -(2 + ulen) % 4 + 4), 5)
        framed = length + rest
        assert crc32c(framed[:-4]) == struct.unpack("<I", framed[-4:])[0], f"bad CRC: {framed[:24].hex()}"
        return Fpdu(framed[2:2 + ulen])

    async def fpdus(self, timeout: float, limit: int | None = None) -> list[Fpdu]:
        """Every FPDU until the stream ends, ``timeout`` passes or ``limit`` came."""
        out: list[Fpdu] = []
        end = time.monotonic() + timeout
        try:
            while time.monotonic() < end and (limit is None or len(out) < limit):
                out.append(await self.next(end - time.monotonic()))
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass
        return out

    async def message(self, timeout: float = 5) -> dict:
        """The next KBTP message the target sent (the next Send): its fields."""
        end = time.monotonic() + timeout
        while True:
            f = await self.next(max(0.0, end - time.monotonic()))
            if f.opcode in SENDS:
                return parse(f.payload)

    async def fetch_add(self, descriptor: tuple[int, int, int], slots: int) -> int:
        """A ticket: masked FetchAdd on the ring counter ``descriptor`` names; its old value."""
        self.read_msn += 1
        stag, offset, _ = descriptor
        self.writer.write(atomic_fetch_add(self.read_msn, self.read_msn, stag, offset, TICKET_ADD,
                                           ring_add_mask(slots)))
        while True:
            f = await self.next(5)
            if f.opcode == ATOMIC_RESPONSE:
                rid, value = struct.unpack_from(">IQ", f.payload)
                assert rid == self.read_msn, (rid, self.read_msn)
                return value
            assert f.opcode != TERMINATE, f"Terminate: {f.payload.hex()}"

    async def session(self, initiator_id: bytes | None = None, features: int = 0,
                      credits: int = 32) -> dict:
        """HELLO; the HELLO_ACK's fields."""
        self.say(hello(initiator_id, credits, features))
        for f in await self.fpdus(5, limit=1):
            return parse(f.payload)
        raise AssertionError("no HELLO_ACK within 5 s")

    async def end(self) -> None:
        """The TCP connection closed, without GOODBYE unless one was said."""
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except ConnectionError:
            pass


# -- RoCEv2: BTH, DETH, AETH, ICRC over UDP port 4791 ---------------------------------

ROCE_PORT = 4791
UD_SEND_ONLY, RC_SEND_ONLY, RC_SEND_ONLY_IMM, RC_ACK, RC_READ_REQUEST = 0x64, 0x04, 0x05, 0x11, 0x0C
RC_READ_RESPONSE_ONLY, RC_SEND_ONLY_INV, RC_ATOMIC_ACK, RC_FETCH_ADD = 0x10, 0x17, 0x12, 0x14
_GSI_QPN, _GSI_QKEY, _PKEY = 1, 0x80010000, 0xFFFF
# <linux/in.h>: DF set, so Linux writes Identification 0 from an unconnected socket
_IP_MTU_DISCOVER, _IP_PMTUDISC_DO = 10, 2


def _bth(opcode: int, dest_qp: int, psn: int, ack_req: bool = False, solicited: bool = False) -> bytes:
    return struct.pack(">BBHII", opcode, (0x80 if solicited else 0), _PKEY, dest_qp & 0xFFFFFF,
                       (0x80000000 if ack_req else 0) | (psn & 0xFFFFFF))


def icrc_of(ip: bytes, udp: bytes, packet: bytes) -> bytes:
    """The ICRC of BTH and everything after it (``packet``, without the ICRC) under the
    IPv4 header ``ip`` and UDP header ``udp``: a CRC-32 over eight octets of ones, the IPv4
    header with TOS, TTL and checksum all ones, the UDP header with its checksum all ones,
    the BTH with its reserved octet 4 all ones, and the rest; least significant octet first."""
    ip = ip[:1] + b"\xff" + ip[2:8] + b"\xff" + ip[9:10] + b"\xff\xff" + ip[12:]
    masked = udp[:6] + b"\xff\xff" + packet[:4] + b"\xff" + packet[5:]
    return struct.pack("<I", zlib.crc32(b"\xff" * 8 + ip + masked))


def icrc(src: str, dst: str, sport: int, packet: bytes) -> bytes:
    """The ICRC of ``packet`` as a UDP socket with DF set sends it: Identification 0."""
    length = 20 + 8 + len(packet) + 4
    ip = struct.pack(">BBHHHBBH4s4s", 0x45, 0, length, 0, 0x4000, 64, 17, 0,
                     socket.inet_aton(src), socket.inet_aton(dst))
    return icrc_of(ip, struct.pack(">HHHH", sport, ROCE_PORT, length - 20, 0), packet)


class RocePort:
    """A UDP socket at (``local``, 4791), where a RoCEv2 peer answers, sending to ``target``."""

    def __init__(self, local: str, target: str) -> None:
        self.local, self.target = local, target
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.sock.setsockopt(socket.IPPROTO_IP, _IP_MTU_DISCOVER, _IP_PMTUDISC_DO)
        self.sock.bind((local, ROCE_PORT))
        self.sock.setblocking(False)
        self.sent = 0

    def send(self, packet: bytes) -> None:
        datagram = packet + icrc(self.local, self.target, ROCE_PORT, packet)
        while True:
            try:
                self.sock.sendto(datagram, (self.target, ROCE_PORT))
                break
            except BlockingIOError:
                time.sleep(0.001)
        self.sent += 1

    def received(self) -> list[bytes]:
        """Every datagram waiting, without its ICRC."""
        out = []
        while True:
            try:
                out.append(self.sock.recv(65536)[:-4])
            except BlockingIOError:
                return out

    def close(self) -> None:
        self.sock.close()


# -- RoCEv2 connection management: CM MADs on QP1 (IBA 12.6) ----------------------------

CM_REQ, CM_REJ, CM_REP, CM_RTU, CM_DREQ, CM_DREP = 0x0010, 0x0012, 0x0013, 0x0014, 0x0015, 0x0016
_MAD = struct.Struct(">BBBBHHQHHI")     # the MAD common header (24 octets)
_CM_CLASS, _CM_VERSION, _MAD_SEND = 0x07, 2, 0x03
RDMA_PS_TCP = 0x0106


def _gid(address: str) -> bytes:
    """The RoCEv2 GID of an IPv4 address: an IPv4-mapped IPv6 address."""
    return bytes(10) + b"\xff\xff" + socket.inet_aton(address)


def ud_mad(attribute: int, data: bytes, tid: int | None = None) -> bytes:
    """BTH and DETH to QP1 and the 256-octet CM MAD (``data``: its 232 octets of CM data)."""
    tid = secrets.randbits(64) if tid is None else tid
    mad = _MAD.pack(1, _CM_CLASS, _CM_VERSION, _MAD_SEND, 0, 0, tid, attribute, 0, 0)
    return (_bth(UD_SEND_ONLY, _GSI_QPN, 0) + struct.pack(">II", _GSI_QKEY, _GSI_QPN)
            + mad + data.ljust(232, b"\0"))


def cm_req(local: str, target: str, port: int, comm_id: int, qpn: int, psn: int) -> bytes:
    """A REQ as librdmacm sends one for an RC connection to rdma_cm port ``port``."""
    private = (bytes([0x00, 0x40]) + struct.pack(">H", 40000) + bytes(12) + socket.inet_aton(local)
               + bytes(12) + socket.inet_aton(target))
    path = (struct.pack(">HH", 0xFFFF, 0xFFFF) + _gid(local) + _gid(target)
            + struct.pack(">IBBBB", 0, 0, 64, 0, 18 << 3))
    data = (struct.pack(">IIQQII", comm_id, 0, (RDMA_PS_TCP << 16) | port, secrets.randbits(64), 0, 0)
            + struct.pack(">II", (qpn << 8) | 16, 16)                # QPN, Responder Resources; Initiator Depth
            + struct.pack(">I", (22 << 3) << 0)                       # remote CM timeout, RC, no flow control
            + struct.pack(">I", (psn << 8) | (22 << 3) | 7)           # Starting PSN, CM timeout, retry 7
            + struct.pack(">HBB", _PKEY, (3 << 4) | 7, 15 << 4)       # P_Key, MTU 1024 and RNR retry, CM retries
            + path + bytes(44) + private.ljust(92, b"\0"))
    return ud_mad(CM_REQ, data)


def cm_rtu(comm_id: int, remote_comm_id: int, tid: int) -> bytes:
    return ud_mad(CM_RTU, struct.pack(">II", comm_id, remote_comm_id), tid)


def cm_dreq(comm_id: int, remote_comm_id: int, remote_qpn: int = 0) -> bytes:
    return ud_mad(CM_DREQ, struct.pack(">III", comm_id, remote_comm_id, remote_qpn << 8))


def cm_attribute(datagram: bytes) -> int | None:
    """The attribute of a CM MAD received on QP1 (BTH 12, DETH 8, then the MAD), or None."""
    if len(datagram) < 20 + 24 or datagram[0] != UD_SEND_ONLY or datagram[21] != _CM_CLASS:
        return None
    return struct.unpack_from(">H", datagram, 20 + 16)[0]


def cm_rep(datagram: bytes) -> dict:
    """A REP's fields a requester needs: the MAD's TID, the target's comm ID, QPN and PSN."""
    tid = struct.unpack_from(">Q", datagram, 20 + 8)[0]
    local_comm, remote_comm, _, qpn, _, psn = struct.unpack_from(">IIIIII", datagram, 44)
    return {"tid": tid, "comm_id": local_comm, "our_comm_id": remote_comm, "qpn": qpn >> 8,
            "psn": psn >> 8}


class CmFlooder(RocePort):
    """CM REQs with comm IDs, QPNs and PSNs of their own, counting the answers by attribute."""

    def __init__(self, local: str, target: str) -> None:
        super().__init__(local, target)
        self.answers: dict[int, int] = {}

    def req(self, port: int = ROCE_PORT) -> bytes:
        return cm_req(self.local, self.target, port, secrets.randbits(32), secrets.randbits(24) | 2,
                      secrets.randbits(24))

    def flood(self, count: int, port: int = ROCE_PORT) -> None:
        for _ in range(count):
            self.send(self.req(port))
            self.collect()

    def collect(self) -> None:
        for datagram in self.received():
            attribute = cm_attribute(datagram)
            if attribute is not None:
                self.answers[attribute] = self.answers.get(attribute, 0) + 1

    @property
    def reps(self) -> int:
        return self.answers.get(CM_REP, 0)

    def close(self) -> None:
        """Counted what came, then closed."""
        self.collect()
        super().close()


class _SharedPort(RocePort):
    """The one socket at (``local``, 4791) that all RC sessions from ``local`` to one target
    share, as an RNIC's port: a packet goes to the session its BTH's destination QP names,
    a CM REP or REJ to the session its Remote Communication ID names."""

    ports: dict[tuple[str, str], _SharedPort] = {}

    @classmethod
    def get(cls, local: str, target: str) -> _SharedPort:
        port = cls.ports.get((local, target))
        if port is None:
            port = cls.ports[local, target] = cls(local, target)
            asyncio.get_running_loop().add_reader(port.sock, port._dispatch)
        return port

    def __init__(self, local: str, target: str) -> None:
        super().__init__(local, target)
        self.by_qpn: dict[int, RcSession] = {}
        self.by_comm: dict[int, RcSession] = {}
        self.seen: dict[int, int] = {}          # what came, by BTH opcode (CM MADs by attribute + 0x1000)

    def _dispatch(self) -> None:
        for datagram in self.received():
            if len(datagram) >= 12:
                self._datagram(datagram)

    def _datagram(self, datagram: bytes) -> None:
        qpn = int.from_bytes(datagram[5:8], "big")
        kind = datagram[0] if qpn != _GSI_QPN else 0x1000 + (cm_attribute(datagram) or 0)
        self.seen[kind] = self.seen.get(kind, 0) + 1
        if qpn != _GSI_QPN:
            session = self.by_qpn.get(qpn)
            if session is not None:
                session._packet(datagram)
        elif cm_attribute(datagram) in (CM_REP, CM_REJ, CM_DREQ) and len(datagram) >= 52:
            session = self.by_comm.get(struct.unpack_from(">I", datagram, 48)[0])
            if session is None:
                return
            if cm_attribute(datagram) == CM_DREQ:
                session.closed = True     # unanswered: an attacker owes the target nothing
            elif not session.answered.done():
                session.answered.set_result(datagram)

    def drop(self, session: RcSession) -> None:
        self.by_qpn.pop(session.qpn, None)
        self.by_comm.pop(session.comm_id, None)
        if not self.by_qpn:
            asyncio.get_running_loop().remove_reader(self.sock)
            self.ports.pop((self.local, self.target), None)
            self.close()


class RcSession:
    """A RoCEv2 RC connection made by CM REQ, REP, RTU from ``local``, just enough of a
    requester and responder to hold a KBTP session: it sends Sends, acknowledges every
    request packet of the target's (its liveness probes are zero-length RDMA Writes),
    answers Read Requests with zeros, and keeps the KBTP messages the target sent it.
    It answers from the event loop by itself; ``frozen`` stops that, as a stopped
    process would."""

    def __init__(self, port: _SharedPort) -> None:
        self.port = port
        self.qpn, self.psn = secrets.randbits(23) | 0x100, secrets.randbits(24)
        self.comm_id = secrets.randbits(32)
        self.remote_qpn = self.remote_comm = 0           # from the REP
        self.messages: list[dict] = []
        self.atomics: list[int] = []         # original values of ATOMIC ACKNOWLEDGEs
        self.arrived = asyncio.Event()
        self.answered: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.frozen = self.closed = False    # closed: the target sent a DREQ
        self.rep = b""                       # a hostile target's session: the REP it answered with
        self.epsn = self.psn                 # what we receive with: our REQ's Starting PSN
        self.receive_buffers = 1 << 30       # Sends the target may still place
        self.rnr_naks = 0
        self.reads, self.answers_reads = 0, True       # Read Requests that came; answered or not
        self.unacked: dict[int, bytes] = {}  # our requests by PSN, until acknowledged
        self._resending = False
        port.by_qpn[self.qpn] = port.by_comm[self.comm_id] = self

    @classmethod
    async def open(cls, local: str, target: str, timeout: float = 5) -> RcSession:
        """Connected: REQ, the target's REP, RTU; ConnectionRefusedError on a REJ."""
        self = cls(_SharedPort.get(local, target))
        try:
            self.port.send(cm_req(local, target, ROCE_PORT, self.comm_id, self.qpn, self.psn))
            try:
                answer = await asyncio.wait_for(self.answered, timeout)
            except TimeoutError:
                raise TimeoutError(f"no CM REP from {target} within {timeout} s") from None
            if cm_attribute(answer) == CM_REJ:
                raise ConnectionRefusedError(f"CM REJ from {target}")
        except BaseException:
            self.port.drop(self)
            raise
        rep = cm_rep(answer)
        self.remote_qpn, self.remote_comm = rep["qpn"], rep["comm_id"]
        # each side sends from the PSN the other's CM message names, as Linux's CM sets
        # both up (rxe_linlin_rping.pcap: the active side's first SEND carries the REP's
        # Starting PSN)
        self.psn = rep["psn"]
        self.port.send(cm_rtu(self.comm_id, self.remote_comm, rep["tid"]))
        return self

    def say(self, message: bytes) -> None:
        """A KBTP message as an RC SEND ONLY, with AckReq."""
        pad = -len(message) % 4
        bth = bytearray(_bth(RC_SEND_ONLY, self.remote_qpn, self.psn, ack_req=True))
        bth[1] |= pad << 4
        self._request(bytes(bth) + message + bytes(pad))

    def _request(self, packet: bytes) -> None:
        """Sent, and kept until acknowledged: a NAK has it sent again, go-back-N as an RC
        requester does (IB 9.7.5.1), so requests beyond the target's credits arrive once it
        has receive buffers again."""
        self.unacked[self.psn] = packet
        if len(self.unacked) > 4096:                  # bounded: the oldest is given up
            del self.unacked[next(iter(self.unacked))]
        self.port.send(packet)
        self.psn = (self.psn + 1) & 0xFFFFFF

    def _acknowledged(self, psn: int, syndrome: int) -> None:
        """An ACK or NAK (AETH ``syndrome``) from the target for our ``psn``."""
        kind = syndrome >> 5
        done = psn if kind == 0 else psn - 1          # a NAK names the first PSN not taken
        for old in list(self.unacked):
            if (done - old) & 0xFFFFFF < 1 << 23:
                del self.unacked[old]
        if kind in (1, 3) and not self._resending:    # RNR NAK, or NAK: again from psn
            self._resending = True
            asyncio.get_running_loop().call_later(0.002 if kind == 1 else 0, self._resend)

    def _resend(self) -> None:
        self._resending = False
        if not self.frozen and self.port.sock.fileno() != -1:     # not ended meanwhile
            for packet in list(self.unacked.values()):
                self.port.send(packet)

    def _packet(self, packet: bytes) -> None:
        """One packet of the target's. Responses (ACKs, ATOMIC ACKNOWLEDGE) are taken as
        they come. Requests are taken in PSN order: a Send kept as a KBTP message, or
        answered with an RNR NAK while ``receive_buffers`` is 0; a Write (the liveness
        probe) acknowledged; a Read answered with zeros; a duplicate acknowledged again;
        one beyond a gap dropped, as IB 9.7.5 has a responder do."""
        if self.frozen:
            return
        opcode, flags = packet[0], packet[1]
        psn = struct.unpack_from(">I", packet, 8)[0] & 0xFFFFFF
        if opcode in (RC_ACK, RC_ATOMIC_ACK) and len(packet) >= 16:
            self._acknowledged(psn, packet[12])
        if opcode == RC_ATOMIC_ACK and len(packet) >= 24:
            self.atomics.append(struct.unpack_from(">Q", packet, 16)[0])
            self.arrived.set()
        if not (opcode <= RC_READ_REQUEST or opcode in (0x16, RC_SEND_ONLY_INV)):
            return                                   # a response to one of ours
        behind = (self.epsn - psn) & 0xFFFFFF
        if opcode == RC_READ_REQUEST and not self.answers_reads:
            if psn == self.epsn:                     # taken, and never answered (nor its retries)
                self.reads += 1
                self.epsn = (psn + 1) & 0xFFFFFF
            return
        if behind and behind < 1 << 23:              # a duplicate: acknowledge it again
            self.port.send(_bth(RC_ACK, self.remote_qpn, psn) + struct.pack(">I", 0x1F << 24))
            return
        if psn != self.epsn:
            return                                   # beyond a gap: dropped
        is_send = opcode in (RC_SEND_ONLY, RC_SEND_ONLY_IMM, RC_SEND_ONLY_INV)
        if is_send and self.receive_buffers == 0:
            self.rnr_naks += 1                       # RNR NAK, timer code 1 (0.01 ms)
            self.port.send(_bth(RC_ACK, self.remote_qpn, psn) + struct.pack(">I", 0x21 << 24))
            return
        self.epsn = (psn + 1) & 0xFFFFFF
        if is_send:
            self.receive_buffers -= 1
            body = packet[12 + (4 if opcode != RC_SEND_ONLY else 0):]
            self.messages.append(parse(body[:len(body) - ((flags >> 4) & 3)]))
            self.arrived.set()
        if opcode == RC_READ_REQUEST and len(packet) >= 28:
            self.reads += 1
            size = min(struct.unpack_from(">I", packet, 24)[0], 1024)     # one packet's worth
            self.port.send(_bth(RC_READ_RESPONSE_ONLY, self.remote_qpn, psn)
                           + struct.pack(">I", 0x1F << 24) + bytes(size))
        else:
            self.port.send(_bth(RC_ACK, self.remote_qpn, psn) + struct.pack(">I", 0x1F << 24))

    async def wait_closed(self, timeout: float) -> bool:
        """Until the target sends a DREQ or ``timeout`` passes: whether it did."""
        end = time.monotonic() + timeout
        while not self.closed and time.monotonic() < end:
            await asyncio.sleep(0.01)
        return self.closed

    async def fetch_add(self, descriptor: tuple[int, int, int], slots: int) -> int:
        """A ticket: FETCH ADD of one ticket (InfiniBand's unmasked Fetch and Add, the
        ticket in the high 32 bits) on the counter ``descriptor`` names; its old value."""
        va, rkey = descriptor[1], descriptor[0]
        self._request(_bth(RC_FETCH_ADD, self.remote_qpn, self.psn, ack_req=True)
                      + struct.pack(">QIQQ", va, rkey, 1 << 32, 0))
        end = time.monotonic() + 5
        while not self.atomics:
            self.arrived.clear()
            await asyncio.wait_for(self.arrived.wait(), max(0.0, end - time.monotonic()))
        return self.atomics.pop(0)

    async def message(self, timeout: float = 5) -> dict:
        """The next KBTP message the target sent."""
        end = time.monotonic() + timeout
        while not self.messages:
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), max(0.0, end - time.monotonic()))
            except TimeoutError:
                raise TimeoutError(f"no KBTP message from {self.port.target} within {timeout} s") from None
        return self.messages.pop(0)

    async def session(self, initiator_id: bytes | None = None, features: int = 0,
                      credits: int = 32) -> dict:
        """HELLO; the HELLO_ACK's fields."""
        self.say(hello(initiator_id, credits, features))
        return await self.message()

    async def end(self) -> None:
        """The connection closed with a DREQ, without GOODBYE unless one was said."""
        self.port.send(cm_dreq(self.comm_id, self.remote_comm, self.remote_qpn))
        self.port.drop(self)


async def keep_saying(conn: MpaStream | RcSession, message, per_tick: int, tick: float,
                      limit: float = 8.0) -> tuple[float, int, bool]:
    """``message(n)``, ``per_tick`` every ``tick`` seconds, until the target ends the
    connection or ``limit`` seconds pass: (seconds, messages sent, ended)."""
    start, sent = time.monotonic(), 0
    while not conn.closed and time.monotonic() - start < limit:
        for _ in range(per_tick):
            conn.say(message(sent))
            sent += 1
        await asyncio.sleep(tick)
    return time.monotonic() - start, sent, conn.closed


async def connect(url: str, local: str | None = None, rtr_after: float = 0.0) -> MpaStream | RcSession:
    """A connection to the target at ``url`` (iwarp://HOST:PORT or roce://HOST[:4791]),
    from ``local``; RoCEv2 needs a local address of its own, where the target answers.
    ``rtr_after``: iWARP's RTR that many seconds after the MPA Reply."""
    scheme, _, where = url.partition("://")
    host, _, port = where.rpartition(":") if ":" in where else (where, "", "")
    if scheme == "iwarp":
        return await MpaStream.open(host, int(port), local, rtr_after=rtr_after)
    if scheme == "roce":
        assert local, "a RoCEv2 attacker needs a local address (its port 4791 is where answers come)"
        return await RcSession.open(local, host)
    raise ValueError(f"{url}: not iwarp:// or roce://")


# -- a hostile target for the client tools (issue 32) ----------------------------------

_COMPLETION_BODY = struct.Struct(">IIQ")       # Data Length, Reserved, Block Offset
REQUESTS = (LOAD, STORE, ALLOC_STORE, FREE, 0x14)          # 0x14: BIND
#: a sane HELLO_ACK's figures; a hostile plan overrides some
SANE_ACK = {"features": 0, "credits": 16, "block_size": 4096, "max_inline": 1024, "quota": 16,
            "handle_base": 0x4000, "handle_count": 64, "ticket_timeout": 1000}


def hello_ack(request_id: int = 0, descriptors: bytes = b"", **figures: int) -> bytes:
    """A HELLO_ACK with Status OK: ``SANE_ACK`` with ``figures`` instead where given, then
    ``descriptors`` (the direct modes' descriptors, in the order NOTES.md section 2 gives)."""
    f = {**SANE_ACK, **figures}
    return (_HEAD.pack(1, HELLO_ACK, 0, request_id, 0, 0, 0)
            + _ACK.pack(f["features"], f["credits"], f["block_size"], f["max_inline"], f["quota"],
                        f["handle_base"], f["handle_count"], f["ticket_timeout"]) + descriptors)


def direct_load_descriptors(table: tuple[int, int, int], base_handle: int,
                            pool: tuple[int, int, int]) -> bytes:
    """DIRECT_LOAD's: the Table descriptor, Table Base Handle, 8 reserved octets, the Pool."""
    return _DESC.pack(*table) + struct.pack(">Q8x", base_handle) + _DESC.pack(*pool)


def completion(request_id: int, handle: int = 0, status: int = 0, length: int = 0,
               block_offset: int = 0) -> bytes:
    return (_HEAD.pack(1, COMPLETION, 0, request_id, handle, 0, status)
            + _COMPLETION_BODY.pack(length, 0, block_offset))


class HostileTarget:
    """A KBTP target that misbehaves on purpose, to be pointed at a client tool.

    Over iWARP it accepts TCP and MPA (v2, CRCs, peer-to-peer with the initiator's
    zero-length Write as RTR); over RoCEv2 (``roce_peer``: the one address the tool sends
    from, where it answers) it takes CM REQs on UDP 4791 and answers each with a REP. Then
    it follows its plan: ``hello`` False never answers the HELLO; ``ack`` holds the
    HELLO_ACK's figures that differ from ``SANE_ACK`` (a Block Size of 0xFFFFFFF8...) and
    ``descriptors`` its direct-mode descriptors; ``flood`` unsolicited COMPLETIONs (Request
    IDs nobody used) follow the HELLO_ACK; ``answer`` False leaves every request unanswered,
    else each gets a COMPLETION with Status OK and Data Length 0; ``reads`` False leaves
    every RDMA Read Request unanswered, else it is answered with zeros. A GOODBYE ends the
    session. What came is counted in ``seen`` (HELLO, requests, reads)."""

    def __init__(self, host: str, *, roce_peer: str | None = None, hello: bool = True,
                 ack: dict | None = None, descriptors: bytes = b"", flood: int = 0,
                 answer: bool = True, reads: bool = True) -> None:
        self.host, self.port, self.roce_peer = host, 0, roce_peer
        self.hello, self.ack, self.descriptors = hello, ack or {}, descriptors
        self.flood, self.answer, self.reads = flood, answer, reads
        self._seen = {"hello": 0, "requests": 0, "goodbye": 0}
        self._sessions: list[RcSession] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._roce: _ListeningPort | None = None
        self._iwarp_reads = 0

    @property
    def url(self) -> str:
        return f"roce://{self.host}" if self.roce_peer else f"iwarp://{self.host}:{self.port}"

    @property
    def seen(self) -> dict[str, int]:
        return {**self._seen, "reads": self._iwarp_reads + sum(s.reads for s in self._sessions)}

    def __enter__(self) -> HostileTarget:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    async def _start(self) -> None:
        if self.roce_peer:
            self._roce = _ListeningPort(self.host, self.roce_peer, self._accept)
            asyncio.get_running_loop().add_reader(self._roce.sock, self._roce._dispatch)
            return
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def __exit__(self, *_: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _stop(self) -> None:
        """The listener closed, every connection ended."""
        if self._server is not None:
            self._server.close()
        if self._roce is not None:
            asyncio.get_running_loop().remove_reader(self._roce.sock)
            self._roce.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- what it says, either binding -------------------------------------------------

    async def _on(self, conn: MpaStream | RcSession, message: dict) -> bool:
        """Answer one KBTP message as the plan says; False once the session is over."""
        if message.get("opcode") == HELLO:
            self._seen["hello"] += 1
            if self.hello:
                conn.say(hello_ack(message["request_id"], self.descriptors, **self.ack))
                await self._flood(conn)
        elif message.get("opcode") == GOODBYE:
            self._seen["goodbye"] += 1
            return False
        elif message.get("opcode") in REQUESTS:
            self._seen["requests"] += 1
            if self.answer:
                conn.say(completion(message["request_id"], message["handle"]))
        return True

    async def _flood(self, conn: MpaStream | RcSession) -> None:
        """``flood`` COMPLETIONs answering nothing, a few at a time (within the initiator's
        credits, which it gives back as it takes each), until the initiator ends the connection."""
        await asyncio.sleep(0.2)                 # the HELLO_ACK taken first
        for n in range(self.flood):
            if conn.closed:
                return
            conn.say(completion(0xF0000000 + n))
            if n % 8 == 7:
                if isinstance(conn, MpaStream):
                    await conn.writer.drain()
                await asyncio.sleep(0.001)

    # -- iWARP ------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readexactly(20), 10)
            await reader.readexactly(struct.unpack(">H", request[18:20])[0])
            private = struct.pack(">HH", _P2P | 16, _WRITE_RTR | 16)
            writer.write(b"MPA ID Rep Frame" + bytes([_MPA_CRC | _MPA_ENHANCED, 2])
                         + struct.pack(">H", len(private)) + private)
            await self._mpa_session(MpaStream(reader, writer))
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass
        except asyncio.CancelledError:  # the target stopping: ended quietly (asyncio's stream
            pass                        # callback would log a handler cancelled as an error)
        finally:
            writer.close()

    async def _mpa_session(self, stream: MpaStream) -> None:
        while True:
            f = await stream.next(3600)
            if f.opcode == READ_REQUEST:
                self._iwarp_reads += 1
                if self.reads:
                    sink, sink_offset, size = struct.unpack_from(">IQI", f.payload)
                    stream.writer.write(tagged(READ_RESPONSE, sink, sink_offset, bytes(min(size, 8192))))
            elif f.opcode in SENDS and len(f.payload) >= _HEAD.size:    # not the RTR, Writes
                if not await self._on(stream, parse(f.payload)):
                    return

    # -- RoCEv2 -----------------------------------------------------------------------

    def _accept(self, port: _ListeningPort, req: bytes) -> None:
        """A CM REQ: a session, answered with a REP (again, for a REQ sent again)."""
        comm, qpn, psn = (struct.unpack_from(">I", req, 44 + at)[0] for at in (0, 32, 44))
        ses = next((s for s in self._sessions if s.remote_comm == comm), None)
        if ses is None:
            ses = RcSession(port)
            ses.remote_comm, ses.remote_qpn = comm, qpn >> 8
            ses.answers_reads = self.reads
            rep_psn, ses.psn = ses.epsn, psn >> 8    # each side sends from the PSN the other named
            ses.rep = ud_mad(CM_REP, struct.pack(">IIIIIIBBBBQ", ses.comm_id, comm, 0, ses.qpn << 8, 0,
                                                 rep_psn << 8, 16, 16, 0, 7 << 5, 0),
                             struct.unpack_from(">Q", req, 28)[0])
            self._sessions.append(ses)
            asyncio.get_running_loop().create_task(self._rc_session(ses))
        port.send(ses.rep)

    async def _rc_session(self, ses: RcSession) -> None:
        while not ses.closed:
            try:
                message = await ses.message(1)
            except TimeoutError:
                continue
            if not await self._on(ses, message):
                ses.port.send(cm_dreq(ses.comm_id, ses.remote_comm, ses.remote_qpn))
                return


class _ListeningPort(_SharedPort):
    """The hostile target's RoCEv2 port: CM REQs go to ``on_req``, the rest as to any port."""

    def __init__(self, local: str, peer: str, on_req) -> None:
        super().__init__(local, peer)
        self.on_req = on_req

    def _datagram(self, datagram: bytes) -> None:
        if int.from_bytes(datagram[5:8], "big") == _GSI_QPN and cm_attribute(datagram) == CM_REQ \
                and len(datagram) >= 92:
            self.on_req(self, datagram)
        else:
            super()._datagram(datagram)


async def _peer(url: str, initiator_id: bytes, bind: bool, local: str | None) -> None:
    conn = await connect(url, local)
    ack = await conn.session(initiator_id)
    assert ack["status"] == "OK", ack
    if bind:
        conn.say(alloc_store(1, ack["handle_base"], b"left behind", seal=True))
        done = await conn.message()
        assert done["status"] == "OK", done
    print("ready", flush=True)
    await asyncio.sleep(3600)


if __name__ == "__main__":
    # python -m tests.attack URL INITIATOR_ID_HEX bind|idle [LOCAL]: a session that stays
    # (having stored a sealed block at its first handle if "bind") until it is killed
    import sys
    asyncio.run(_peer(sys.argv[1], bytes.fromhex(sys.argv[2]), sys.argv[3] == "bind",
                      sys.argv[4] if sys.argv[4:] else None))


# -- a dishonest responder to the target's RDMA Reads (issue 32, T5) -------------------

RC_READ_RESPONSE_FIRST, RC_READ_RESPONSE_MIDDLE, RC_READ_RESPONSE_LAST = 0x0D, 0x0E, 0x0F
ROCE_MTU = 1024                     # what cm_req asks for


def alloc_store_from(request_id: int, handle: int, stag: int, length: int, seal: bool = True) -> bytes:
    """ALLOC_STORE whose data the target must RDMA Read: ``length`` octets at (``stag``, 0)."""
    return (header(ALLOC_STORE, SEAL if seal else 0, request_id, handle)
            + _DESC.pack(stag, 0, length))


def read_response_packets(dest_qp: int, psn: int, data: bytes, mtu: int = ROCE_MTU) -> list[bytes]:
    """RDMA READ RESPONSE packets carrying ``data`` from ``psn`` on (IB 9.7.5.2.5): FIRST,
    MIDDLE..., LAST at the path MTU, or ONLY; FIRST, LAST and ONLY with an AETH."""
    pieces = [data[i:i + mtu] for i in range(0, len(data), mtu)] or [b""]
    out = []
    for i, piece in enumerate(pieces):
        if len(pieces) == 1:
            opcode = RC_READ_RESPONSE_ONLY
        else:
            opcode = (RC_READ_RESPONSE_FIRST if i == 0 else RC_READ_RESPONSE_LAST
                      if i == len(pieces) - 1 else RC_READ_RESPONSE_MIDDLE)
        pad = -len(piece) % 4
        bth = bytearray(_bth(opcode, dest_qp, psn + i))
        bth[1] |= pad << 4
        aeth = b"" if opcode == RC_READ_RESPONSE_MIDDLE else struct.pack(">I", 0x1F << 24)
        out.append(bytes(bth) + aeth + piece + bytes(pad))
    return out


class LyingRcSession(RcSession):
    """An ``RcSession`` that answers each RDMA Read Request with ``answer(size)`` octets
    (0xA5) instead of the ``size`` asked for: short, long or right, as it is told."""

    answer = staticmethod(lambda size: size)
    reads_answered = 0

    def _packet(self, packet: bytes) -> None:
        psn = struct.unpack_from(">I", packet, 8)[0] & 0xFFFFFF if len(packet) >= 12 else -1
        if self.frozen or packet[0] != RC_READ_REQUEST or len(packet) < 28 or psn != self.epsn:
            super()._packet(packet)
            return
        size = struct.unpack_from(">I", packet, 24)[0]
        self.epsn = (psn + max(1, -(-size // ROCE_MTU))) & 0xFFFFFF
        self.reads_answered += 1
        for response in read_response_packets(self.remote_qpn, psn, b"\xa5" * self.answer(size)):
            self.port.send(response)


async def iwarp_store_answered(s: MpaStream, request_id: int, handle: int, length: int,
                               answer: int, timeout: float = 5) -> dict:
    """A non-inline ALLOC_STORE of ``length`` octets whose RDMA Read Request the attacker
    answers with ``answer`` octets of 0xA5 (one Read Response, Last set): what came of it,
    {"read": a Read Request came, "completion": the COMPLETION's fields or None,
    "terminate": a Terminate came, "ended": the target ended the stream}."""
    s.say(alloc_store_from(request_id, handle, 0x5A5A00, length))
    out: dict = {"read": False, "completion": None, "terminate": False, "ended": False}
    end = time.monotonic() + timeout
    try:
        while time.monotonic() < end and out["completion"] is None:
            f = await s.next(end - time.monotonic())
            if f.opcode == READ_REQUEST and not f.tagged:
                sink, sink_to = struct.unpack_from(">IQ", f.payload)
                out["read"] = True
                s.writer.write(tagged(READ_RESPONSE, sink, sink_to, b"\xa5" * answer))
            elif f.opcode == TERMINATE:
                out["terminate"] = True
            elif f.opcode in SENDS:
                message = parse(f.payload)
                if message.get("opcode") == COMPLETION:
                    out["completion"] = message
    except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
        pass
    if out["completion"] is None:
        out["ended"] = await s.wait_closed(timeout)
    return out


async def roce_store_answered(s: LyingRcSession, request_id: int, handle: int, length: int,
                              timeout: float = 8) -> dict:
    """The same on RoCEv2, ``s.answer`` giving the Read Response's length: {"read",
    "completion", "ended": the target sent a DREQ}."""
    s.say(alloc_store_from(request_id, handle, 0x5A5A00, length))
    out: dict = {"read": False, "completion": None, "ended": False}
    end = time.monotonic() + timeout
    while time.monotonic() < end and out["completion"] is None and not s.closed:
        try:
            message = await s.message(min(0.2, max(0.01, end - time.monotonic())))
        except TimeoutError:
            continue
        if message.get("opcode") == COMPLETION:
            out["completion"] = message
    out["read"] = s.reads_answered > 0
    if out["completion"] is None:
        out["ended"] = await s.wait_closed(max(0.0, end - time.monotonic()))
    return out


# -- busy sessions that hold their slots (issue 32, T6) ---------------------------------

async def busy_session(url: str, local: str | None, period: float, until: float,
                       counts: dict[str, int], same_id: bool = False, retry: float = 0.2,
                       features: int = 0) -> None:
    """One session at a time from ``local`` that sends a FREE every ``period`` seconds (so
    it is never silent), opened again at once whenever the target ends it, and ``retry``
    seconds after the target refuses it, until ``until`` (``time.monotonic()``): with the
    same Initiator ID each time when ``same_id`` (a retained session resumed), else a new
    one; HELLO with ``features``. It counts into ``counts`` (so a caller that cancels it
    keeps them): "admitted", sessions it got; "ended", ended by the target; "refused",
    set-ups or HELLOs refused."""
    for key in ("admitted", "ended", "refused"):
        counts.setdefault(key, 0)
    ident = secrets.token_bytes(16) if same_id else None
    sent = 0
    while time.monotonic() < until:
        try:
            conn = await connect(url, local)
        except (OSError, TimeoutError, AssertionError, asyncio.IncompleteReadError):
            counts["refused"] += 1
            await asyncio.sleep(retry)
            continue
        try:
            ack = await conn.session(ident, features)
        except (OSError, TimeoutError, AssertionError, asyncio.IncompleteReadError):
            ack = {}
        if ack.get("status") != "OK":
            counts["refused"] += 1
            await conn.end()
            await asyncio.sleep(retry)
            continue
        counts["admitted"] += 1
        while time.monotonic() < until:
            sent += 1
            conn.say(free(sent, ack["handle_base"]))
            if await conn.wait_closed(min(period, max(0.0, until - time.monotonic()))):
                counts["ended"] += 1
                break
        await conn.end()
