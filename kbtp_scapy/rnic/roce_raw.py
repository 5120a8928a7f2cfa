"""Raw-socket I/O backend of the RoCEv2 ``Device``: whole Ethernet frames on an interface.

The endpoint owns an IP address and a MAC that the kernel does not have, as an RDMA NIC
owns its own: it answers ARP (RFC 826) or IPv6 neighbour solicitations (RFC 4861) for
them, resolves its peers' MACs the same way, and writes the Ethernet, IP and UDP headers
of every frame itself. Its GID is derived from the IP address (annex A17.4.1). A classic
BPF program on the AF_PACKET socket lets only the frames for that address reach Python.

Choices where the specifications leave them open:

- IPv4 datagrams have DF set and Identification 0 (RFC 6864 4.1: an atomic datagram's ID
  carries no meaning), TTL / Hop Limit 64, the TOS / Traffic Class the caller gives (ECN
  bits included); so the ICRC ``wire.roce.seal`` computes is the one over the real
  headers. Received frames are checked over the headers they came with (annex A17.4.5);
- UDP checksum 0 (annex A17.4.3 allows it for IPv4 and IPv6) or computed
  (``udp_checksum``); a received non-zero checksum is verified;
- neighbour entries do not age; any ARP or NDP message of a peer updates its entry, and a
  RoCEv2 frame from an unknown peer enters its source MAC;
- the address is busy when another endpoint of the process has it, when this host's IP
  stack has it, or when something answers one ARP probe (RFC 5227 2.1.1) or duplicate
  address detection solicitation (RFC 4862 5.4) within ``PROBE_WAIT`` seconds.
"""
from __future__ import annotations

import asyncio
import ctypes
import errno
import fcntl
import ipaddress
import logging
import socket
import struct
import zlib
from collections.abc import Iterator

from ..wire import roce as w
from ..wire.address import ROCE_PORT
from .roce_io import Received, gid_of, ib_mtu

log = logging.getLogger(__name__)

PROBE_WAIT = 0.2          # seconds an ARP probe / DAD solicitation waits for a defender
SOLICIT_TRIES = 3         # RFC 4861 MAX_MULTICAST_SOLICIT; ARP requests alike
SOLICIT_INTERVAL = 1.0    # RFC 4861 RETRANS_TIMER, seconds

ETH_ARP, ETH_IPV4, ETH_IPV6 = 0x0806, 0x0800, 0x86DD
_ETH_P_ALL = 3
_SO_ATTACH_FILTER = 26
_SOL_PACKET, _PACKET_ADD_MEMBERSHIP = 263, 1
_PACKET_MR_MULTICAST, _PACKET_MR_UNICAST = 0, 3
_PACKET_OUTGOING = 4
_PACKET_AUXDATA = 8
# tpacket_auxdata.tp_status: the UDP checksum is not filled in yet (a local sender's
# checksum offload, as on veth) or the kernel has verified it already
_TP_STATUS_CSUM_UNCHECKABLE = 1 << 3 | 1 << 7     # TP_STATUS_CSUMNOTREADY | CSUM_VALID
_AUX_SPACE = socket.CMSG_SPACE(20)
_SIOCGIFMTU, _SIOCGIFINDEX = 0x8921, 0x8933
_SOCK_BUF = 4 << 20
_BROADCAST = b"\xff" * 6
_ARP = struct.Struct("!HHBBH6s4s6s4s")               # RFC 826 for Ethernet / IPv4
_V4 = struct.Struct("!BBHHHBBH4s4s")
_V6 = struct.Struct("!IHBB16s16s")
_UDP = struct.Struct("!HHHH")
_H = struct.Struct("!H")
_NS, _NA = 135, 136                                  # RFC 4861 4.3, 4.4
_SLLA, _TLLA = 1, 2                                  # source / target link-layer address
_ALL_NODES = ipaddress.IPv6Address("ff02::1").packed


