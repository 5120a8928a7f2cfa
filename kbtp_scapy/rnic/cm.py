"""InfiniBand Communication Manager MADs, as librdmacm exchanges them over RoCEv2.

The RoCEv2 binding sets up each reliable connection the way the Linux kernel CM does for
librdmacm: REQ, REP, RTU to open (REJ to refuse, MRA to ask for time), DREQ, DREP to
close, each a 256-octet MAD in a UD SEND ONLY to QP1. Sending them (rather than agreeing
on QPNs out of band) puts the set-up into captures, and Wireshark needs REQ and REP to tie
the two directions of a connection together.

Layouts: the common MAD header is IBA vol 1 section 13.4.2; the CM messages are
section 12.6 (the table numbers below are release 1.4's, which Linux's
include/rdma/ibta_vol1_c12.h also uses). Byte offsets in comments count from the start of
the CM message, i.e. after the 24-octet MAD header.
"""
from __future__ import annotations

import enum
import ipaddress
import struct
from dataclasses import dataclass

__all__ = ["CmAttr", "CmMessage", "GSI_QKEY", "GSI_QPN", "MAD_SIZE", "PRIVATE_DATA_SIZE",
           "decode", "encode", "parse_rdma_cm_private_data", "rdma_cm_flow_label",
           "rdma_cm_private_data", "rdma_cm_service_id"]

MAD_SIZE = 256
GSI_QPN = 1              # CM MADs go to and come from the General Services Interface QP
GSI_QKEY = 0x80010000    # its well-known Q_Key, carried in the DETH

# Common MAD header (IBA 13.4.2): BaseVersion, MgmtClass, ClassVersion, Method, Status,
# ClassSpecific, TransactionID, AttributeID, reserved, AttributeModifier.
_HEADER = struct.Struct(">BBBBHHQH2xI")
_BASE_VERSION = 1
_CM_CLASS = 0x07
_CM_CLASS_VERSION = 2    # IBA 1.2 and later; what Linux sends
_METHOD_SEND = 0x03


class CmAttr(enum.IntEnum):
    """CM attribute IDs (IBA 12.6) of the messages a reliable connection uses."""

    REQ = 0x0010
    MRA = 0x0011
    REJ = 0x0012
    REP = 0x0013
    RTU = 0x0014
    DREQ = 0x0015
    DREP = 0x0016


#: Private data octets each message has room for (IBA 12.6.5 to 12.6.11).
PRIVATE_DATA_SIZE = {CmAttr.REQ: 92, CmAttr.MRA: 222, CmAttr.REJ: 148, CmAttr.REP: 196,
                     CmAttr.RTU: 224, CmAttr.DREQ: 220, CmAttr.DREP: 224}

# Path MTU in octets <-> the IB MTU enumeration (1 = 256 ... 5 = 4096).
_MTU_CODE = {256: 1, 512: 2, 1024: 3, 2048: 4, 4096: 5}
_MTU_OCTETS = {code: octets for octets, code in _MTU_CODE.items()}

# CM message layouts after the MAD header, 232 octets each. Q_Key and EE context fields
# are written as zero (RC has neither); the REQ alternate path (octets 96..139) too, since
# rdma_cm never sends one over RoCE.
_REQ = struct.Struct(">I4xQQ4xIIIIIHBBHH16s16sIBBBB44x92s")  # 12.6.5, Table 106
_MRA = struct.Struct(">IIBB222s")                              # 12.6.6, Table 107
_REJ = struct.Struct(">IIBBH72s148s")                          # 12.6.7, Table 108
_REP = struct.Struct(">II4xIIIBBBBQ196s")                      # 12.6.8, Table 110
_RTU_DREP = struct.Struct(">II224s")                           # 12.6.9 and 12.6.11, Tables 111, 113
_DREQ = struct.Struct(">III220s")                              # 12.6.10, Table 112

_RDMA_PS_TCP = 0x0106    # librdmacm port space of RDMA_PS_TCP; service ID = PS << 16 | port
_CMA_HEADER = struct.Struct(">BBH16s16s")   # librdmacm's struct cma_hdr, 36 octets


