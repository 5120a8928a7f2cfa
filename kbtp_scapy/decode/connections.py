"""RoCEv2 connections: which destination QP of one direction answers which of the other.

A BTH names only the destination QP, so the two directions of an RC connection between
hosts A and B name different QPs (A to qB, B to qA) and nothing in a Send says they
belong together. They are tied as Wireshark's InfiniBand conversations and the RNICs
tie them, in order of trust:

1. the CM: a REQ (a MAD in a UD SEND ONLY to QP1) carries A's local QPN, the REP that
   answers it (its Remote Communication ID is the REQ's Local one) B's (IBA 12.6.5,
   12.6.8; what librdmacm sends, ``rnic/cm.py``);
2. the RC transport: an ACK, Read Response or Atomic Acknowledge from B to qA carries the
   PSN of the request from A to qB it answers (IBA 9.7.1), so the one direction from A to B
   whose requests' PSNs hold it is the other half;
3. neither in the capture: the direction joins the oldest connection between the same two
   hosts that has only the opposite direction so far (one connection: the address pair).

A connection is named by its first direction seen, ``(src, dst, destination QP)`` as raw
octets, when its first message comes out: the pairing known by then decides. Memory is
bounded: at most ``MAX_FOLLOWED`` unpaired directions are followed by PSN and as many CM
REQs wait for their REP; past that, new ones are not.
"""
from __future__ import annotations

from ..wire import roce as W

MAX_FOLLOWED = 1 << 12

#: RC request opcodes (IBA 9.2.1, table 35): Sends, Writes, Read Request, Atomics
_REQUESTS = frozenset((*range(W.SEND_FIRST, W.READ_REQUEST + 1), W.COMPARE_SWAP, W.FETCH_ADD,
                       W.SEND_LAST_INV, W.SEND_ONLY_INV))
#: RC responses that carry the PSN of the request they answer: Read Responses, ACK, Atomic ACK
_RESPONSES = frozenset(range(W.READ_RESP_FIRST, W.ATOMIC_ACKNOWLEDGE + 1))
_CM_CLASS, _CM_SEND, _CM_REQ, _CM_REP = 0x07, 0x03, 0x0010, 0x0013
_MAD = 12 + W.EXT_LEN[W.UD_SEND_ONLY]       # the MAD's offset after the BTH: BTH, DETH


def _u24(data: bytes, at: int) -> int:
    return data[at] << 16 | data[at + 1] << 8 | data[at + 2]


class RoceConnections:
    """Feed every RoCE packet (``packet``); ask the connection of a direction (``of``)."""

    def __init__(self) -> None:
        self._peer: dict[tuple, int] = {}        # (A, B, qB) -> qA, learned
        self._sent: dict[tuple, dict[int, list[int]]] = {}   # (A, B) -> qB -> [first, last PSN]
        self._followed = 0
        self._req: dict[tuple, int] = {}         # (A, B, REQ's Local Comm ID) -> qA
        self._conn: dict[tuple, tuple] = {}      # direction -> its connection's first direction
        self._lone: dict[tuple, dict[tuple, None]] = {}   # (A, B) -> connections with A to B only

    def packet(self, src: bytes, dst: bytes, data: bytes, start: int, end: int) -> None:
        """One RoCE packet, BTH at ``data[start]``, ICRC ending at ``end``."""
        opcode = data[start]
        dqpn = _u24(data, start + 5)
        if opcode in _REQUESTS:
            if (src, dst, dqpn) not in self._peer:
                self._follow(src, dst, dqpn, _u24(data, start + 9))
        elif opcode in _RESPONSES:
            if (src, dst, dqpn) not in self._peer:
                self._answer(src, dst, dqpn, _u24(data, start + 9))
        elif opcode == W.UD_SEND_ONLY and dqpn == W.CM_QPN and end - 4 - (start + _MAD) >= 60:
            self._cm(src, dst, data, start + _MAD)

    def _follow(self, src: bytes, dst: bytes, qp: int, psn: int) -> None:
        sent = self._sent.get((src, dst))
        span = sent.get(qp) if sent else None
        if span is not None:
            if W.psn_diff(psn, span[1]) > 0:
                span[1] = psn
        elif self._followed < MAX_FOLLOWED:
            self._sent.setdefault((src, dst), {})[qp] = [psn, psn]
            self._followed += 1

    def _answer(self, src: bytes, dst: bytes, qp: int, psn: int) -> None:
        """A response from ``src`` to QP ``qp`` of ``dst``: the request it answers went
        from ``dst`` to ``src`` on one QP whose PSNs hold ``psn``."""
        sent = self._sent.get((dst, src))
        if not sent:
            return
        found = [q for q, (first, last) in sent.items() if (psn - first) & W.MASK24 <= (last - first) & W.MASK24]
        if len(found) == 1 and (dst, src, found[0]) not in self._peer:
            self._learn(dst, src, qp, found[0])

    def _cm(self, src: bytes, dst: bytes, data: bytes, mad: int) -> None:
        if data[mad + 1] != _CM_CLASS or data[mad + 3] != _CM_SEND:
            return
        attr = data[mad + 16] << 8 | data[mad + 17]
        if attr == _CM_REQ and len(self._req) < MAX_FOLLOWED:
            self._req[(src, dst, bytes(data[mad + 24:mad + 28]))] = _u24(data, mad + 56)
        elif attr == _CM_REP:
            qa = self._req.pop((dst, src, bytes(data[mad + 28:mad + 32])), None)
            if qa is not None:
                self._learn(dst, src, qa, _u24(data, mad + 36))

    def _learn(self, a: bytes, b: bytes, qa: int, qb: int) -> None:
        """A's QP ``qa`` and B's QP ``qb`` are one connection."""
        self._peer[(a, b, qb)] = qa
        self._peer[(b, a, qa)] = qb
        for here, there, qp in ((a, b, qb), (b, a, qa)):
            sent = self._sent.get((here, there))
            if sent is not None and sent.pop(qp, None) is not None:
                self._followed -= 1

    def source_qp(self, direction: tuple) -> int | None:
        """The QP at the source of ``(src, dst, destination QP)``, once known."""
        return self._peer.get(direction)

    def of(self, direction: tuple) -> tuple:
        """The connection of ``(src, dst, destination QP)``: its first direction seen."""
        conn = self._conn.get(direction)
        if conn is not None:
            return conn
        src, dst, _ = direction
        qp = self._peer.get(direction)
        if qp is not None:
            conn = self._conn.get((dst, src, qp))
        else:
            lone = self._lone.get((dst, src))
            conn = next((c for c in lone if c not in self._peer), None) if lone else None
        if conn is None:
            conn = direction
            self._lone.setdefault((src, dst), {})[conn] = None
        else:
            self._lone.get(conn[:2], {}).pop(conn, None)
        self._conn[direction] = conn
        return conn
