"""The Arrow schema of the analyzer's rows, generated from the tables.

Every field of every KBTP message is a column named by its display-filter key
(``column()``), an unsigned integer as wide as the field; the Initiator ID, 128 bits, is
hex text; the fields of a table entry a Direct Load read (``entry_generation``) follow.
Inline Data is left out: the data is no question a query asks, and its
length is ``dd_length``. The derived columns follow (``DERIVED``).
"""
from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

from .. import tables as T
from ..tables import memory as M
from .rows import column

if TYPE_CHECKING:
    import pyarrow as pa

#: fields that are not a column: the data itself
LEFT_OUT = frozenset({"inline_data"})

#: the derived columns, with their Arrow type names and what they hold
DERIVED: tuple[tuple[str, str, str], ...] = (
    ("capture", "string", "the capture file's name (its stem): the partition"),
    ("frame", "int64", "frame number of the message's last frame"),
    ("time", "float64", "capture time of that frame, seconds since the epoch"),
    ("transport", "string", "iwarp or roce"),
    ("conn", "int32", "connection number within the capture, from 0"),
    ("src", "string", "sender's address"),
    ("dst", "string", "receiver's address"),
    ("session", "string", "the Initiator ID (hex) where the HELLO is in the capture, else capture#conn"),
    ("initiator", "string", "the initiator's address"),
    ("target", "string", "the target: iwarp:ADDR:PORT or roce:ADDR"),
    ("opcode_name", "string", "the opcode's name"),
    ("status_name", "string", "COMPLETION and HELLO_ACK: the status's name"),
    ("malformed", "string", "why the message does not parse, if it does not"),
    ("credits", "int32", "Request Credits granted to the session (HELLO_ACK)"),
    ("ticket_timeout_s", "float64", "the session's Ticket Timeout in seconds (HELLO_ACK)"),
    ("recorded", "bool", "request: RECORD set, so answered by a completion record (an RDMA Write)"),
    ("in_flight", "int32", "request: requests of its session in flight once it was sent"),
    ("answer_frame", "int64", "request: the frame of the COMPLETION that answers it"),
    ("answer_time", "float64", "request: that COMPLETION's time"),
    ("answer_status", "uint16", "request: the answer's Status"),
    ("answer_status_name", "string", "request: the answer's Status, by name"),
    ("answer_generation", "uint16", "request: the answer's Generation"),
    ("answer_data_length", "uint32", "request: the answer's Data Length"),
    ("latency_s", "float64", "request and COMPLETION: seconds from request to answer"),
    ("capture_end", "float64", "unanswered request: the time of the capture's last message"),
    ("request_frame", "int64", "COMPLETION: the frame of the request it answers"),
    ("request_opcode_name", "string", "COMPLETION: the opcode of the request it answers"),
    ("unsolicited", "bool", "COMPLETION: answers no request of the capture"),
    ("data_frames", "list<int64>", "request: frames of the RDMA Writes and Reads that carried its data"),
    ("data_octets", "uint64", "request: the octets those Writes and Reads moved"),
    ("rdma_op", "string", "RDMA operation: WRITE, READ, FETCH_ADD, SWAP or CMP_SWAP (no opcode)"),
    ("rdma_region", "string", "RDMA operation: the HELLO_ACK descriptor its STag is (table, pool, ring, ...)"),
    ("rdma_stag", "uint32", "RDMA operation: the STag (R_Key) it named"),
    ("rdma_offset", "uint64", "RDMA operation: the Tagged Offset (VA) it named"),
    ("rdma_length", "uint32", "RDMA operation: octets written or read"),
    ("rdma_operand", "uint64", "Atomic: the Add Data or Swap Data"),
    ("rdma_compare", "uint64", "CMP_SWAP: the Compare Data"),
    ("rdma_original", "uint64", "Atomic: the value before it, from its answer"),
    ("ticket", "uint32", "FETCH_ADD on a Head: the ticket it took"),
)

_UINT = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}


@cache
def field_columns() -> tuple[tuple[str, str], ...]:
    """(column, Arrow type name) of every table field, in table order."""
    out = []
    for key, (f, _) in T.wire_fields().items():
        if key in LEFT_OUT:
            continue
        out.append((column(key), _UINT.get(f.size, "string")))
    out += [(column(f"{M.TABLE_ENTRY.prefix}.{f.name}"), _UINT[f.size]) for f in M.TABLE_ENTRY.items]
    return tuple(out)


def arrow_schema() -> pa.Schema:
    import pyarrow as pa
    def arrow(kind: str) -> pa.DataType:
        return pa.list_(pa.int64()) if kind == "list<int64>" else pa.type_for_alias(kind)
    fields = [pa.field(name, arrow(kind)) for name, kind in field_columns()]
    fields += [pa.field(name, arrow(kind)) for name, kind, _ in DERIVED]
    return pa.schema(fields)