@dataclass
class CmMessage:
    """One CM message. Defaults are what Linux's CM and rxe put in a librdmacm REQ/REP."""

    attr: CmAttr
    transaction_id: int
    local_comm_id: int = 0
    remote_comm_id: int = 0
    service_id: int = 0          # REQ
    local_qpn: int = 0           # REQ, REP (24 bits)
    remote_qpn: int = 0          # DREQ (the peer's QPN)
    starting_psn: int = 0        # REQ, REP (24 bits)
    path_mtu: int = 1024         # REQ (octets; encoded as the IB MTU enum)
    responder_resources: int = 0  # REQ, REP
    initiator_depth: int = 0     # REQ, REP
    local_gid: str = ""          # REQ primary path: the requester's IP ("" = zero GID)
    remote_gid: str = ""         # REQ primary path: the responder's IP (tshark keys on it)
    reject_reason: int = 0       # REJ
    private_data: bytes = b""    # padded with zeros (or cut) to PRIVATE_DATA_SIZE[attr]
    local_ca_guid: int = 0       # REQ, REP: the sender's node GUID (rxe: EUI-64 of its MAC)
    remote_cm_response_timeout: int = 20   # REQ: 4.096 us * 2**20, librdmacm's value
    local_cm_response_timeout: int = 20    # REQ
    transport_type: int = 0      # REQ: 0 RC, 1 UC
    flow_control: bool = False   # REQ, REP: end-to-end flow control
    retry_count: int = 7         # REQ: transport retries
    rnr_retry_count: int = 7     # REQ, REP: 7 means retry forever
    max_cm_retries: int = 15     # REQ
    srq: bool = False            # REQ, REP
    pkey: int = 0xFFFF           # REQ: the default partition
    local_lid: int = 0xFFFF      # REQ: RoCE has no LIDs; the permissive LID stands in
    remote_lid: int = 0xFFFF
    flow_label: int = 0          # REQ (20 bits); Linux derives it, see rdma_cm_flow_label
    packet_rate: int = 0         # REQ (6 bits)
    traffic_class: int = 0       # REQ
    hop_limit: int = 64          # REQ: RoCEv2 paths are routed, so a GRH with TTL 64
    sl: int = 0                  # REQ service level
    subnet_local: bool = False   # REQ: RoCEv2 always carries the GRH-equivalent IP header
    local_ack_timeout: int = 17  # REQ: packet lifetime 16 + 1, as Linux computes for rxe
    target_ack_delay: int = 15   # REP: rxe's local CA ACK delay
    failover_accepted: int = 0   # REP (2 bits: 0 accepted, 1 not supported, 2 rejected)
    message: int = 0             # REJ MessageREJected / MRA MessageMRAed: 0 REQ, 1 REP, 2 other
    reject_info: bytes = b""     # REJ additional reject information (up to 72 octets)
    service_timeout: int = 0     # MRA (5 bits)


def _check(value: int, bits: int, name: str) -> int:
    """Refuse values that would spill into a neighbouring bit field."""
    if not 0 <= value < 1 << bits:
        raise ValueError(f"{name}={value!r} does not fit in {bits} bits")
    return value


def _gid(address: str) -> bytes:
    """An IP address as a GID: IPv4 as IPv4-mapped IPv6, as RoCEv2 GIDs are (IBA Annex A17)."""
    if not address:
        return bytes(16)
    ip = ipaddress.ip_address(address)
    if ip.version == 4:
        return bytes(10) + b"\xff\xff" + ip.packed
    return ip.packed


def _gid_str(gid: bytes) -> str:
    """The inverse of _gid."""
    if gid == bytes(16):
        return ""
    ip = ipaddress.IPv6Address(gid)
    return str(ip.ipv4_mapped or ip)


def _pad(data: bytes, size: int) -> bytes:
    return bytes(data[:size]).ljust(size, b"\0")


def encode(msg: CmMessage) -> bytes:
    """The 256-octet MAD (header and CM message) carrying ``msg``; ValueError if a field
    does not fit."""
    attr = CmAttr(msg.attr)
    try:
        return _HEADER.pack(_BASE_VERSION, _CM_CLASS, _CM_CLASS_VERSION, _METHOD_SEND, 0, 0,
                            msg.transaction_id, attr, 0) + _body(msg, attr)
    except struct.error as exc:   # a whole-octet field out of range
        raise ValueError(str(exc)) from None


