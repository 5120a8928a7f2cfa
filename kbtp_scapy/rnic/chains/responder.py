"""The responder role: an incoming Send lands in the next posted receive WQE.

The receive's scatter list spreads the message over the places it names, in order: the
point of a chain, since those places are the fields of later WQEs. A message longer than
the scatter list is an error of the connection, as on an RNIC.
"""
from __future__ import annotations

from ..qp import ReceiveError
from .completer import Completer
from .queues import Completion, WorkQueue
from .requester import Requester
from .wqe import Op, Wqe


class Responder:
    def __init__(self, requester: Requester, completer: Completer, little: bool) -> None:
        self.requester, self.completer, self.little = requester, completer, little
        self.received = 0

    def deliver(self, rq: WorkQueue, payload: bytes) -> Wqe:
        """Place a Send in ``rq``'s next receive WQE and complete it; the WQE it used."""
        if rq.next >= rq.posted:
            raise ReceiveError(ReceiveError.NO_BUFFER)
        wqe = Wqe.decode(rq.slot(rq.next), self.little)
        if wqe.op is not Op.RECV:
            raise ValueError(f"receive queue {rq.number} holds a {wqe.op.name} WQE")
        if len(payload) > sum(s.length for s in wqe.sges):
            raise ReceiveError(ReceiveError.TOO_LONG)
        self.requester.scatter(wqe.sges, payload)
        rq.next += 1
        self.received += 1
        self.completer.complete(rq.cq, Completion(wqe.wr_id, int(Op.RECV), "ok", len(payload), rq.number))
        self.requester.memory_changed()
        return wqe
