"""Fuzzing the Lua dissector in real tshark 4.0: robustness, not correctness.

Over thousands of truncated, bit-flipped and field-fuzzed variants of the sample captures,
tshark with ``dissector/kbtp.lua`` must print no Lua error and no dissector bug, and exit 0,
in one pass and in two passes (``-2``, which revisits every frame as the GUI does). One
exception: tshark 4.0's own RPC-over-RDMA heuristic hits a dissector-bug assertion on some
Sends in a second pass with no plugin loaded at all (a lone RC Send Last is enough); such a
frame fails the test only if tshark without the plugin does not report the same.

The variants are built here, in Python, from a fixed seed (``KBTP_FUZZ_SEED``), and go into
a handful of pcaps, so one tshark run covers thousands of them:

* ``raw_*``: the frames of ``pcaps/*.pcap`` (iWARP and RoCEv2, with ADDR_LE over IPv6), one
  copy of the session per round on its own address pair, with a share of the frames
  mutated: cut short (snap length, or the frame itself), bits flipped in the KBTP part or
  anywhere, KBTP header octets set to boundary values, the KBTP part cut with the transport
  lengths adjusted. Over half keep valid transport framing (RoCEv2 ICRC, MPA CRC32c, IP,
  UDP and TCP checksums recomputed: ``Frame.valid``) so the KBTP dissector runs on them as
  on good traffic; the others stay raw corrupted frames.
* ``reframed_*``: sessions recorded with the project's framing (``RcConnection`` with PSNs
  that wrap, path MTU 256 for multi-packet Sends; ``IwarpConversation`` with two FPDUs per
  segment, split FPDUs, markers, MPA revision 2), carrying codec-encoded messages with random
  field values and lies (wrong lengths, unknown and Private Use opcodes, undefined flag bits,
  inline length lies, truncation, trailing junk), scapy ``fuzz()`` of the KBTP layers,
  answers to requests never made, and RDMA Writes, Reads and FetchAdds at the advertised
  STags. RoCEv2 frames are then dropped, duplicated and swapped (ICRCs stay right).

Marked ``fuzz`` (``pytest -m fuzz``; ``-m "not fuzz"`` skips it). ``KBTP_FUZZ_SCALE=4``
makes four times as many variants. To keep the pcaps and rerun tshark by hand:
``python tests/test_dissector_fuzz.py OUTDIR [SEED]``.
"""
from __future__ import annotations

import os
import random
import re
import struct
import subprocess
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from scapy.compat import raw
from scapy.contrib.roce import BTH
from scapy.layers.inet import IP, UDP
from scapy.layers.inet6 import IPv6
from scapy.packet import Raw, fuzz
from scapy.utils import RawPcapReader, checksum

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kbtp_scapy import codec, ring, tables as T
from kbtp_scapy.builders.iwarp import IwarpConversation, segment_message
from kbtp_scapy.builders.roce import RcConnection, RoceEndpoint
from kbtp_scapy.layers import kbtp as K
from kbtp_scapy.layers.iwarp import (
    MPA_REP_KEY,
    MPA_REQ_KEY,
    Op,
    RDMAPAtomicRequest,
    RDMAPAtomicResponse,
    RDMAPReadRequest,
    crc32c,
)
from kbtp_scapy.layers.roce import HEADERS
from tests.tshark import TSHARK, needs_tshark

pytestmark = [needs_tshark, pytest.mark.fuzz, pytest.mark.slow]

LUA = ROOT / "dissector" / "kbtp.lua"
SAMPLES = sorted((ROOT / "pcaps").glob("*.pcap"))
SEED = int(os.environ.get("KBTP_FUZZ_SEED", "20240917"))
SCALE = float(os.environ.get("KBTP_FUZZ_SCALE", "1"))
#: What tshark 4.0 prints for a Lua error (tree item, expert info, Info column; "Lua: ..."
#: on stderr for errors while loading or initialising) and for a DissectorError exception
#: (tree, Info column, and a warning on stderr). Checked against a broken script below.
BAD = ("Lua Error", "Lua: Error", "Lua: syntax error", "dissector bug", "Dissector bug")
KBTP_TREE = b"\nKV Cache Block Transfer Protocol"

ROCE_PORT, ETH_IPV4, ETH_IPV6 = 4791, 0x0800, 0x86DD
_EXT_SIZE = {op: sum(len(raw(cls())) for cls in classes) for op, classes in HEADERS.items()}
_OPS = [m.opcode for m in T.MESSAGES]
_STATUSES = [v.value for v in T.STATUS.values]


# ---- frames: where the KBTP part is, and how to make the framing valid again ------------

@dataclass
class Frame:
    """One pcap record; ``wirelen`` above ``len(data)`` means cut by the snap length."""

    data: bytearray
    ts: float
    note: str
    wirelen: int | None = None
    valid: bool = True               # transport framing right (CRCs, lengths, checksums)