def _body(msg: CmMessage, attr: CmAttr) -> bytes:
    """The 232-octet CM message after the MAD header."""
    private = _pad(msg.private_data, PRIVATE_DATA_SIZE[attr])
    if attr == CmAttr.REQ:
        if msg.path_mtu not in _MTU_CODE:
            raise ValueError(f"path_mtu={msg.path_mtu!r} is not an IB MTU")
        return _REQ.pack(
            msg.local_comm_id, msg.service_id, msg.local_ca_guid, 0,
            _check(msg.local_qpn, 24, "local_qpn") << 8
            | _check(msg.responder_resources, 8, "responder_resources"),
            _check(msg.initiator_depth, 8, "initiator_depth"),  # local EECN 0: no RD
            _check(msg.remote_cm_response_timeout, 5, "remote_cm_response_timeout") << 3
            | _check(msg.transport_type, 2, "transport_type") << 1 | bool(msg.flow_control),
            _check(msg.starting_psn, 24, "starting_psn") << 8
            | _check(msg.local_cm_response_timeout, 5, "local_cm_response_timeout") << 3
            | _check(msg.retry_count, 3, "retry_count"),
            msg.pkey,
            _MTU_CODE[msg.path_mtu] << 4 | _check(msg.rnr_retry_count, 3, "rnr_retry_count"),
            _check(msg.max_cm_retries, 4, "max_cm_retries") << 4 | bool(msg.srq) << 3,
            msg.local_lid, msg.remote_lid, _gid(msg.local_gid), _gid(msg.remote_gid),
            _check(msg.flow_label, 20, "flow_label") << 12
            | _check(msg.packet_rate, 6, "packet_rate"),
            msg.traffic_class, msg.hop_limit,
            _check(msg.sl, 4, "sl") << 4 | bool(msg.subnet_local) << 3,
            _check(msg.local_ack_timeout, 5, "local_ack_timeout") << 3,
            private)
    elif attr == CmAttr.REP:
        return _REP.pack(
            msg.local_comm_id, msg.remote_comm_id, _check(msg.local_qpn, 24, "local_qpn") << 8,
            0, _check(msg.starting_psn, 24, "starting_psn") << 8,
            msg.responder_resources, msg.initiator_depth,
            _check(msg.target_ack_delay, 5, "target_ack_delay") << 3
            | _check(msg.failover_accepted, 2, "failover_accepted") << 1 | bool(msg.flow_control),
            _check(msg.rnr_retry_count, 3, "rnr_retry_count") << 5 | bool(msg.srq) << 4,
            msg.local_ca_guid, private)
    elif attr == CmAttr.REJ:
        info = bytes(msg.reject_info)
        if len(info) > 72:
            raise ValueError("reject_info is longer than 72 octets")
        return _REJ.pack(msg.local_comm_id, msg.remote_comm_id,
                         _check(msg.message, 2, "message") << 6, len(info) << 1,
                         msg.reject_reason, info, private)
    elif attr == CmAttr.MRA:
        return _MRA.pack(msg.local_comm_id, msg.remote_comm_id,
                         _check(msg.message, 2, "message") << 6,
                         _check(msg.service_timeout, 5, "service_timeout") << 3, private)
    elif attr == CmAttr.DREQ:
        return _DREQ.pack(msg.local_comm_id, msg.remote_comm_id,
                          _check(msg.remote_qpn, 24, "remote_qpn") << 8, private)
    else:  # RTU, DREP
        return _RTU_DREP.pack(msg.local_comm_id, msg.remote_comm_id, private)