def parse_addr(text: str) -> tuple[str, bytes]:
    """``IP`` or ``IP/MAC`` -> (IP, MAC); without a MAC, the locally administered one
    ``wire.roce.mac`` derives from the IP. ValueError if either is bad."""
    ip_text, _, mac_text = text.partition("/")
    try:
        ip = ipaddress.ip_address(ip_text)
    except ValueError:
        raise ValueError(f"{ip_text!r} is not an IP address") from None
    if ip.is_loopback or ip.is_multicast or ip.is_unspecified:
        raise ValueError(f"{ip} cannot be a raw endpoint's address")
    if not mac_text:
        return str(ip), w.mac(str(ip))
    try:
        mac = bytes.fromhex(mac_text.replace(":", "").replace("-", ""))
    except ValueError:
        mac = b""
    if len(mac) != 6 or mac[0] & 1:
        raise ValueError(f"{mac_text!r} is not a unicast MAC address")
    return str(ip), mac


def _checksum_settled(aux: list) -> bool:
    """Whether the kernel says a frame's UDP checksum is not ours to verify: still to be
    filled in by offload (frames of a local sender, as over a veth) or verified already."""
    for level, kind, data in aux:
        if level == _SOL_PACKET and kind == _PACKET_AUXDATA and len(data) >= 4:
            return bool(int.from_bytes(data[:4], "little") & _TP_STATUS_CSUM_UNCHECKABLE)
    return False


def _checksum(data: bytes | bytearray | memoryview) -> int:
    """The Internet checksum (RFC 1071): 0 when ``data`` includes a correct one. Summing
    16-bit words in ones' complement is taking the number modulo 0xFFFF."""
    if len(data) & 1:
        data = bytes(data) + b"\0"
    return 0xFFFF - (int.from_bytes(data, "big") % 0xFFFF or 0xFFFF)


def _pseudo(src: bytes, dst: bytes, length: int, proto: int) -> bytes:
    """The IPv4 (RFC 768) or IPv6 (RFC 8200 8.1) pseudo header of an upper-layer checksum."""
    if len(src) == 4:
        return src + dst + struct.pack("!BBH", 0, proto, length)
    return src + dst + struct.pack("!IxxxB", length, proto)


def solicited_node(ip: bytes) -> bytes:
    """The solicited-node multicast address of an IPv6 address (RFC 4291 2.7.1)."""
    return bytes.fromhex("ff0200000000000000000001ff") + ip[13:]


def _multicast_mac(ip: bytes) -> bytes:
    """The Ethernet group address of an IPv6 multicast address (RFC 2464 7)."""
    return b"\x33\x33" + ip[12:]


# -- the kernel packet filter (classic BPF, Documentation/networking/filter.rst) -------

_LD_W, _LD_H, _LD_B, _LDH_IND, _LDX_MSH = 0x20, 0x28, 0x30, 0x48, 0xB1
_JEQ, _JSET, _RET = 0x15, 0x45, 0x06
_PKTTYPE = (-0x1000 + 4) & 0xFFFFFFFF               # SKF_AD_OFF + SKF_AD_PKTTYPE


def _assemble(program: list) -> bytes:
    """Labels (str) and instructions (code, k, jump if true, jump if false), the jumps
    being labels or None for the next instruction, to ``struct sock_filter``s."""
    where: dict[str, int] = {}
    code: list[tuple[int, int, str | None, str | None]] = []
    for item in program:
        if isinstance(item, str):
            where[item] = len(code)
        else:
            code.append(item)
    out = bytearray()
    for i, (op, k, jt, jf) in enumerate(code):
        jumps = [0 if j is None else where[j] - i - 1 for j in (jt, jf)]
        out += struct.pack("HBBI", op, *jumps, k)
    return bytes(out)