@dataclass
class Where:
    """Offsets into an Ethernet frame (None where a layer is absent)."""

    l3: int
    v6: bool
    l4: int
    ip_end: int
    roce: bool = False
    bth: int | None = None
    mpa: int | None = None           # the FPDU's ULPDU Length field
    start: int | None = None         # KBTP part (RDMA payload) [start, end)
    end: int | None = None


def locate(d: bytes) -> Where | None:
    """Parse Ethernet / IPv4|IPv6 / UDP 4791 + BTH or TCP + one MPA FPDU."""
    if len(d) < 14:
        return None
    etype = int.from_bytes(d[12:14], "big")
    if etype == ETH_IPV4 and len(d) >= 34:
        l3, proto = 14, d[23]
        l4, ip_end = l3 + (d[14] & 0xF) * 4, l3 + int.from_bytes(d[16:18], "big")
        v6 = False
    elif etype == ETH_IPV6 and len(d) >= 54:
        l3, proto, l4, v6 = 14, d[20], 54, True
        ip_end = l4 + int.from_bytes(d[18:20], "big")
    else:
        return None
    w = Where(l3, v6, l4, min(ip_end, len(d)))
    if proto == 17 and len(d) >= l4 + 20 and int.from_bytes(d[l4 + 2:l4 + 4], "big") == ROCE_PORT:
        w.roce, w.bth = True, l4 + 8
        op = d[w.bth]
        if op in _EXT_SIZE:
            w.start = w.bth + 12 + _EXT_SIZE[op]
            w.end = w.ip_end - 4 - ((d[w.bth + 1] >> 4) & 3)
            if w.end < w.start:
                w.start = w.end = None
    elif proto == 6 and len(d) >= l4 + 20:
        p = l4 + (d[l4 + 12] >> 4) * 4
        if w.ip_end - p >= 20 and d[p:p + 16] not in (MPA_REQ_KEY, MPA_REP_KEY):
            w.mpa = p
            ulpdu = int.from_bytes(d[p:p + 2], "big")
            hdr = 14 if d[p + 2] & 0x80 else 18
            if 2 + ulpdu + (-(2 + ulpdu) % 4) + 4 <= w.ip_end - p and ulpdu >= hdr:
                w.start, w.end = p + 2 + hdr, p + 2 + ulpdu
            else:
                w.mpa = None
    return w


def fix(d: bytearray, lengths: bool = False) -> None:
    """Make the framing of ``d`` valid again: IP/UDP/TCP lengths (``lengths``: from the
    frame size), IPv4 header checksum, UDP/TCP checksums, RoCEv2 ICRC, MPA CRC32c."""
    w = locate(d)
    if w is None:
        return
    if lengths:
        if w.v6:
            d[18:20] = (len(d) - 54).to_bytes(2, "big")
        else:
            d[16:18] = (len(d) - 14).to_bytes(2, "big")
        if w.roce:
            d[w.l4 + 4:w.l4 + 6] = (len(d) - w.l4).to_bytes(2, "big")
        w = locate(d)
    if not w.v6:
        d[24:26] = b"\0\0"
        d[24:26] = checksum(bytes(d[14:w.l4])).to_bytes(2, "big")
    if w.mpa is not None:
        ulpdu = int.from_bytes(d[w.mpa:w.mpa + 2], "big")
        crc_at = w.mpa + 2 + ulpdu + (-(2 + ulpdu) % 4)
        d[crc_at:crc_at + 4] = struct.pack("<I", crc32c(bytes(d[w.mpa:crc_at])))
    if w.roce and w.ip_end - w.l4 >= 24:
        pseudo = bytearray(b"\xff" * 8) + d[w.l3:w.ip_end - 4]
        if w.v6:
            pseudo[8:12] = b"\x6f\xff\xff\xff"
            pseudo[8 + 7] = 0xFF
        else:
            pseudo[8 + 1] = pseudo[8 + 8] = 0xFF
            pseudo[8 + 10:8 + 12] = b"\xff\xff"
        u = 8 + w.l4 - w.l3
        pseudo[u + 6:u + 8] = b"\xff\xff"
        pseudo[u + 8 + 4] = 0xFF
        d[w.ip_end - 4:w.ip_end] = struct.pack("<I", zlib.crc32(bytes(pseudo)))
    if w.roce and not w.v6:
        return  # RoCEv2 over IPv4 carries UDP checksum 0
    if w.ip_end < w.l4:
        return  # a mutated IP length that ends the datagram inside its own headers
    ck = w.l4 + (6 if w.roce else 16)
    d[ck:ck + 2] = b"\0\0"
    src = d[w.l3 + 8:w.l3 + 40] if w.v6 else d[w.l3 + 12:w.l3 + 20]
    pseudo = bytes(src) + struct.pack("!HH", 17 if w.roce else 6, w.ip_end - w.l4)
    value = checksum(pseudo + bytes(d[w.l4:w.ip_end])) or 0xFFFF
    d[ck:ck + 2] = value.to_bytes(2, "big")


