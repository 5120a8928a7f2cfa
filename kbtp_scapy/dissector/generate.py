"""Generate the Wireshark Lua dissector and its field reference from the tables.

The generated part declares, from ``kbtp_scapy.tables``: one ProtoField per field
(named as the JSON keys, ``kbtp.dd.stag``), per-bit boolean fields for every flags word,
value strings with Private Use ranges, and the layouts as Lua data. ``runtime.lua``
(hand-written, no layout in it) is appended and interprets those layouts.
"""
from __future__ import annotations

from pathlib import Path

from .. import __version__, tables as T
from ..wire.address import ROCE_PORT

#: Hand-written Lua appended after the generated declarations, in this order.
RUNTIME_PARTS = tuple(Path(__file__).with_name(n) for n in ("runtime.lua", "rdma.lua", "srt.lua", "register.lua"))

#: First line of kbtp.lua: how ``kbtp dissector uninstall`` knows a file is this plugin.
HEADER_LINE = "-- KBTP (KV Cache Block Transfer Protocol) dissector for Wireshark 4.0 and newer."

_UINT = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}
_ORDER = {T.Order.NETWORK: "N", T.Order.ADDRESS: "A", T.Order.MEMORY: "M"}

#: Fields the dissector adds beyond the wire fields: tracking and RDMA context.
EXTRA_FIELDS = (
    ("response_in", "framenum", "Response in", "Frame of the COMPLETION (or HELLO_ACK) answering this request; tshark sets it on "
     "its second pass only (tshark -2), the GUI always", "RESPONSE"),
    ("request_in", "framenum", "Request in", "Frame of the request this message answers", "REQUEST"),
    ("time", "relative_time", "Response time", "Time from the request to this answer", None),
    ("data_for", "framenum", "Data for request in", "This RDMA transfer carries the block data of the KBTP request in that frame", "REQUEST"),
    ("data_in", "framenum", "Data in", "An RDMA transfer in that frame carries this request's block data; tshark sets it on "
     "its second pass only (tshark -2), the GUI always", None),
    ("ring.ticket", "uint32", "Ring Ticket", "Ticket of a FetchAdd on a ring counter advertised in HELLO_ACK", None),
    ("ring.slot_offset", "uint32", "Ring Slot Offset", "Slot Offset of a FetchAdd on a ring counter advertised in HELLO_ACK", None),
    ("session.addr_le", "bool", "ADDR_LE session", "Address fields decoded little-endian", None),
    ("fragment_in", "framenum", "Fragment in frame", "Frame whose KBTP message this Send fragment belongs to", None),
)