def bpf_program(ip: bytes, port: int) -> bytes:
    """Accept what the endpoint at ``ip`` must see, never its own outgoing frames: ARP
    naming ``ip`` as target or sender (a conflict); IPv4 UDP to ``ip``:``port``, not
    fragmented; IPv6 UDP to ``ip``:``port`` and ICMPv6 to ``ip``, to its solicited-node
    group or to all nodes (neighbour discovery)."""
    word = [int.from_bytes(ip[i:i + 4], "big") for i in range(0, len(ip), 4)]
    head = [(_LD_W, _PKTTYPE, None, None), (_JEQ, _PACKET_OUTGOING, "drop", None),
            (_LD_H, 12, None, None)]
    if len(ip) == 4:
        body = [
            (_JEQ, ETH_ARP, None, "ipv4"),
            (_LD_W, 28, None, None), (_JEQ, word[0], "keep", None),        # sender
            (_LD_W, 38, None, None), (_JEQ, word[0], "keep", "drop"),      # target
            "ipv4", (_JEQ, ETH_IPV4, None, "drop"),
            (_LD_W, 30, None, None), (_JEQ, word[0], None, "drop"),
            (_LD_B, 23, None, None), (_JEQ, 17, None, "drop"),
            (_LD_H, 20, None, None), (_JSET, 0x3FFF, "drop", None),        # MF or offset
            (_LDX_MSH, 14, None, None), (_LDH_IND, 16, None, None),
            (_JEQ, port, "keep", "drop")]
    else:
        group = solicited_node(ip)
        body = [
            (_JEQ, ETH_IPV6, None, "drop"),
            (_LD_W, 38, None, None), (_JEQ, word[0], None, "multicast"),
            (_LD_W, 42, None, None), (_JEQ, word[1], None, "drop"),
            (_LD_W, 46, None, None), (_JEQ, word[2], None, "drop"),
            (_LD_W, 50, None, None), (_JEQ, word[3], None, "drop"),
            (_LD_B, 20, None, None), (_JEQ, 58, "keep", None), (_JEQ, 17, None, "drop"),
            (_LD_H, 56, None, None), (_JEQ, port, "keep", "drop"),
            "multicast", (_JEQ, 0xFF020000, None, "drop"),
            (_LD_W, 42, None, None), (_JEQ, 0, None, "drop"),
            (_LD_W, 46, None, None), (_JEQ, 1, "group", None), (_JEQ, 0, None, "drop"),
            (_LD_W, 50, None, None), (_JEQ, 1, "icmp", "drop"),             # ff02::1
            "group", (_LD_W, 50, None, None),
            (_JEQ, int.from_bytes(group[12:], "big"), None, "drop"),
            "icmp", (_LD_B, 20, None, None), (_JEQ, 58, "keep", "drop")]
    return _assemble([*head, *body, "keep", (_RET, 0x40000, None, None),
                      "drop", (_RET, 0, None, None)])


def _attach(sock: socket.socket, program: bytes) -> None:
    """SO_ATTACH_FILTER with ``struct sock_fprog`` (length, pointer to the program)."""
    buf = ctypes.create_string_buffer(program, len(program))
    fprog = struct.pack("HL", len(program) // 8, ctypes.addressof(buf))
    sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, fprog)


# -- paths with real framing -----------------------------------------------------------

class RawPath(w.Path):
    """A path whose frames this backend writes: the peer's MAC as resolved, real IP and
    UDP headers (cached by datagram size)."""

    __slots__ = ("_heads", "_io")

    def __init__(self, io: RawIO, src: tuple[str, int], dst: tuple[str, int]) -> None:
        super().__init__(src, dst)
        self._io = io
        self._heads: dict[int, bytes] = {}

    def ip_udp(self, n: int) -> bytes:
        """IP and UDP headers for a datagram of ``n`` octets, UDP checksum 0."""
        head = self._heads.get(n)
        if head is None:
            tc = self._io.traffic_class
            udp = _UDP.pack(self.sport, self.dport, n + 8, 0)
            if self.v6:
                ip = _V6.pack(0x60000000 | tc << 20, n + 8, 17, 64, self.src, self.dst)
            else:
                ip = _V4.pack(0x45, tc, n + 28, 0, 0x4000, 64, 17, 0, self.src, self.dst)
                ip = ip[:10] + _H.pack(_checksum(ip)) + ip[12:]
            head = self._heads[n] = ip + udp
        return head

    def head(self, eth: bytes, parts: list, n: int) -> bytes:
        """The headers of a frame carrying ``parts`` (``n`` octets) behind ``eth``."""
        head = eth + self.ip_udp(n)
        if self._io.udp_checksum:
            csum = _checksum(_pseudo(self.src, self.dst, n + 8, 17) + head[-8:]
                             + b"".join(parts)) or 0xFFFF
            head = head[:-2] + _H.pack(csum)
        return head

    def frame(self, datagram: bytes, ident: int = 0) -> bytes:
        """The frame as it goes on the wire (a zero MAC while the peer is unresolved);
        ``ident`` is ``Path``'s: this backend's IPv4 header is the one it sends."""
        eth = self._io.eth_to.get(self.dst) or bytes(12) + self._eth[12:]
        return self.head(eth, [datagram], len(datagram)) + datagram