def isolate(d: bytearray, n: int) -> None:
    """Put copy ``n`` of a session on its own address pair (a session of its own for the
    dissector, a TCP connection of its own for tshark)."""
    w = locate(d)
    if w is None:
        return
    for addr in ((w.l3 + 8, w.l3 + 24) if w.v6 else (w.l3 + 12, w.l3 + 16)):
        if w.v6:
            d[addr + 8:addr + 10] = (n & 0xFFFF).to_bytes(2, "big")
        else:
            d[addr + 1:addr + 3] = (n & 0xFFFF).to_bytes(2, "big")


# ---- raw variants of the sample frames -----------------------------------------------------

def _flip(rng: random.Random, d: bytearray, lo: int, hi: int, bits: int) -> None:
    for _ in range(bits):
        i = rng.randrange(lo, hi)
        d[i] ^= 1 << rng.randrange(8)


def mutate(rng: random.Random, f: Frame) -> None:
    """One random mutation of ``f`` in place; ``f.note`` says which."""
    d, w = f.data, locate(f.data)
    kbtp = w is not None and w.start is not None and w.end > w.start
    kinds = ["snap", "cut", "flip-any", "flip-any-crc"]
    if kbtp:
        kinds += ["flip-kbtp-fixed"] * 3 + ["flip-kbtp", "kbtp-header-fixed", "kbtp-header-fixed",
                                            "kbtp-cut-fixed", "kbtp-cut-fixed"]
    kind = rng.choice(kinds)
    if kind == "snap":
        f.wirelen = len(d)
        del d[rng.randrange(1, len(d)):]
    elif kind == "cut":
        del d[rng.randrange(14, len(d)):]
    elif kind.startswith("flip-any"):
        _flip(rng, d, 12, len(d), rng.randint(1, 4))
        if kind.endswith("crc"):  # checksums and CRCs recomputed, where the headers still parse
            fix(d)
    elif kind.startswith("flip-kbtp"):
        _flip(rng, d, w.start, min(w.end, w.start + 64) if rng.random() < 0.8 else w.end,
              rng.choice((1, 1, 2, 3, 8)))
        if kind.endswith("fixed"):
            fix(d)
    elif kind == "kbtp-header-fixed":
        at = w.start + rng.choice((0, 1, 2, 3, 4, 11, 20, 22, 24, 28, 36, 40))
        if at < w.end:
            d[at] = rng.choice((0, 1, 0x7F, 0x80, 0xC0, 0xFF, rng.randrange(256)))
        if w.end - w.start >= 2 and rng.random() < 0.5:
            d[w.start], d[w.start + 1] = 1, rng.choice(_OPS + [0xC0, 0xFF, rng.randrange(256)])
        fix(d)
    elif kind == "kbtp-cut-fixed":
        keep = rng.choice((0, 1, 23, 24, 25, rng.randrange(0, w.end - w.start + 1)))
        keep = min(keep, w.end - w.start)
        if w.roce:
            del d[w.start + keep:]
            pad = -(w.start + keep - w.bth) % 4
            d[w.bth + 1] = (d[w.bth + 1] & 0xCF) | (pad << 4)
            d += bytes(pad) + b"\0\0\0\0"
        else:
            ulpdu = w.start + keep - w.mpa - 2
            d[w.mpa:w.mpa + 2] = ulpdu.to_bytes(2, "big")
            del d[w.start + keep:]
            d += bytes(-(2 + ulpdu) % 4) + b"\0\0\0\0"
        fix(d, lengths=True)
    f.note += f" {kind}"
    f.valid = kind.endswith("fixed")


def raw_variants(rng: random.Random, sample: Path, rounds: int, share: float,
                 base: int) -> tuple[list[Frame], int]:
    """``rounds`` copies of a sample session, each on its own addresses, with about
    ``share`` of the frames (more of those carrying KBTP) mutated."""
    records = [(pkt, meta.sec + meta.usec / 1e6) for pkt, meta in RawPcapReader(str(sample))]
    frames, variants = [], 0
    for r in range(rounds):
        for i, (data, ts) in enumerate(records):
            f = Frame(bytearray(data), ts + (base + r) * 60.0, f"{sample.name} round {r} frame {i + 1}")
            isolate(f.data, base + r)
            fix(f.data)
            w = locate(f.data)
            weight = 2.0 if (w is not None and w.start is not None) else 0.5
            if rng.random() < share * weight:
                mutate(rng, f)
                variants += 1
            frames.append(f)
    return frames, variants


# ---- field-fuzzed KBTP messages -------------------------------------------------------------

