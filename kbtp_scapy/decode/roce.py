"""RoCE Sends that carry KBTP, put together from BTH octets as frames arrive.

A Send is FIRST, MIDDLE..., LAST (or ONLY) packets on one direction and destination QP
with consecutive PSNs (IBA vol. 1, 9.2 and 9.7.1); a packet that breaks the sequence ends
the message so far as incomplete, as ``builders.roce.iter_rdma_messages`` does from the
Scapy layers. Only the RC, UC and UD Send opcodes are looked at: RDMA Writes, Read
Responses, ACKs and everything else cost one dictionary lookup. A Send whose first octets
are not a KBTP header is followed (so its continuation packets are not mistaken for a new
message) but not kept. Nothing assumes the soft RNIC's habits: the UDP source port (flow
entropy, different per QP on Linux rxe) is not looked at, QPs and PSNs are whatever the
peer chose.
"""
from __future__ import annotations

from ..codec import looks_like_kbtp
from ..wire import roce as W
from ..wire.message import RdmaMessage
from .connections import RoceConnections
from .frames import address
from .icrc import icrc_ok

MAX_MESSAGE = 16 << 20          # octets kept of one Send; the rest is cut (and reported)

_FIRST, _MIDDLE, _LAST, _ONLY = 0, 1, 2, 3
_NAMES = {W.SEND_FIRST: "SEND_FIRST", W.SEND_MIDDLE: "SEND_MIDDLE", W.SEND_LAST: "SEND_LAST",
          W.SEND_LAST_IMM: "SEND_LAST_WITH_IMMEDIATE", W.SEND_ONLY: "SEND_ONLY",
          W.SEND_ONLY_IMM: "SEND_ONLY_WITH_IMMEDIATE", W.SEND_LAST_INV: "SEND_LAST_WITH_INVALIDATE",
          W.SEND_ONLY_INV: "SEND_ONLY_WITH_INVALIDATE"}
_POSITION = {W.SEND_FIRST: _FIRST, W.SEND_MIDDLE: _MIDDLE, W.SEND_LAST: _LAST,
             W.SEND_LAST_IMM: _LAST, W.SEND_ONLY: _ONLY, W.SEND_ONLY_IMM: _ONLY,
             W.SEND_LAST_INV: _LAST, W.SEND_ONLY_INV: _ONLY}

#: BTH opcode -> (position, extension header octets, Send with Invalidate, name): RC and UC
#: Sends (UC has no Send with Invalidate), UD SEND ONLY with its DETH (IBA 9.2.1, table 35).
SENDS: dict[int, tuple[int, int, bool, str]] = {}
for _service, _base in (("RC", 0x00), ("UC", 0x20)):
    for _op, _pos in _POSITION.items():
        if _service == "UC" and _op in (W.SEND_LAST_INV, W.SEND_ONLY_INV):
            continue
        SENDS[_base | _op] = (_pos, W.EXT_LEN[_op], _op in (W.SEND_LAST_INV, W.SEND_ONLY_INV),
                              f"{_service}_{_NAMES[_op]}")
SENDS[W.UD_SEND_ONLY] = (_ONLY, W.EXT_LEN[W.UD_SEND_ONLY], False, "UD_SEND_ONLY")
SENDS[W.UD_SEND_ONLY + 1] = (_ONLY, W.EXT_LEN[W.UD_SEND_ONLY] + 4, False, "UD_SEND_ONLY_WITH_IMMEDIATE")


class _Part:
    """A Send being put together."""

    __slots__ = ("bad_icrc", "chunks", "complete", "first_psn", "frames", "inv", "keep", "name",
                 "psn", "size", "time")

    def __init__(self, psn: int, name: str, complete: bool, keep: bool) -> None:
        self.chunks: list[bytes] = []
        self.frames: list[int] = []
        self.first_psn = self.psn = psn
        self.name, self.complete, self.keep, self.size = name, complete, keep, 0
        self.inv, self.time = False, 0.0
        self.bad_icrc: list[int] = []


