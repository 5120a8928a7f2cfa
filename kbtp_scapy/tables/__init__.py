"""The single source of truth for every KBTP layout, enumeration and byte order.

The Scapy layers (``kbtp_scapy.layers``), the codec (``kbtp_scapy.codec``), the Lua
dissector, the field reference and the Python vocabulary (``kbtp_scapy.vocab``: enums and
message records, written by ``generate``) are all generated from what this package declares.
"""
from .enums import (
                    ENTRY_FLAGS,
                    ENUMERATIONS,
                    FEATURES,
                    FLAG_SETS,
                    GOODBYE_FLAGS,
                    OPCODES,
                    REQUEST_FLAGS,
                    STATUS,
                    flag,
)
from .memory import (
                    COMPLETION_RECORD,
                    MEMORY_STRUCTS,
                    RING_COUNTER,
                    RING_SLOT,
                    SLOT_CONSUMED,
                    TABLE_ENTRY,
)
from .messages import (
                    BY_NAME,
                    BY_OPCODE,
                    COMPLETION_DESCRIPTOR,
                    DATA_DESCRIPTOR,
                    DIRECT_DESCRIPTOR,
                    HEADER,
                    HEADER_SIZE,
                    MESSAGES,
                    VERSION,
                    flag_bits,
                    wire_fields,
)
from .model import (
                    Condition,
                    Enumeration,
                    Field,
                    FlagSet,
                    FlatField,
                    Member,
                    Message,
                    Order,
                    Struct,
                    Value,
                    flatten,
)

__all__ = [
    "BY_NAME", "BY_OPCODE", "COMPLETION_DESCRIPTOR", "COMPLETION_RECORD", "Condition",
    "DATA_DESCRIPTOR", "DIRECT_DESCRIPTOR", "ENTRY_FLAGS", "ENUMERATIONS", "Enumeration",
    "FEATURES", "FLAG_SETS", "Field", "FlagSet", "FlatField", "GOODBYE_FLAGS", "HEADER",
    "HEADER_SIZE", "MEMORY_STRUCTS", "MESSAGES", "Member", "Message", "OPCODES", "Order",
    "REQUEST_FLAGS", "RING_COUNTER", "RING_SLOT", "SLOT_CONSUMED", "STATUS", "Struct",
    "TABLE_ENTRY", "VERSION", "Value", "flag", "flag_bits", "flatten", "wire_fields",
]