def _int(rng: random.Random, size: int) -> int:
    top = (1 << (8 * size)) - 1
    return rng.choice((0, 1, top, top >> 1, rng.randrange(256), rng.getrandbits(8 * size)))


def fuzzed_message(rng: random.Random, addr_le: bool, rid: int) -> bytes:
    """A KBTP message with random field values, many of them lies."""
    roll = rng.random()
    if roll < 0.12:  # scapy's fuzz() on the layers, Version and Opcode kept
        op = rng.choice(_OPS)
        pkt = fuzz(K.KBTP(version=1, opcode=op, addr_le=addr_le) / K.BODY_CLASSES[op]())
        data = bytes(pkt)
    else:
        op = rng.choice(_OPS * 4 + [0, 3, 0x15, 0x21, 0x31, 0xBF, 0xC0, 0xFE, 0xFF,
                                   rng.randrange(256)])
        values = {"opcode": op, "request_id": rng.choice((rid, rid, _int(rng, 8))),
                  "handle": _int(rng, 8), "generation": _int(rng, 2),
                  "status": rng.choice(_STATUSES + [0xC000, 0xFFFF, _int(rng, 2)])}
        if rng.random() < 0.6:
            values["flags"] = rng.choice((0, 1, 4, 5, 0x1F, 0x20, 0x8000, 0xF000, 0xFFFF,
                                          rng.getrandbits(16)))
        if op in T.BY_OPCODE:
            for f in T.flatten(T.BY_OPCODE[op].body):
                if f.field.size == 0:
                    values[f.key] = rng.randbytes(rng.choice((0, 1, 7, 8, 100, 1000, 1500, 3000)))
                elif f.field.is_bytes:
                    values[f.key] = rng.randbytes(f.field.size)
                elif rng.random() < 0.7 and not f.key.endswith("features"):
                    values[f.key] = _int(rng, f.field.size)
                elif f.key.endswith("features") and rng.random() < 0.5:
                    values[f.key] = rng.getrandbits(16)
            if "dd.length" in values and rng.random() < 0.4:
                del values["dd.length"]  # the truthful inline length
        else:
            values["payload"] = rng.randbytes(rng.choice((0, 4, 16, 40)))
        if rng.random() < 0.05:
            values["version"] = rng.choice((0, 2, 0xFF))
        data = codec.encode(values, addr_le if rng.random() < 0.9 else not addr_le)
    roll = rng.random()
    if roll < 0.15:
        data = data[:rng.randrange(0, len(data) + 1)]
    elif roll < 0.25:
        data += rng.randbytes(rng.choice((1, 3, 4, 16)))
    elif roll < 0.35 and data:
        flipped = bytearray(data)
        _flip(rng, flipped, 0, len(flipped), rng.randint(1, 3))
        data = bytes(flipped)
    return data


# ---- re-framed sessions ------------------------------------------------------------------