class RoceSends:
    """KBTP-carrying Sends of every RoCE direction and destination QP of a capture, each
    with its connection (``info["connection"]``, ``RoceConnections``)."""

    def __init__(self) -> None:
        self._open: dict[tuple, _Part] = {}
        self.connections = RoceConnections()

    def packet(self, frame: int, time: float, src: bytes, dst: bytes, data: bytes,
               start: int, end: int, net: int | None = None) -> list[RdmaMessage] | None:
        """One RoCE packet (BTH at ``data[start]``, ICRC ending at ``end``, network header
        at ``net`` when known); the messages it ends, if any. A message whose packets have
        a wrong ICRC lists their frames in ``info["icrc_bad"]``: the receiving NIC dropped
        them, so the message never arrived as the capture shows it."""
        self.connections.packet(src, dst, data, start, end)
        spec = SENDS.get(data[start])
        if spec is None:
            return None
        position, ext, inv, name = spec
        low, high = start + 12 + ext, end - 4 - (data[start + 1] >> 4 & 3)
        if high < low:
            return None                             # shorter than its own headers
        head = data[start + 4:start + 12]
        dqpn = (head[1] << 16) | (head[2] << 8) | head[3]
        psn = (head[5] << 16) | (head[6] << 8) | head[7]
        key = (src, dst, dqpn)
        done = None
        part = self._open.pop(key, None) if self._open else None
        if part is not None and (position == _FIRST or position == _ONLY
                                 or psn != (part.psn + 1) & W.MASK24):
            done = self._finish(key, part, False)
            part = None
        chunk = data[low:high]
        if part is None:
            if position == _ONLY:                   # the usual case: one packet, one message
                if not looks_like_kbtp(chunk):
                    return done
                msg = self._message(key, [frame], chunk, name, inv, True,
                                    {"psn": psn, "last_psn": psn, "packets": 1})
                msg.time = time
                if net is not None and not icrc_ok(data, net, start, end):
                    msg.info["icrc_bad"] = [frame]
                return [*done, msg] if done else [msg]
            part = _Part(psn, name, position == _FIRST, looks_like_kbtp(chunk))
        part.psn, part.inv, part.time = psn, inv, time
        if part.keep:
            part.frames.append(frame)
            if net is not None and not icrc_ok(data, net, start, end):
                part.bad_icrc.append(frame)
            if part.size + len(chunk) <= MAX_MESSAGE:
                part.chunks.append(chunk)
                part.size += len(chunk)
            else:
                part.complete = False
        if position == _LAST:
            ended = self._finish(key, part, part.complete)
            return ended if done is None else done + ended
        self._open[key] = part
        return done

    def flush(self) -> list[RdmaMessage]:
        """Sends still open when the capture ends, as incomplete messages."""
        out = []
        for key, part in self._open.items():
            out += self._finish(key, part, False)
        self._open.clear()
        return out

    def _finish(self, key: tuple, part: _Part, complete: bool) -> list[RdmaMessage]:
        if not part.keep:
            return []
        msg = self._message(key, part.frames, b"".join(part.chunks), part.name, part.inv,
                            complete, {"psn": part.first_psn, "last_psn": part.psn,
                                       "packets": len(part.frames)})
        msg.time = part.time
        if part.bad_icrc:
            msg.info["icrc_bad"] = part.bad_icrc
        return [msg]

    def _message(self, key: tuple, frames: list[int], payload: bytes, name: str, inv: bool,
                 complete: bool, info: dict) -> RdmaMessage:
        src, dst, dqpn = key
        info.update(opcode=name, dqpn=dqpn, complete=complete, connection=self.connections.of(key),
                    src_qp=self.connections.source_qp(key))
        return RdmaMessage("roce", "send_inv" if inv else "send", frames,
                           (address(src), address(dst), dqpn), payload, info)


#: RC and UC RDMA Write opcodes -> (position, carries a RETH, carries ImmDt)
_WRITES: dict[int, tuple[int, bool, bool]] = {}
for _base in (0x00, 0x20):
    _WRITES.update({_base | W.WRITE_FIRST: (_FIRST, True, False), _base | W.WRITE_MIDDLE: (_MIDDLE, False, False),
                    _base | W.WRITE_LAST: (_LAST, False, False), _base | W.WRITE_LAST_IMM: (_LAST, False, True),
                    _base | W.WRITE_ONLY: (_ONLY, True, False), _base | W.WRITE_ONLY_IMM: (_ONLY, True, True)})
_RESPONSES = {W.READ_RESP_FIRST: _FIRST, W.READ_RESP_MIDDLE: _MIDDLE, W.READ_RESP_LAST: _LAST,
              W.READ_RESP_ONLY: _ONLY}
_ATOMICS = {W.FETCH_ADD: "FETCH_ADD", W.COMPARE_SWAP: "COMPARE_SWAP"}

#: octets of a Write or Read Response kept as its payload: a table entry, a ring slot or a
#: completion record fits; a block's data is counted (``info["length"]``), not kept
KEPT = 256


class _Run:
    """An RDMA Write or Read Response being put together: its octets counted, the first
    ``KEPT`` of them kept."""

    __slots__ = ("chunks", "complete", "first_psn", "frames", "info", "kind", "psn", "size", "time")

    def __init__(self, kind: str, psn: int, complete: bool, info: dict) -> None:
        self.kind, self.first_psn = kind, psn
        self.psn, self.complete, self.info = psn, complete, info
        self.chunks: list[bytes] = []
        self.frames: list[int] = []
        self.size, self.time = 0, 0.0