class _Seen(w.Path):
    """The ICRC pseudo header of one received IPv4 frame whose header differs from the
    one ``Path`` assumes (Identification not 0, DF clear, options): its variant fields
    masked (annex A17.4.5)."""

    __slots__ = ("_crc",)

    def __init__(self, ip: memoryview, udp: memoryview) -> None:
        self._crc = zlib.crc32(b"\xff" * 8 + ip[:1] + b"\xff" + ip[2:8] + b"\xff" + ip[9:10]
                                 + b"\xff\xff" + ip[12:] + udp[:6] + b"\xff\xff")

    def _prefix(self, n: int) -> int:
        return self._crc


# -- the backend ---------------------------------------------------------------------

#: why opening the raw socket failed with EPERM (the commands add what to do)
NEEDS_NET_RAW = "a raw (AF_PACKET) socket needs the capability CAP_NET_RAW"


class RawIO:
    """An AF_PACKET socket on ``iface`` for the endpoint ``addr`` ("IP" or "IP/MAC")."""

    def __init__(self, host: str, port: int, stats: dict[str, int], *, iface: str,
                 addr: str, udp_checksum: bool = False, traffic_class: int = 0) -> None:
        ip, mac = parse_addr(addr)
        if ip != str(ipaddress.ip_address(host)):
            raise ValueError(f"{host} is not the raw endpoint's address {ip}")
        if not 0 <= traffic_class <= 255:
            raise ValueError("traffic_class is the 8-bit TOS / Traffic Class octet")
        self.v6 = ":" in ip
        self.iface, self.mac = iface, mac
        self.address: tuple[str, int] = (ip, port or ROCE_PORT)
        self.gid = gid_of(ip)
        self.ip = ipaddress.ip_address(ip).packed
        self.udp_checksum, self.traffic_class = udp_checksum, traffic_class
        self.stats = stats
        self.eth_to: dict[bytes, bytes] = {}          # peer IP -> Ethernet header to it
        self._type = _H.pack(ETH_IPV6 if self.v6 else ETH_IPV4)
        self._names: dict[bytes, str] = {}
        self._waiting: dict[bytes, asyncio.Future] = {}
        self._conflict: asyncio.Future | None = None
        self._started: asyncio.Task | None = None
        self._kicks: set[asyncio.Task] = set()
        self._kernel_owns(ip)
        self.sock = self._open()
        self.mtu = self._ifreq(_SIOCGIFMTU)
        self._buf = bytearray(65536)
        self._view = memoryview(self._buf)
        log.info("%s: endpoint %s port %d, MAC %s%s, GID %s", iface, ip, self.address[1],
                 mac.hex(":"), "" if "/" in addr else
                 " (none given: a locally administered one derived from the IP)", self.gid)

    def __str__(self) -> str:
        return f"a raw socket on {self.iface}"

    def _kernel_owns(self, ip: str) -> None:
        """EADDRINUSE if this host's IP stack has ``ip`` (a UDP socket can bind to it)."""
        with socket.socket(socket.AF_INET6 if self.v6 else socket.AF_INET,
                           socket.SOCK_DGRAM) as s:
            try:
                s.bind((ip, 0))
            except OSError:
                return
        raise OSError(errno.EADDRINUSE, f"{ip} is configured on this host: the kernel owns it")

    def _open(self) -> socket.socket:
        """The socket, filtered before it is bound (so nothing unfiltered is queued),
        bound to the interface, with our MAC (and NDP groups) in its receive filter."""
        try:
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
        except PermissionError as exc:
            raise PermissionError(exc.errno, NEEDS_NET_RAW) from None
        try:
            _attach(sock, bpf_program(self.ip, self.address[1]))
            for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
                sock.setsockopt(socket.SOL_SOCKET, opt, _SOCK_BUF)
            sock.setsockopt(_SOL_PACKET, _PACKET_AUXDATA, 1)
            try:
                sock.bind((self.iface, _ETH_P_ALL))
            except OSError as exc:
                reason = "no such interface" if exc.errno == errno.ENODEV else exc.strerror
                raise OSError(exc.errno, f"interface {self.iface!r}: {reason}") from None
            self.sock = sock
            index = self._ifreq(_SIOCGIFINDEX)
            macs = [(_PACKET_MR_UNICAST, self.mac)]
            if self.v6:
                macs += [(_PACKET_MR_MULTICAST, _multicast_mac(solicited_node(self.ip))),
                         (_PACKET_MR_MULTICAST, _multicast_mac(_ALL_NODES))]
            for kind, mac in macs:
                sock.setsockopt(_SOL_PACKET, _PACKET_ADD_MEMBERSHIP,
                                struct.pack("iHH8s", index, kind, 6, mac))
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock

    def _ifreq(self, request: int) -> int:
        """An integer of the interface (``struct ifreq``) from the socket's namespace."""
        name = self.iface.encode()
        out = fcntl.ioctl(self.sock.fileno(), request, struct.pack("16si12x", name, 0))
        return struct.unpack_from("i", out, 16)[0]

    def _count(self, key: str) -> None:
        self.stats[key] = self.stats.get(key, 0) + 1

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        for task in self._kicks:
            task.cancel()
        self.sock.close()

    def path_mtu(self, host: str, port: int) -> int:
        """``ib_mtu`` of the interface's MTU: every peer is on the link."""
        return ib_mtu(self.mtu, self.v6)

    def report_refusals(self) -> None:
        """Nothing: this endpoint reads RoCEv2 frames only, not the ICMP errors they draw,
        so a connect to where nothing listens waits for its timeout."""

    def refused(self) -> list[tuple[str, int]]:
        return []

    # -- sending ------------------------------------------------------------------------

    def tx_path(self, addr: tuple[str, int]) -> RawPath:
        return RawPath(self, self.address, addr)

    def _send(self, parts: list) -> None:
        try:
            self.sock.sendmsg(parts)
        except (BlockingIOError, InterruptedError):
            self._count("tx_dropped")
        except OSError as exc:
            log.debug("%s: send: %s", self.iface, exc)
            self._count("tx_errors")

    def send(self, parts: list, addr: tuple[str, int], path: w.Path) -> None:
        assert isinstance(path, RawPath)     # from tx_path
        eth = self.eth_to.get(path.dst)
        if eth is None:                      # dropped, as a NIC does; the sender retries
            self._count("tx_unresolved")
            self._kick(path.dst)
            return
        n = 0
        for part in parts:
            n += len(part)
        self._send([path.head(eth, parts, n), *parts])

    def _ip_frame(self, dst_mac: bytes, dst: bytes, proto: int, payload: bytes,
                  src: bytes | None = None) -> bytes:
        """An IPv6 packet in a frame, Hop Limit 255 as NDP requires (RFC 4861 7.1)."""
        ip = _V6.pack(0x60000000, len(payload), proto, 255, self.ip if src is None else src,
                      dst)
        return dst_mac + self.mac + _H.pack(ETH_IPV6) + ip + payload

    def _icmp6(self, src: bytes, dst: bytes, kind: int, body: bytes) -> bytes:
        """An ICMPv6 message with its checksum (RFC 4443 2.3)."""
        msg = bytes([kind, 0, 0, 0]) + body
        csum = _checksum(_pseudo(src, dst, len(msg), 58) + msg)
        return msg[:2] + _H.pack(csum) + msg[4:]

    def _solicit(self, target: bytes, probe: bool = False) -> None:
        """ARP request (RFC 826; a probe has sender address 0, RFC 5227) or neighbour
        solicitation (RFC 4861 7.2.2; DAD's from ::, RFC 4862 5.4.2) for ``target``."""
        if not self.v6:
            arp = _ARP.pack(1, ETH_IPV4, 6, 4, 1, self.mac, bytes(4) if probe else self.ip,
                            bytes(6), target)
            self._send([_BROADCAST + self.mac + _H.pack(ETH_ARP) + arp])
            return
        src = bytes(16) if probe else self.ip
        group = solicited_node(target)
        options = b"" if probe else bytes([_SLLA, 1]) + self.mac
        msg = self._icmp6(src, group, _NS, bytes(4) + target + options)
        self._send([self._ip_frame(_multicast_mac(group), group, 58, msg, src)])

    # -- owning the address ---------------------------------------------------------------

    async def start(self) -> None:
        """Probe once for another owner of the address (EADDRINUSE if one answers)."""
        if self._started is None:
            self._started = asyncio.get_running_loop().create_task(self._probe())
        await asyncio.shield(self._started)

    async def _probe(self) -> None:
        self._conflict = asyncio.get_running_loop().create_future()
        try:
            self._solicit(self.ip, probe=True)
            done, _ = await asyncio.wait([self._conflict], timeout=PROBE_WAIT)
        finally:
            conflict, self._conflict = self._conflict, None
        if done:
            kind = "neighbour discovery" if self.v6 else "ARP"
            raise OSError(errno.EADDRINUSE, f"{self.address[0]} is in use on {self.iface}: "
                                            f"{conflict.result().hex(':')} answers {kind} for it")

    def _conflicting(self, mac: bytes) -> None:
        """Another station claims our address (RFC 5227 2.1.1, RFC 4862 5.4.3): our own
        frames never come back (the filter drops outgoing ones), so even with our MAC."""
        self._count("address_conflicts")
        if self._conflict is not None and not self._conflict.done():
            self._conflict.set_result(mac)
        else:
            log.warning("%s: %s also claims %s", self.iface, mac.hex(":"), self.address[0])

    # -- neighbours ---------------------------------------------------------------------

    def _learn(self, ip: bytes, mac: bytes) -> None:
        self.eth_to[ip] = mac + self.mac + self._type
        waiter = self._waiting.pop(ip, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def resolve(self, host: str, timeout: float) -> None:
        """The peer's MAC by ARP or neighbour solicitation, ``SOLICIT_TRIES`` times
        ``SOLICIT_INTERVAL`` apart; TimeoutError if no answer."""
        ip = ipaddress.ip_address(host).packed
        if ip in self.eth_to:
            return
        waiter = self._waiting.get(ip)
        if waiter is None:
            waiter = self._waiting[ip] = asyncio.get_running_loop().create_future()
        try:
            for _ in range(SOLICIT_TRIES):
                self._solicit(ip)
                done, _ = await asyncio.wait([waiter], timeout=SOLICIT_INTERVAL)
                if done:
                    return
        finally:
            if self._waiting.get(ip) is waiter and not waiter.done():
                del self._waiting[ip]
                waiter.cancel()
        kind = "neighbour advertisement" if self.v6 else "ARP reply"
        raise TimeoutError(f"no {kind} from {host} on {self.iface}")

    def _kick(self, ip: bytes) -> None:
        """Resolve ``ip`` in the background (a frame for it was just dropped)."""
        if ip in self._waiting:
            return
        task = asyncio.get_running_loop().create_task(
            self.resolve(socket.inet_ntop(socket.AF_INET6 if self.v6 else socket.AF_INET, ip),
                         SOLICIT_TRIES * SOLICIT_INTERVAL))
        self._kicks.add(task)
        task.add_done_callback(self._kicked)

    def _kicked(self, task: asyncio.Task) -> None:
        self._kicks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("%s: %s", self.iface, task.exception())

    def _arp(self, frame: memoryview) -> None:
        """RFC 826's packet reception, plus conflict detection (RFC 5227 2.1.1)."""
        if len(frame) < 42:
            return
        htype, ptype, hlen, plen, op, sha, spa, _tha, tpa = _ARP.unpack_from(frame, 14)
        if (htype, ptype, hlen, plen) != (1, ETH_IPV4, 6, 4):
            return
        self._count("arp_rx")
        if spa == self.ip:
            self._conflicting(sha)
            return
        if spa in self.eth_to or (tpa == self.ip and any(spa)):      # merge, or add
            self._learn(spa, sha)
        if tpa == self.ip and op == 1:
            reply = _ARP.pack(1, ETH_IPV4, 6, 4, 2, self.mac, self.ip, sha, spa)
            self._send([sha + self.mac + _H.pack(ETH_ARP) + reply])

    def _ndp(self, frame: memoryview, n: int) -> None:
        """Neighbour solicitations for our address and advertisements (RFC 4861 7.1, 7.2)."""
        end = 54 + _H.unpack_from(frame, 18)[0]
        if end > n or end < 78 or frame[21] != 255:
            return
        src, dst = bytes(frame[22:38]), bytes(frame[38:54])
        icmp = frame[54:end]
        kind, code = icmp[0], icmp[1]
        if kind not in (_NS, _NA) or code != 0 or _checksum(_pseudo(src, dst, len(icmp), 58)
                                                             + icmp) != 0:
            return
        self._count("ndp_rx")
        target = bytes(icmp[8:24])
        lla = {}
        i = 24
        while i + 8 <= len(icmp) and icmp[i + 1]:
            lla[icmp[i]] = bytes(icmp[i + 2:i + 8])
            i += 8 * icmp[i + 1]
        if kind == _NA:
            mac = lla.get(_TLLA, bytes(frame[6:12]))
            if target == self.ip:
                self._conflicting(mac)
            elif target in self.eth_to or target in self._waiting:
                self._learn(target, mac)
            return
        if target != self.ip:
            return
        if not any(src):                       # another station's duplicate address detection
            if self._conflict is not None:
                self._conflicting(bytes(frame[6:12]))
                return
            dst, dst_mac, flags = _ALL_NODES, _multicast_mac(_ALL_NODES), 0x20000000
        else:
            dst_mac = lla.get(_SLLA, bytes(frame[6:12]))
            if _SLLA in lla or src in self.eth_to:
                self._learn(src, dst_mac)
            dst, flags = src, 0x60000000       # Solicited, Override
        msg = self._icmp6(self.ip, dst, _NA, struct.pack("!I", flags) + self.ip
                          + bytes([_TLLA, 1]) + self.mac)
        self._send([self._ip_frame(dst_mac, dst, 58, msg)])

    # -- receiving ----------------------------------------------------------------------

    def _name(self, ip: bytes) -> str:
        name = self._names.get(ip)
        if name is None:
            name = self._names[ip] = str(ipaddress.ip_address(ip))
        return name

    def receive(self, limit: int) -> Iterator[Received]:
        """RoCEv2 datagrams of up to ``limit`` frames (ARP and NDP answered on the way),
        each with its source and its frame (trailing Ethernet padding cut)."""
        sock, buf, view, unpack = self.sock, self._buf, self._view, _H.unpack_from
        for _ in range(limit):
            try:
                n, aux, _, _ = sock.recvmsg_into([buf], _AUX_SPACE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.debug("%s: recv: %s", self.iface, exc)
                return
            self.stats["frames_in"] = self.stats.get("frames_in", 0) + 1
            if n < 42:
                continue
            kind = unpack(buf, 12)[0]
            if kind == ETH_IPV4 and not self.v6:
                ihl = (buf[14] & 15) * 4
                end = 14 + unpack(buf, 16)[0]
                if ihl < 20 or end > n or _checksum(view[14:14 + ihl]) != 0:
                    self._count("bad_ip")
                    continue
                u, ecn, src = 14 + ihl, buf[15] & 3, bytes(buf[26:30])
            elif kind == ETH_IPV6 and self.v6 and n >= 62:
                end = 54 + unpack(buf, 18)[0]
                if end > n:
                    self._count("bad_ip")
                    continue
                if buf[20] == 58:
                    self._ndp(view, n)
                    continue
                u, ecn, src = 54, buf[15] >> 4 & 3, bytes(buf[22:38])
            elif kind == ETH_ARP:
                self._arp(view[:n])
                continue
            else:
                continue
            ulen = unpack(buf, u + 4)[0]
            if ulen < 8 or u + ulen > end:
                self._count("bad_udp")
                continue
            if unpack(buf, u + 6)[0] and not _checksum_settled(aux) and _checksum(
                    _pseudo(src, self.ip, ulen, 17) + view[u:u + ulen]) != 0:
                self._count("udp_checksum_errors")
                continue
            if ecn == 3:
                self._count("ecn_ce")      # congestion experienced (annex A17.9)
            if src not in self.eth_to:
                self._learn(src, bytes(buf[6:12]))
            yield view[u + 8:u + ulen], (self._name(src), unpack(buf, u)[0]), view[:u + ulen]

    def check(self, path: w.Path, data: memoryview, wire: memoryview | None) -> bool:
        """The ICRC over the headers the frame came with (annex A17.4.5)."""
        assert wire is not None              # receive() always hands the frame on
        if not self.v6 and (wire[14] != 0x45 or wire[18:22] != b"\0\0\x40\0"):
            return _Seen(wire[14:-len(data) - 8], wire[-len(data) - 8:]).check(data)
        return path.check(data)