class _Transport:
    """The few operations a fuzz session needs, over RcConnection or IwarpConversation."""

    def __init__(self, rng: random.Random, roce: bool, n: int, v6: bool, start: float) -> None:
        self.rng, self.roce, self.tag = rng, roce, ""
        self.held: tuple | None = None   # iWARP: a Send kept back to share the next one's segment
        ip = (f"2001:db8:{n:x}::1", f"2001:db8:{n:x}::2") if v6 else (f"10.{n >> 8 & 255}.{n & 255}.1",
                                                                       f"10.{n >> 8 & 255}.{n & 255}.2")
        if roce:
            psn_a = rng.choice((0, 0xFFFFF0, rng.getrandbits(24)))
            self.conn = RcConnection(RoceEndpoint(ip[0], "02:00:00:00:00:01", qpn=rng.getrandbits(24), psn=psn_a),
                                     RoceEndpoint(ip[1], "02:00:00:00:00:02", qpn=rng.getrandbits(24),
                                                  psn=rng.choice((0xFFFFFE, rng.getrandbits(24)))),
                                     mtu=rng.choice((256, 1024)), start=start)
        else:
            markers = rng.random() < 0.1
            self.tag = " markers" if markers else ""
            self.conv = IwarpConversation((ip[0], 40000 + n % 20000), (ip[1], 5420), markers=markers,
                                          revision=rng.choice((1, 1, 2)), start=start)
        self.atomic = 0

    def send(self, initiator: bool, payload: bytes, invalidate: int | None = None) -> None:
        rng = self.rng
        if self.roce:
            imm = rng.getrandbits(32) if invalidate is None and rng.random() < 0.05 else None
            self.conn.send("a" if initiator else "b", payload, inv_rkey=invalidate, imm=imm,
                           ack=rng.random() < 0.8)
            return
        op = Op.SEND if invalidate is None else Op.SEND_INV
        extra = {}
        roll = rng.random()
        if roll < 0.1:
            extra["per_segment"] = 2
        elif roll < 0.15 and len(payload) > 8:
            extra["split_at"] = [rng.randrange(1, len(payload))]
        elif roll < 0.2:  # this Send and the next in one TCP segment
            self.held = (initiator, op, payload, invalidate)
            return
        held, self.held = self.held, None
        if held is not None and held[0] == initiator:
            fpdus = [f for m in (held, (initiator, op, payload, invalidate))
                     for f in segment_message(m[1], m[2], mulpdu=self.conv.mulpdu, inv_stag=m[3] or 0,
                                              msn=self._msn(initiator))]
            self.conv.send_fpdus(fpdus, from_initiator=initiator, per_segment=2)
            return
        if held is not None:
            self.conv.send_message(held[1], held[2], from_initiator=held[0], inv_stag=held[3] or 0)
        self.conv.send_message(op, payload, from_initiator=initiator, inv_stag=invalidate or 0, **extra)

    def _msn(self, initiator: bool) -> int:
        """The next MSN of the Send queue, as IwarpConversation.send_message counts it."""
        counters = self.conv._ends[0 if initiator else 1].msn
        counters[0] += 1
        return counters[0] - 1

    def write(self, initiator: bool, data: bytes, stag: int, offset: int, imm: int | None) -> None:
        if self.roce:
            self.conn.write("a" if initiator else "b", data, va=offset, rkey=stag, imm=imm)
        else:
            self.conv.send_message(Op.WRITE, data, from_initiator=initiator, stag=stag, to=offset)

    def read(self, initiator: bool, data: bytes, stag: int, offset: int) -> None:
        if self.roce:
            self.conn.read("a" if initiator else "b", data, va=offset, rkey=stag)
            return
        self.conv.send_message(Op.READ_REQUEST, RDMAPReadRequest(
            sink_stag=0x77, sink_to=0, read_size=len(data), src_stag=stag, src_to=offset),
            from_initiator=initiator)
        self.conv.send_message(Op.READ_RESPONSE, data, from_initiator=not initiator, stag=0x77, to=0)

    def fetch_add(self, initiator: bool, stag: int, offset: int, add: int, mask: int, original: int) -> None:
        if self.roce:
            self.conn.fetch_add("a" if initiator else "b", va=offset, rkey=stag, add=add, original=original)
            return
        self.atomic += 1
        self.conv.send_message(Op.ATOMIC_REQUEST, RDMAPAtomicRequest(
            aopcode=0, req_id=self.atomic, remote_stag=stag, remote_to=offset, data=add, mask=mask),
            from_initiator=initiator)
        self.conv.send_message(Op.ATOMIC_RESPONSE, RDMAPAtomicResponse(
            orig_req_id=self.atomic, orig_data=original), from_initiator=not initiator)

    def frames(self, note: str) -> list[Frame]:
        rng = self.rng
        if not self.roce:
            held, self.held = self.held, None
            if held is not None:
                self.conv.send_message(held[1], held[2], from_initiator=held[0], inv_stag=held[3] or 0)
            self.conv.close()
            return [Frame(bytearray(raw(p)), float(p.time), note + self.tag) for p in self.conv.packets]
        out = []
        for p in self.conn.frames:  # drop, duplicate and swap packets: the ICRCs stay right
            roll = rng.random()
            if roll < 0.03:
                continue
            # The octets RcConnection built: re-serialising the dissected frame would move
            # octets after the end of a KBTP message behind the ICRC.
            f = Frame(bytearray(p.original or raw(p)), float(p.time), note)
            out.append(f)
            if roll > 0.97:
                out.append(Frame(bytearray(f.data), f.ts, note + " duplicate"))
            elif roll > 0.94 and len(out) > 1:
                out[-1], out[-2] = out[-2], out[-1]
        return out


