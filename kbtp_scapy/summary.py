"""One-line summaries of KBTP messages, in the style of Wireshark's RDMA Info column.

What each message shows is declared in the tables (``Message.summary``), so the
``kbtp decode`` lines, Scapy's ``summary()`` and the Lua dissector's Info column agree.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import tables as T


def describe(fields: Mapping[str, Any]) -> str:
    """One line in the style of Wireshark's RDMA Info column, as the tables' summary of
    each message says: ``ALLOC_STORE rid=7 handle=0x4001 len=8 INLINE``,
    ``COMPLETION rid=7 OK gen=5 off=0x150000``."""
    opcode = fields.get("opcode")
    if opcode is None:
        return "KBTP (truncated)"
    msg = T.BY_OPCODE.get(opcode)
    if msg is None:
        return f"{T.OPCODES.describe(opcode)} rid={fields.get('request_id')}"
    parts = [msg.name]
    meta = {f.key: f.field for f in list(T.flatten(T.HEADER)) + list(T.flatten(msg.body))}
    for label, key in msg.summary:
        if fields.get(key) is not None:
            text = _show(meta[key], fields[key])
            parts.append(f"{label}={text}" if label else text)
    if msg.flags is not None and "flags" in fields:
        parts.extend(msg.flags.names(fields["flags"]))
    return " ".join(parts)


def _show(field: T.Field, value: int) -> str:
    """A field value as the tables say to show it: enumeration name, flag names, hex or decimal."""
    if field.enum is not None:
        return field.enum.describe(value)
    if field.flags is not None:
        return "+".join(field.flags.names(value)) or "0"
    return f"0x{value:x}" if field.hex else str(value)