def _lua_str(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _range_string(enum: T.Enumeration) -> str:
    rows = [f"{{{v.value:#x}, {v.value:#x}, {_lua_str(v.name)}}}" for v in enum.values]
    if enum.private_use:
        lo, hi = enum.private_use
        rows.append(f"{{{lo:#x}, {hi:#x}, \"Private Use\"}}")
    return "{ " + ", ".join(rows) + " }"


def _value_string(enum: T.Enumeration) -> str:
    """The defined codes as a value string: display filters accept their names
    (``kbtp.opcode == LOAD``); tshark 4.0 refuses names for range strings."""
    return "{ " + ", ".join(f"[{v.value:#x}] = {_lua_str(v.name)}" for v in enum.values) + " }"


def _flag_sets_of(f: T.Field) -> list[T.FlagSet]:
    """Flag sets whose bits get boolean fields: per opcode for the header Flags."""
    if f.per_opcode_flags:
        return list(dict.fromkeys(m.flags for m in T.MESSAGES if m.flags is not None))
    return [f.flags] if f.flags else []


def subtrees() -> dict[str, str]:
    """Key -> title of every structure nested in a message (``dd``, ``cd``,
    ``hello_ack.table``): each is a named field, so JSON, PDML and pyshark see its fields
    under a key that says what they are, once."""
    out: dict[str, str] = {}

    def walk(items, prefix: str) -> None:
        for item in items:
            if isinstance(item, T.Member):
                key = f"{prefix}.{item.name}" if prefix else item.name
                out.setdefault(key, item.title)
                walk(item.struct.items, key)
    walk(T.HEADER.items, "")
    for msg in T.MESSAGES:
        walk(msg.body.items, msg.body.prefix)
    return out


def _protofields() -> list[str]:
    out, section = [], None
    for key, (f, struct_) in T.wire_fields().items():
        where = f"{struct_.title} (kbtp-draft, {struct_.section})"
        if where != section:
            out.append(f"\n-- {where}")
            section = where
        abbr = f"kbtp.{key}"
        if f.is_bytes:
            out.append(f'F[{_lua_str(key)}] = ProtoField.bytes({_lua_str(abbr)}, {_lua_str(f.title)}, '
                       f'base.NONE, {_lua_str(f.doc)})')
            continue
        if f.enum is not None:
            base = "base.HEX" if f.hex else "base.DEC"
            vs = f"VS_{f.enum.name.upper()}"
        else:
            base, vs = ("base.HEX" if f.hex else "base.DEC"), "nil"
        out.append(f'F[{_lua_str(key)}] = ProtoField.{_UINT[f.size]}({_lua_str(abbr)}, '
                   f'{_lua_str(f.title)}, {base}, {vs}, nil, {_lua_str(f.doc)})')
        for flag_set in _flag_sets_of(f):
            for bit in flag_set.flags:
                bit_key = f"{key}.{bit.key}"
                out.append(f'F[{_lua_str(bit_key)}] = ProtoField.bool({_lua_str("kbtp." + bit_key)}, '
                           f'{_lua_str(bit.name)}, {8 * f.size}, nil, {bit.value:#06x}, {_lua_str(bit.doc)})')
    out.append("\n-- Subtrees: the structures inside messages")
    for key, title in subtrees().items():
        out.append(f'F[{_lua_str(key)}] = ProtoField.none({_lua_str("kbtp." + key)}, {_lua_str(title)})')
    out.append("\n-- Tracking and RDMA context (not wire fields of KBTP itself)")
    for key, kind, title, doc, frametype in EXTRA_FIELDS:
        abbr = _lua_str("kbtp." + key)
        if kind == "framenum":
            ft = f"frametype.{frametype}" if frametype else "nil"
            out.append(f'F[{_lua_str(key)}] = ProtoField.framenum({abbr}, {_lua_str(title)}, base.NONE, {ft}, nil, {_lua_str(doc)})')
        elif kind == "relative_time":
            out.append(f'F[{_lua_str(key)}] = ProtoField.relative_time({abbr}, {_lua_str(title)}, {_lua_str(doc)})')
        elif kind == "bool":
            out.append(f'F[{_lua_str(key)}] = ProtoField.bool({abbr}, {_lua_str(title)}, base.NONE, nil, nil, {_lua_str(doc)})')
        else:
            out.append(f'F[{_lua_str(key)}] = ProtoField.{kind}({abbr}, {_lua_str(title)}, base.DEC, nil, nil, {_lua_str(doc)})')
    return out


def _items(items: tuple[T.Field | T.Member, ...], prefix: str, indent: str, body_prefix: str) -> list[str]:
    out = []
    for item in items:
        key = f"{prefix}.{item.name}" if prefix else item.name
        when = ""
        if item.when:
            source = "flags" if item.when.source == "flags" else ".".join(
                p for p in (body_prefix, item.when.source) if p)
            when = f", when = {{ {_lua_str(source)}, {item.when.mask:#06x} }}"
        if isinstance(item, T.Member):
            out.append(f"{indent}{{ member = {_lua_str(key)}, title = {_lua_str(item.title)}, "
                       f"size = {item.size}{when}, items = {{")
            out += _items(item.struct.items, key, indent + "  ", body_prefix)
            out.append(f"{indent}}} }},")
        else:
            extra = f", length_from = {_lua_str(item.length_from)}" if item.length_from else ""
            if item.flags:
                extra += f", flagset = {_lua_str(item.flags.name)}"
            elif item.per_opcode_flags:
                extra += ", flagset = true"
            out.append(f"{indent}{{ key = {_lua_str(key)}, size = {item.size}, "
                       f"order = \"{_ORDER[item.order]}\"{when}{extra} }},")
    return out


def _formats() -> list[str]:
    """How a value is shown in the Info column: enumeration name, hex or decimal."""
    out = ["local FMT = {"]
    for key, (f, _) in T.wire_fields().items():
        fmt = (f"enum:{f.enum.name}" if f.enum else "bytes" if f.is_bytes else
               f"flags:{f.flags.name}" if f.flags else "hex" if f.hex else "dec")
        out.append(f"  [{_lua_str(key)}] = {_lua_str(fmt)},")
    out.append("}")
    out.append("local ENUMS = { " + ", ".join(f"{e.name} = RS_{e.name.upper()}" for e in T.ENUMERATIONS) + " }")
    out.append("-- Fields whose Private Use values get a label of their own (the value string names only")
    out.append("-- the defined codes): { lo, hi, label format }")
    out.append("local PRIVATE = {")
    for key, (f, _) in T.wire_fields().items():
        if f.enum is not None and f.enum.private_use:
            lo, hi = f.enum.private_use
            shown = f"0x%0{2 * f.size}x" if f.hex else "%d"
            out.append(f"  [{_lua_str(key)}] = {{ {lo:#x}, {hi:#x}, {_lua_str(f.title + ': Private Use (' + shown + ')')} }},")
    out.append("}")
    return out


def _layouts() -> list[str]:
    out = ["local HEADER = {"] + _items(T.HEADER.items, "", "  ", "") + ["}", "", "local MESSAGES = {"]
    for msg in T.MESSAGES:
        answer = T.BY_NAME[msg.answer].opcode if msg.answer else "nil"
        summary = ", ".join(f"{{ {_lua_str(label)}, {_lua_str(key)} }}" for label, key in msg.summary)
        out.append(f"  -- {msg.title} ({msg.body.section})")
        out.append(f"  [{msg.opcode:#04x}] = {{ name = {_lua_str(msg.name)}, "
                   f"flagset = {_lua_str(msg.flags.name) if msg.flags else 'nil'}, "
                   f"addr_le = {str(msg.addr_le_applies).lower()}, answer = {answer},")
        out.append(f"    summary = {{ {summary} }},")
        out.append("    items = {")
        out += _items(msg.body.items, msg.body.prefix, "      ", msg.body.prefix)
        out.append("    } },")
    out.append("}")
    return out


def _flagsets() -> list[str]:
    out = ["local FLAGSETS = {"]
    for fs in T.FLAG_SETS:
        bits = ", ".join(f"{{ {f.value:#06x}, {_lua_str(f.name)}, {_lua_str(f.key)} }}" for f in fs.flags)
        out.append(f"  [{_lua_str(fs.name)}] = {{ defined = {fs.defined_mask:#06x}, "
                   f"private = {fs.private_use_mask:#06x}, bits = {{ {bits} }} }},")
    out.append("}")
    return out


def _constants() -> list[str]:
    rc = T.RING_COUNTER
    lo, hi = T.OPCODES.private_range
    feats = {f.name: f.value for f in T.FEATURES.flags}
    return [
        f"local VERSION = {T.VERSION}",
        f"local HEADER_SIZE = {T.HEADER_SIZE}",
        "local AT = { " + ", ".join(f"{n} = {T.HEADER.offset(n)}" for n in ("version", "opcode", "request_id"))
        + " }  -- offsets in the header",
        f"local PRIVATE_OPCODES = {{ {lo:#x}, {hi:#x} }}",
        f"local OPCODE = {{ {', '.join(f'{m.name} = {m.opcode:#04x}' for m in T.MESSAGES)} }}",
        f"local STATUS_OK = {T.STATUS.by_name()['OK']}",
        f"local PORT_ROCEV2 = {ROCE_PORT}",
        f"local FEATURE = {{ {', '.join(f'{k} = {v:#06x}' for k, v in feats.items())} }}",
        f"local ENTRY_SIZE, SLOT_SIZE = {T.TABLE_ENTRY.size}, {T.RING_SLOT.size}",
        f"local RING = {{ ticket_shift = {rc.ticket_shift}, slot_size = {rc.slot_size}, "
        f"masked_add = UInt64.fromhex(\"{rc.masked_add_data:016x}\"), "
        f"unmasked_add = UInt64.fromhex(\"{rc.unmasked_add_data:016x}\"), "
        f"mask_bits = {{ 63, 31 }}, mask_n_offset = 3 }}",
    ]


def lua_source() -> str:
    """The whole dissector: generated declarations, then the hand-written runtime."""
    lines = [
        HEADER_LINE,
        f"-- Generated by `kbtp dissector generate` (kbtp_scapy {__version__}) from kbtp_scapy/tables:",
        "-- do not edit; change the tables and regenerate. Licence: GPL-2.0-or-later.",
        "-- Layouts: kbtp-draft section names are given beside each group of fields.",
        "",
        "-- Load once: Wireshark may be given this file twice (the copy `kbtp dissector install`",
        "-- put in the personal plugin folder, and -X lua_script:), or have the C plugin",
        "-- (packet-kbtp.c) too, which registers before any Lua script runs. Each script has",
        "-- globals of its own, but protocols are Wireshark's: the second Proto() fails, and",
        "-- that copy returns before it registers anything. It says nothing: Lua's print()",
        "-- writes to tshark's standard output, and 4.0 gives Lua no log call; `kbtp dissector",
        "-- install` says which form wins when both are installed.",
        'local registered, kbtp = pcall(Proto, "kbtp", "KV Cache Block Transfer Protocol")',
        "if not registered then return end",
        "",
        *(f"local RS_{e.name.upper()} = {_range_string(e)}" for e in T.ENUMERATIONS),
        *(f"local VS_{e.name.upper()} = {_value_string(e)}" for e in T.ENUMERATIONS),
        "",
        "local F = {}",
        *_protofields(),
        "",
        *_constants(),
        "",
        *_flagsets(),
        "",
        *_formats(),
        "",
        *_layouts(),
        "",
    ]
    for part in RUNTIME_PARTS:
        lines += [f"-- ---- hand-written runtime: kbtp_scapy/dissector/{part.name} ----", part.read_text()]
    return "\n".join(lines)


def fields_markdown() -> str:
    """The field reference: every display-filter name, its type and meaning."""
    rows = ["# KBTP display-filter fields", "",
            "Generated by `kbtp dissector generate` from `kbtp_scapy/tables`; the same names are",
            "the keys of `kbtp decode --json`.", "",
            "**Filter on `kbtp.opcode` for the KBTP messages.** The filter `kbtp` also matches frames",
            "that carry no message: the RDMA transfers the dissector labels (the block data of a",
            "request, with `kbtp.data_for`; FetchAdds on a ring Head and their answers; both carry",
            "the hidden protocol `kbtp_rdma`) and, on RoCEv2, the packets of a multi-packet Send",
            "before its last (\"KBTP fragment\"; in a two-pass run, `tshark -2`, `kbtp.fragment_in`",
            "names the frame of their message). So does pyshark's `display_filter=\"kbtp\"`;",
            "with `display_filter=\"kbtp.opcode\"` every packet is one message and has",
            "`pkt.kbtp.opcode`.", "",
            "| filter | type | meaning |", "| --- | --- | --- |"]
    for key, (f, struct_) in T.wire_fields().items():
        kind = "bytes" if f.is_bytes else _UINT[f.size]
        order = {T.Order.ADDRESS: " Little-endian in ADDR_LE sessions.", T.Order.MEMORY: " Target memory order."}
        meaning = f"{f.title}: {f.doc}.{order.get(f.order, '')}"
        if f.enum is not None:
            meaning += f" Values: {', '.join(v.name for v in f.enum.values)}; Private Use named."
        rows.append(f"| `kbtp.{key}` | {kind} | {meaning} ({struct_.title}) |")
        for flag_set in _flag_sets_of(f):
            for bit in flag_set.flags:
                rows.append(f"| `kbtp.{key}.{bit.key}` | boolean | {bit.name} ({bit.value:#06x}): {bit.doc} |")
    for key, title in subtrees().items():
        rows.append(f"| `kbtp.{key}` | subtree | {title}: holds the `kbtp.{key}.*` fields |")
    for key, kind, title, doc, _ in EXTRA_FIELDS:
        rows.append(f"| `kbtp.{key}` | {kind} | {title}: {doc} |")
    return "\n".join(rows) + "\n"