class RoceOperations(RoceSends):
    """Every RDMA operation of a RoCE capture: the KBTP Sends exactly as ``RoceSends``
    gives them, and RDMA Writes, Read Requests, Read Responses, Atomics and Atomic
    Acknowledgements with their STag (R_Key), offset (VA), length and operands, named as
    ``builders.roce`` names them. Read Responses and Atomic Acknowledgements name no
    STag: their ``psn`` is that of the request they answer, on the opposite direction."""

    def __init__(self) -> None:
        super().__init__()
        self._runs: dict[tuple, _Run] = {}

    def packet(self, frame: int, time: float, src: bytes, dst: bytes, data: bytes,
               start: int, end: int, net: int | None = None) -> list[RdmaMessage] | None:
        opcode = data[start]
        if opcode in SENDS:
            return super().packet(frame, time, src, dst, data, start, end, net)
        self.connections.packet(src, dst, data, start, end)
        if end - start < 16:
            return None
        head = data[start + 4:start + 12]
        dqpn = (head[1] << 16) | (head[2] << 8) | head[3]
        psn = (head[5] << 16) | (head[6] << 8) | head[7]
        key = (src, dst, dqpn)
        body, high = start + 12, end - 4 - (data[start + 1] >> 4 & 3)
        if opcode == W.READ_REQUEST and high >= body + 16:
            va, rkey, length = W.RETH.unpack_from(data, body)
            return [self._op(key, "read_request", [frame], time, b"",
                             {"opcode": "RC_RDMA_READ_REQUEST", "psn": psn, "va": va, "rkey": rkey,
                              "dma_length": length})]
        if opcode in _ATOMICS and high >= body + 28:
            va, rkey, swap_add, compare = W.ATOMIC_ETH.unpack_from(data, body)
            return [self._op(key, "atomic_request", [frame], time, b"",
                             {"opcode": f"RC_{_ATOMICS[opcode]}", "psn": psn, "va": va, "rkey": rkey,
                              "swap_add": swap_add, "compare": compare})]
        if opcode == W.ATOMIC_ACKNOWLEDGE and high >= body + 12:
            syndrome, original = W.U32.unpack_from(data, body)[0] >> 24, W.U64.unpack_from(data, body + 4)[0]
            return [self._op(key, "atomic_response", [frame], time, b"",
                             {"opcode": "RC_ATOMIC_ACKNOWLEDGE", "psn": psn, "syndrome": syndrome,
                              "orig_data": original})]
        write = _WRITES.get(opcode)
        if write is not None:
            position, reth, imm = write
            low = body + (16 if reth else 0)
            info = {}
            if reth and high >= low:
                va, rkey, length = W.RETH.unpack_from(data, body)
                info = {"opcode": "RC_RDMA_WRITE", "va": va, "rkey": rkey, "dma_length": length}
            if imm:
                low += 4
            return self._run(("write", *key), "write_imm" if imm else "write", position, psn, frame, time,
                             data[low:high] if high >= low else b"", info)
        position_ = _RESPONSES.get(opcode)
        if position_ is not None:
            low = body + (0 if position_ == _MIDDLE else 4)
            return self._run(("read", *key), "read_response", position_, psn, frame, time,
                             data[low:high] if high >= low else b"",
                             {"opcode": "RC_RDMA_READ_RESPONSE"})
        return None

    def _run(self, key: tuple, kind: str, position: int, psn: int, frame: int, time: float,
             chunk: bytes, info: dict) -> list[RdmaMessage] | None:
        """A packet of a Write or Read Response: their messages end as Sends do."""
        done: list[RdmaMessage] = []
        run = self._runs.pop(key, None)
        if run is not None and (position in (_FIRST, _ONLY) or psn != (run.psn + 1) & W.MASK24):
            done.append(self._ended(key, run, False))
            run = None
        if run is None:
            run = _Run(kind, psn, position in (_FIRST, _ONLY), info)
        run.psn, run.time, run.kind = psn, time, kind   # a LAST packet may say "with Immediate"
        run.frames.append(frame)
        if run.size < KEPT:
            run.chunks.append(chunk)
        run.size += len(chunk)
        if position in (_LAST, _ONLY):
            done.append(self._ended(key, run, run.complete))
        else:
            self._runs[key] = run
        return done or None

    def _ended(self, key: tuple, run: _Run, complete: bool) -> RdmaMessage:
        payload = b"".join(run.chunks) if run.size <= KEPT else b""
        info = {**run.info, "psn": run.first_psn, "last_psn": run.psn, "packets": len(run.frames),
                "length": run.size}
        info.setdefault("opcode", "RC_RDMA_WRITE" if run.kind != "read_response" else "RC_RDMA_READ_RESPONSE")
        return self._op(key[1:], run.kind, run.frames, run.time, payload, info, complete)

    def _op(self, key: tuple, kind: str, frames: list[int], time: float, payload: bytes, info: dict,
            complete: bool = True) -> RdmaMessage:
        src, dst, dqpn = key
        info.update(dqpn=dqpn, complete=complete, connection=self.connections.of(key),
                    src_qp=self.connections.source_qp(key))
        return RdmaMessage("roce", kind, frames, (address(src), address(dst), dqpn), payload, info, time)

    def flush(self) -> list[RdmaMessage]:
        """Sends, Writes and Read Responses still open at the capture's end, incomplete."""
        out = super().flush()
        out += [self._ended(key, run, False) for key, run in self._runs.items()]
        self._runs.clear()
        return out