def fuzz_session(rng: random.Random, roce: bool, n: int, messages: int, start: float) -> tuple[list[Frame], int]:
    """One connection of fuzzed and well-formed KBTP traffic; returns frames, variants."""
    t = _Transport(rng, roce, n, v6=rng.random() < 0.3, start=start)
    addr_le = rng.random() < 0.4
    stags = [0x100, 0x200, 0x300, 0x400, 0x500, rng.getrandbits(32)]
    variants, rid = 0, 0
    prologue = rng.random()
    if prologue < 0.85:  # HELLO / HELLO_ACK, usually well formed
        feats = rng.choice((3, 7, 0xF, 0xB, 1, 2, 0, rng.getrandbits(16))) | (8 if addr_le else 0)
        t.send(True, codec.encode({"opcode": 1, "request_id": 0, "hello.requested_features": feats,
                                   "hello.completion_credits": 16, "hello.initiator_id": bytes(16)}))
        ack = {"opcode": 2, "request_id": 0, "hello_ack.features": feats,
               "hello_ack.request_credits": rng.choice((0, 1, 2, 16)), "hello_ack.block_size": 32768,
               "hello_ack.max_inline": 4096, "hello_ack.handle_base": 0x4000,
               "hello_ack.handle_count": 256, "status": 0 if rng.random() < 0.9 else 9}
        for key, stag in (("table", 0x200), ("pool", 0x100), ("partition", 0x500), ("ring", 0x300),
                          ("head", 0x400)):
            ack[f"hello_ack.{key}.stag"] = stag
            ack[f"hello_ack.{key}.count"] = rng.choice((0, 1, 4, 0xFFFFFFFF))
        if rng.random() < 0.15:
            t.send(False, fuzzed_message(rng, False, 0))
            variants += 1
        else:
            t.send(False, codec.encode(ack))
    for _ in range(messages):
        rid += 1
        roll = rng.random()
        if roll < 0.55:
            t.send(rng.random() < 0.7, fuzzed_message(rng, addr_le, rid))
            variants += 1
        elif roll < 0.75:  # a well-formed request, usually answered
            op = rng.choice((0x10, 0x11, 0x12, 0x13, 0x14))
            values = {"opcode": op, "request_id": rid, "handle": 0x4000 + rid % 256}
            if op in (0x11, 0x12) and rng.random() < 0.7:
                values.update(flags=1, inline_data=bytes(rng.choice((8, 300, 1100, 2500))))
            if op in (0x10, 0x13) and rng.random() < 0.3:
                values.update({"cd.stag": 0x5678, "cd.offset": 0})
            t.send(True, codec.encode(values, addr_le))
            if rng.random() < 0.8:
                done = {"opcode": 0x20, "request_id": rid if rng.random() < 0.9 else rid + 1000,
                        "handle": values["handle"], "status": rng.choice(_STATUSES)}
                t.send(False, codec.encode(done, addr_le),
                       invalidate=rng.getrandbits(32) if rng.random() < 0.1 else None)
        elif roll < 0.85:
            data = rng.randbytes(rng.choice((0, 8, 16, 24, 40)))
            if rng.random() < 0.5:
                t.read(rng.random() < 0.8, data, rng.choice(stags), rng.choice((0, 16, 32, _int(rng, 8))))
            else:
                imm = rng.getrandbits(32) if t.roce and rng.random() < 0.3 else None
                t.write(rng.random() < 0.5, data, rng.choice(stags), _int(rng, 8), imm)
        elif roll < 0.92:
            add = rng.choice((T.RING_COUNTER.masked_add_data, T.RING_COUNTER.unmasked_add_data,
                              _int(rng, 8)))
            mask = ring.add_mask(rng.choice((1, 4, 16))) if rng.random() < 0.7 else _int(rng, 8)
            t.fetch_add(True, rng.choice(stags), rng.choice((0, 8, _int(rng, 8))), add, mask, _int(rng, 8))
        else:  # a well-formed message at an odd moment: unanswered completion, GOODBYE, HELLO again
            op = rng.choice((0x20, 0x30, 0x01, 0x02))
            t.send(rng.random() < 0.5, codec.encode({"opcode": op, "request_id": rng.getrandbits(64)}, addr_le))
    kind = "roce" if roce else "iwarp"
    return t.frames(f"reframed {kind} session {n}"), variants


# ---- the pcaps -----------------------------------------------------------------------------

def write_pcap(path: Path, frames: list[Frame]) -> None:
    """A classic pcap (Ethernet), snap length 65535."""
    out = [struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, 1)]
    for f in frames:
        sec = int(f.ts)
        out.append(struct.pack("<IIII", sec, int(round((f.ts - sec) * 1e6)) % 1000000,
                               len(f.data), f.wirelen or len(f.data)))
        out.append(bytes(f.data))
    path.write_bytes(b"".join(out))


def build(outdir: Path, seed: int = SEED, scale: float = SCALE) -> dict[str, tuple[list[Frame], int]]:
    """Write the fuzz pcaps into ``outdir``; name -> (frames, number of variants)."""
    rng = random.Random(seed)
    random.seed(seed)  # scapy's fuzz() draws from the global generator
    out: dict[str, tuple[list[Frame], int]] = {}
    rounds = max(1, int(32 * scale))
    for group in ("roce", "iwarp"):
        frames, variants = [], 0
        for k, sample in enumerate(s for s in SAMPLES if s.name.startswith(group)):
            got, n = raw_variants(rng, sample, rounds, 0.22, base=1 + k * 1000)
            frames += got
            variants += n
        out[f"raw_{group}"] = (frames, variants)
    for group, sessions in (("roce", int(60 * scale)), ("iwarp", int(80 * scale))):
        frames, variants = [], 0
        for n in range(max(1, sessions)):
            got, v = fuzz_session(rng, group == "roce", 1 + n, rng.randint(10, 40), 1.8e9 + n * 100)
            frames += got
            variants += v
        out[f"reframed_{group}"] = (frames, variants)
    outdir.mkdir(parents=True, exist_ok=True)
    for name, (frames, _) in out.items():
        write_pcap(outdir / f"{name}.pcap", frames)
    return out