def decode(mad: bytes) -> CmMessage | None:
    """The CM message in a 256-octet MAD, or None if ``mad`` is not a CM Send of one of
    the CmAttr messages (wrong size, class, version or method, unknown attribute, or a
    REQ with an invalid MTU). Reserved bits and the REQ alternate path are ignored."""
    if not isinstance(mad, (bytes, bytearray, memoryview)) or len(mad) != MAD_SIZE:
        return None
    mad = bytes(mad)
    base, mgmt_class, version, method, _, _, tid, attr_id, _ = _HEADER.unpack_from(mad)
    if (base, mgmt_class, version, method) != (_BASE_VERSION, _CM_CLASS, _CM_CLASS_VERSION,
                                               _METHOD_SEND):
        return None
    try:
        attr = CmAttr(attr_id)
    except ValueError:
        return None
    offset = _HEADER.size
    msg = CmMessage(attr, tid)
    if attr == CmAttr.REQ:
        (msg.local_comm_id, msg.service_id, msg.local_ca_guid, _, qpn_rr, eecn_id, timeouts,
         psn_retry, msg.pkey, mtu_rnr, cm_srq, msg.local_lid, msg.remote_lid, local_gid,
         remote_gid, flow_rate, msg.traffic_class, msg.hop_limit, sl_subnet, ack,
         msg.private_data) = _REQ.unpack_from(mad, offset)
        if mtu_rnr >> 4 not in _MTU_OCTETS:
            return None
        msg.local_qpn, msg.responder_resources = qpn_rr >> 8, qpn_rr & 0xFF
        msg.initiator_depth = eecn_id & 0xFF
        msg.remote_cm_response_timeout = timeouts >> 3 & 0x1F
        msg.transport_type = timeouts >> 1 & 3
        msg.flow_control = bool(timeouts & 1)
        msg.starting_psn = psn_retry >> 8
        msg.local_cm_response_timeout = psn_retry >> 3 & 0x1F
        msg.retry_count = psn_retry & 7
        msg.path_mtu = _MTU_OCTETS[mtu_rnr >> 4]
        msg.rnr_retry_count = mtu_rnr & 7
        msg.max_cm_retries, msg.srq = cm_srq >> 4, bool(cm_srq & 8)
        msg.local_gid, msg.remote_gid = _gid_str(local_gid), _gid_str(remote_gid)
        msg.flow_label, msg.packet_rate = flow_rate >> 12, flow_rate & 0x3F
        msg.sl, msg.subnet_local = sl_subnet >> 4, bool(sl_subnet & 8)
        msg.local_ack_timeout = ack >> 3
    elif attr == CmAttr.REP:
        (msg.local_comm_id, msg.remote_comm_id, qpn, _, psn, msg.responder_resources,
         msg.initiator_depth, delay, rnr, msg.local_ca_guid,
         msg.private_data) = _REP.unpack_from(mad, offset)
        msg.local_qpn, msg.starting_psn = qpn >> 8, psn >> 8
        msg.target_ack_delay = delay >> 3
        msg.failover_accepted = delay >> 1 & 3
        msg.flow_control = bool(delay & 1)
        msg.rnr_retry_count, msg.srq = rnr >> 5, bool(rnr & 0x10)
    elif attr == CmAttr.REJ:
        (msg.local_comm_id, msg.remote_comm_id, rejected, info_length, msg.reject_reason,
         info, msg.private_data) = _REJ.unpack_from(mad, offset)
        msg.message = rejected >> 6
        msg.reject_info = info[:info_length >> 1]
    elif attr == CmAttr.MRA:
        (msg.local_comm_id, msg.remote_comm_id, mraed, timeout,
         msg.private_data) = _MRA.unpack_from(mad, offset)
        msg.message, msg.service_timeout = mraed >> 6, timeout >> 3
    elif attr == CmAttr.DREQ:
        (msg.local_comm_id, msg.remote_comm_id, qpn,
         msg.private_data) = _DREQ.unpack_from(mad, offset)
        msg.remote_qpn = qpn >> 8
    else:  # RTU, DREP
        msg.local_comm_id, msg.remote_comm_id, msg.private_data = _RTU_DREP.unpack_from(
            mad, offset)
    return msg


def rdma_cm_service_id(port: int) -> int:
    """The service ID librdmacm puts in a REQ for a TCP-port-space listener on ``port``
    (IBA Annex A11, RDMA IP CM service: prefix 0x0000000001, protocol 0x06 = TCP)."""
    return _RDMA_PS_TCP << 16 | _check(port, 16, "port")


def rdma_cm_flow_label(src_port: int, dst_port: int) -> int:
    """The REQ flow label Linux's rdma_cm sets on RoCEv2: a hash of the rdma_cm source port
    (the CMA header's) and the destination port (the service ID's)."""
    return (src_port * 31 + dst_port) & 0xFFFFF


def rdma_cm_private_data(src_ip: str, dst_ip: str, src_port: int) -> bytes:
    """The 36-octet CMA header that starts the private data of every librdmacm REQ
    (IBA Annex A11, RDMA IP CM service): version 0, IP version in the upper nibble, the source port,
    then source and destination address in 16 octets each (IPv4 in the last four)."""
    src, dst = ipaddress.ip_address(src_ip), ipaddress.ip_address(dst_ip)
    if src.version != dst.version:
        raise ValueError(f"{src_ip} and {dst_ip} are not of the same IP version")
    return _CMA_HEADER.pack(0, src.version << 4, _check(src_port, 16, "src_port"),
                            src.packed.rjust(16, b"\0"), dst.packed.rjust(16, b"\0"))


def parse_rdma_cm_private_data(data: bytes) -> tuple[str, str, int] | None:
    """(source IP, destination IP, source port) from a REQ's CMA header, or None if
    ``data`` does not start with a version 0 header for IPv4 or IPv6."""
    if len(data) < _CMA_HEADER.size:
        return None
    version, ip_version, port, src, dst = _CMA_HEADER.unpack_from(bytes(data))
    if version != 0 or ip_version >> 4 not in (4, 6):
        return None
    if ip_version >> 4 == 4:
        return str(ipaddress.IPv4Address(src[12:])), str(ipaddress.IPv4Address(dst[12:])), port
    return str(ipaddress.IPv6Address(src)), str(ipaddress.IPv6Address(dst)), port
