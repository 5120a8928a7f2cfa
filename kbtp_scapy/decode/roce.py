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
    """KBTP-carrying Sends of every RoCE direction and destination QP of a capture."""

    def __init__(self) -> None:
        self._open: dict[tuple, _Part] = {}

    def packet(self, frame: int, time: float, src: bytes, dst: bytes, data: bytes,
               start: int, end: int, net: int | None = None) -> list[RdmaMessage] | None:
        """One RoCE packet (BTH at ``data[start]``, ICRC ending at ``end``, network header
        at ``net`` when known); the messages it ends, if any. A message whose packets have
        a wrong ICRC lists their frames in ``info["icrc_bad"]``: the receiving NIC dropped
        them, so the message never arrived as the capture shows it."""
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

    @staticmethod
    def _message(key: tuple, frames: list[int], payload: bytes, name: str, inv: bool,
                 complete: bool, info: dict) -> RdmaMessage:
        src, dst, dqpn = key
        info.update(opcode=name, dqpn=dqpn, complete=complete)
        return RdmaMessage("roce", "send_inv" if inv else "send", frames,
                           (address(src), address(dst), dqpn), payload, info)