def tshark_cmd(pcap: Path, two_pass: bool, lua: Path | None = LUA) -> list[str]:
    return [TSHARK or "tshark", "-n", "-r", str(pcap), "-V", "-o", "tcp.try_heuristic_first:TRUE",
            *(["-X", f"lua_script:{lua}"] if lua else []), *(["-2"] if two_pass else [])]


@dataclass
class Run:
    name: str
    two_pass: bool
    returncode: int
    stderr: str
    lua: list[tuple[int, str]] = field(default_factory=list)    # (frame number, line)
    bugs: dict[int, str] = field(default_factory=dict)          # frame number -> message
    kbtp_frames: int = 0

    def failed(self) -> bool:
        return self.returncode != 0 or bool(self.lua)


_BUG_TREE = re.compile(r"\[Dissector bug, protocol ([^:]+): (.*)\]$")
_BUG_STDERR = re.compile(r"Dissector bug, protocol ([^,]+), in packet (\d+): (.*)$")


def run_tshark(pcap: Path, two_pass: bool, lua: Path | None = LUA) -> Run:
    """Run tshark -V and keep only what the assertions need (the text is large)."""
    proc = subprocess.run(tshark_cmd(pcap, two_pass, lua), capture_output=True, timeout=600, check=False)
    out, err = proc.stdout, proc.stderr.decode(errors="replace")
    run = Run(pcap.stem, two_pass, proc.returncode, err, kbtp_frames=out.count(KBTP_TREE))
    if any(b.encode() in out for b in BAD):
        frame = 0
        for line in out.decode(errors="replace").splitlines():
            m = re.match(r"Frame (\d+):", line)
            if m:
                frame = int(m.group(1))
            elif any(b in line for b in BAD):
                bug = _BUG_TREE.search(line.strip())
                if bug:
                    run.bugs[frame] = f"{bug.group(1)}: {bug.group(2)}"
                elif "issector bug" in line:
                    run.bugs.setdefault(frame, line.strip())
                else:
                    run.lua.append((frame, line.strip()))
    for line in err.splitlines():
        bug = _BUG_STDERR.search(line)
        if bug:
            run.bugs.setdefault(int(bug.group(2)), f"{bug.group(1)}: {bug.group(3)}")
        elif any(b in line for b in BAD):
            run.lua.append((0, line.strip()))
    return run


def describe_frames(numbers_and_lines, frames: list[Frame], limit: int = 5) -> list[str]:
    """The failing frames, each with what was done to it and its octets in hex."""
    lines, seen = [], set()
    for number, text in numbers_and_lines:
        if number in seen or len(seen) >= limit:
            continue
        seen.add(number)
        lines.append(f"frame {number}: {text}")
        if 0 < number <= len(frames):
            f = frames[number - 1]
            lines.append(f"  variant: {f.note}; wirelen {f.wirelen or len(f.data)}")
            lines.append(f"  hex: {bytes(f.data).hex()}")
    return lines


def explain(run: Run, frames: list[Frame], new_bugs: dict[int, str] | None = None) -> str:
    lines = [f"{run.name} ({'two passes' if run.two_pass else 'one pass'}): exit {run.returncode}"]
    lines += describe_frames(run.lua, frames)
    if new_bugs:
        lines.append(f"{len(new_bugs)} frames with a dissector bug that tshark without the plugin"
                     " does not have:")
        lines += describe_frames(sorted(new_bugs.items()), frames)
    lines.append(f"{len(run.lua)} Lua error lines in all; seed {SEED}; keep the pcaps with"
                 f" python tests/test_dissector_fuzz.py DIR {SEED}")
    return "\n".join(lines)


# ---- tests ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The pcaps, and tshark's verdict on each, one pass and two; where the plugin run shows a
    dissector bug, also tshark's verdict without the plugin (the C dissectors' own bugs)."""
    outdir = tmp_path_factory.mktemp("fuzz")
    built = build(outdir)
    jobs = [(outdir / f"{name}.pcap", two) for name in built for two in (False, True)]
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        runs = {(r.name, r.two_pass): r for r in pool.map(lambda job: run_tshark(*job), jobs)}
        again = [(outdir / f"{name}.pcap", two, None) for (name, two), r in runs.items() if r.bugs]
        baseline = {(r.name, r.two_pass): r for r in pool.map(lambda job: run_tshark(*job), again)}
    return outdir, built, runs, baseline


def test_variants_are_thousands_and_reach_the_dissector(corpus):
    """Not a vacuous fuzz: thousands of variants, and the KBTP dissector decodes a large
    share of the frames of each pcap (corrupted frames included)."""
    _, built, runs, _ = corpus
    total = sum(v for _, v in built.values())
    assert total >= 3000 * min(1.0, SCALE), {k: v for k, (_, v) in built.items()}
    for name, (frames, _) in built.items():
        decoded = runs[(name, False)].kbtp_frames
        assert decoded >= 0.15 * len(frames), (name, decoded, len(frames))


@pytest.mark.parametrize("two_pass", (False, True), ids=("one-pass", "two-pass"))
@pytest.mark.parametrize("name", ("raw_roce", "raw_iwarp", "reframed_roce", "reframed_iwarp"))
def test_no_lua_error_and_no_dissector_bug(corpus, name, two_pass):
    """Exit 0, no Lua error, and no dissector bug that tshark without the plugin does not
    have too (tshark 4.0's RPC-over-RDMA heuristic asserts on some Sends on a second pass
    with no plugin loaded: a lone RC Send Last, for one; the plugin must not add any)."""
    _, built, runs, baseline = corpus
    run = runs[(name, two_pass)]
    base = baseline.get((name, two_pass))
    new_bugs = {n: text for n, text in run.bugs.items() if base is None or n not in base.bugs}
    assert not run.failed() and not new_bugs, explain(run, built[name][0], new_bugs)


def scapy_icrc(d: bytes, w: Where) -> bytes:
    """The ICRC as scapy.contrib.roce computes it, over IP / UDP / BTH / payload built from
    the frame's octets (no KBTP dissection, which reorders octets after a message's end)."""
    ip = (IPv6 if w.v6 else IP)(bytes(d[w.l3:w.l4]))
    udp = UDP(bytes(d[w.l4:w.l4 + 8]))
    bth = BTH(bytes(d[w.bth:w.bth + 12]) + bytes(4))
    for layer in (ip, udp, bth):
        layer.remove_payload()
    bth.icrc = None
    return raw(ip / udp / bth / Raw(bytes(d[w.bth + 12:w.ip_end - 4])))[-4:]


def test_valid_framing_really_is_valid(corpus):
    """Frames meant to keep valid framing do: RoCEv2 ICRCs as scapy computes them (tshark
    does not check them), iWARP FPDU CRC32c as MPA computes it."""
    _, built, _, _ = corpus
    checked = {"roce": 0, "iwarp": 0}
    for name, (frames, _) in built.items():
        for f in frames[::5]:
            w = locate(f.data)
            if not f.valid or w is None:
                continue
            if w.roce and checked["roce"] < 1500:
                assert scapy_icrc(f.data, w) == bytes(f.data[w.ip_end - 4:w.ip_end]), \
                    f.note + " " + bytes(f.data).hex()
                checked["roce"] += 1
            elif w.mpa is not None and name == "raw_iwarp":  # one FPDU per segment, no markers
                ulpdu = int.from_bytes(f.data[w.mpa:w.mpa + 2], "big")
                crc_at = w.mpa + 2 + ulpdu + (-(2 + ulpdu) % 4)
                crc = struct.unpack("<I", f.data[crc_at:crc_at + 4])[0]
                assert crc == crc32c(bytes(f.data[w.mpa:crc_at])), f.note + " " + bytes(f.data).hex()
                checked["iwarp"] += 1
    assert min(checked.values()) > 300, checked


def test_the_checks_catch_what_tshark_prints_for_a_lua_error(corpus, tmp_path):
    """A plugin whose heuristic raises is caught by the same checks, with its frames."""
    _, built, _, _ = corpus
    broken = tmp_path / "broken.lua"
    broken.write_text(LUA.read_text() + '\nlocal broken = Proto("kbtpbroken", "Broken")\n'
                      'broken:register_heuristic("infiniband.payload", function(tvb) '
                      'return tvb:range(0, tvb:len() + 1) end)\n')
    small = tmp_path / "small.pcap"
    write_pcap(small, built["raw_roce"][0][:200])
    run = run_tshark(small, True, broken)
    assert run.failed() and "Lua Error" in run.lua[0][1] and run.lua[0][0] >= 1, run
    assert "hex:" in explain(run, built["raw_roce"][0][:200])


if __name__ == "__main__":  # write the pcaps and run tshark as the tests do
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "fuzz-pcaps")
    if len(sys.argv) > 2:
        SEED = int(sys.argv[2])
    built = build(target, SEED)
    for name, (frames, variants) in built.items():
        pcap = target / f"{name}.pcap"
        print(f"{pcap}: {len(frames)} frames, {variants} variants")
        for two in (False, True):
            run = run_tshark(pcap, two)
            base = run_tshark(pcap, two, None) if run.bugs else None
            new = {n: t for n, t in run.bugs.items() if base is None or n not in base.bugs}
            print(f"  {' '.join(tshark_cmd(pcap, two))}\n  KBTP in {run.kbtp_frames} frames; "
                  + ("ok" if not run.failed() and not new else explain(run, frames, new))
                  + (f"; {len(base.bugs)} dissector bugs without the plugin" if base else ""))
