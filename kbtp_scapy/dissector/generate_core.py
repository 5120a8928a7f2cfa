"""Generate the KBTP tables of the compiled decoder core (``kbtp_scapy/decode/_core_tables.h``).

``kbtp decode`` writes one line per message in C (``decode/_core_kbtp.c``); what a
message holds, it learns from this header only: per opcode, its conditions (RECORD,
INLINE, the Features bits of HELLO_ACK) and one layout per combination of them, each
field with its offset, size, byte-order class and the JSON keys of its value and of its
flag bits, as ``codec.decode`` and ``capture.to_json`` derive them from the same tables,
and the summary of the text line (``summary.describe``) with the enumerations' and flag
sets' names.
``_core_kbtp.c`` interprets these tables and holds no layout, as ``runtime.c`` does for the
C dissector. ``kbtp dissector generate`` writes the file and ``--check`` finds it stale.
"""
from __future__ import annotations

from pathlib import Path

from .. import tables as T
from .generate_c import c_str

#: Where the package build (setup.py) finds the generated header beside the runtime.
CORE_TABLES = Path(__file__).resolve().parents[1] / "decode" / "_core_tables.h"

_KIND_INT, _KIND_ADDRESS, _KIND_BYTES = "KF_INT", "KF_ADDRESS", "KF_BYTES"


def _kind(f: T.Field) -> str:
    if f.is_bytes:
        return _KIND_BYTES
    if f.order is T.Order.MEMORY:
        raise TypeError(f"{f.name}: a message field in the target's memory order")
    return _KIND_ADDRESS if f.order is T.Order.ADDRESS and f.size > 1 else _KIND_INT


def _json_key(key: str) -> str:
    """The key and separator as json.dumps writes them: ``"kbtp.dd.stag": ``."""
    return c_str(f'"kbtp.{key}": ')


def _features(msg: T.Message) -> tuple[int, int]:
    """(offset in the message, size) of the body's controlling word besides Flags; (0, 0)
    when none (as codec._opcode_info finds it)."""
    sources = {c.source for c in msg.body.conditions} - {"flags"}
    found = next((f for f in T.flatten(msg.body) if f.field.name in sources), None)
    if found is None:
        return 0, 0
    return T.HEADER_SIZE + msg.body.offset(found.field.name), found.field.size


def _names() -> list[str]:
    """Each enumeration and flag set as ``kbtp_enum`` and ``kbtp_flagset`` (summary.py's
    ``Enumeration.describe`` and ``FlagSet.names`` read them)."""
    fields = [f.field for m in T.MESSAGES for f in [*T.flatten(T.HEADER), *T.flatten(m.body)]]
    used = {f.enum.name for f in fields if f.enum} | {f.flags.name for f in fields if f.flags} \
        | {m.flags.name for m in T.MESSAGES if m.flags}
    out = []
    for e in (e for e in T.ENUMERATIONS if e.name in used):
        names = ", ".join(f"{{ {v.value:#x}, {c_str(v.name)} }}" for v in e.values)
        first, last = e.private_use or (1, 0)
        out += [f"static const kbtp_name kbtp_names_{e.name}[] = {{ {names} }};",
                f"static const kbtp_enum kbtp_enum_{e.name} = {{ kbtp_names_{e.name}, {len(e.values)}, "
                f"{first:#x}, {last:#x} }};"]
    for fs in (fs for fs in T.FLAG_SETS if fs.name in used):
        names = ", ".join(f"{{ {f.value:#x}, {c_str(f.name)} }}" for f in fs.flags)
        out += [f"static const kbtp_name kbtp_names_{fs.name}[] = {{ {names} }};",
                f"static const kbtp_flagset kbtp_flags_{fs.name} = {{ kbtp_names_{fs.name}, {len(fs.flags)}, "
                f"{fs.defined_mask:#x}, {fs.private_use_mask:#x} }};"]
    return out


def _summary(msg: T.Message, fixed: list[T.FlatField], name: str) -> tuple[list[str], str]:
    """The summary items of one layout (summary.py's ``describe``): the label, the index of
    the field in the layout (-1 when this layout has none) and how to show its value."""
    meta = {f.key: f.field for f in [*T.flatten(T.HEADER), *T.flatten(msg.body)]}
    keys = [f.key for f in fixed]
    rows = []
    for label, key in msg.summary:
        f = meta[key]
        show = ("KS_ENUM" if f.enum else "KS_FLAGS" if f.flags else "KS_HEX" if f.hex else "KS_DEC")
        en = f"&kbtp_enum_{f.enum.name}" if f.enum else "NULL"
        fs = f"&kbtp_flags_{f.flags.name}" if f.flags else "NULL"
        rows.append(f"{{ {c_str(label + '=' if label else '')}, {keys.index(key) if key in keys else -1}, "
                    f"{show}, {en}, {fs} }}")
    if not rows:
        return [], "NULL, 0"
    return [f"static const kbtp_item {name}_summary[] = {{ {', '.join(rows)} }};"], f"{name}_summary, {len(rows)}"


def _layout(msg: T.Message, present: int, index: dict) -> tuple[list[str], str]:
    """Declarations of one layout's fields, bits and summary, and its initializer."""
    conds = msg.body.conditions
    on = {c for i, c in enumerate(conds) if present >> i & 1}
    flat = [f for f in [*T.flatten(T.HEADER), *T.flatten(msg.body)] if f.when is None or f.when in on]
    fixed = [f for f in flat if f.field.size]
    tail = next((f for f in flat if not f.field.size), None)
    name = f"kbtp_{msg.name.lower()}_{present}"
    decls, rows, at = [], [], 0
    for i, f in enumerate(fixed):
        bits = T.flag_bits(f.key, index[f.key][0], msg) if not f.field.is_bytes else []
        bits_name = "NULL"
        if bits:
            bits_name = f"{name}_bits_{i}"
            decls.append(f"static const kbtp_bit {bits_name}[] = {{ "
                         + ", ".join(f"{{ {_json_key(k)}, {mask:#x} }}" for k, mask in bits) + " };")
        rows.append(f"    {{ {_json_key(f.key)}, {at}, {f.field.size}, {_kind(f.field)}, {bits_name}, {len(bits)} }},")
        at += f.field.size
    decls += [f"static const kbtp_field {name}_fields[] = {{", *rows, "};"]
    tail_key, tail_length = "NULL", -1
    if tail is not None:
        assert tail.field.length_from is not None, f"{tail.key}: a variable-size field needs length_from"
        tail_key = _json_key(tail.key)
        tail_length = [f.key for f in fixed].index(tail.field.length_from)
    summary, items = _summary(msg, fixed, name)
    return decls + summary, f"    {{ {at}, {len(fixed)}, {name}_fields, {tail_key}, {tail_length}, {items} }},"


def header_source() -> str:
    """The generated header: the layouts of every opcode, in the runtime's structures."""
    index = T.wire_fields()
    out = ["/* Generated by kbtp_scapy.dissector.generate_core from the field tables: do not edit.",
           " * 'kbtp dissector generate' rewrites it; _core_kbtp.c interprets it. */",
           "#ifndef KBTP_CORE_TABLES_H", "#define KBTP_CORE_TABLES_H", "",
           f"#define KBTP_HEADER_SIZE {T.HEADER_SIZE}",
           f"#define KBTP_VERSION {T.VERSION}",
           f"#define KBTP_VERSION_AT {T.HEADER.offset('version')}",
           f"#define KBTP_OPCODE_AT {T.HEADER.offset('opcode')}",
           f"#define KBTP_FLAGS_AT {T.HEADER.offset('flags')}",
           f"#define KBTP_STATUS_AT {T.HEADER.offset('status')}",
           f"#define KBTP_PRIVATE_FIRST {T.OPCODES.private_range[0]:#x}",
           f"#define KBTP_PRIVATE_LAST {T.OPCODES.private_range[1]:#x}",
           f"#define KBTP_HELLO_ACK {T.BY_NAME['HELLO_ACK'].opcode:#x}",
           f"#define KBTP_ADDR_LE {T.flag(T.FEATURES, 'ADDR_LE'):#x}",
           "",
           "enum kbtp_kind { KF_INT, KF_ADDRESS, KF_BYTES };",
           "typedef struct { const char *key; uint64_t mask; } kbtp_bit;",
           "typedef struct { const char *key; uint16_t at; uint8_t size; uint8_t kind;",
           "                 const kbtp_bit *bits; uint8_t nbits; } kbtp_field;",
           "typedef struct { uint32_t value; const char *name; } kbtp_name;",
           "typedef struct { const kbtp_name *names; uint8_t n; uint32_t private_first, private_last; } kbtp_enum;",
           "typedef struct { const kbtp_name *bits; uint8_t n; uint32_t defined, private_mask; } kbtp_flagset;",
           "enum kbtp_show { KS_DEC, KS_HEX, KS_ENUM, KS_FLAGS };",
           "typedef struct { const char *label; int8_t field; uint8_t show; const kbtp_enum *en;",
           "                 const kbtp_flagset *flags; } kbtp_item;",
           "typedef struct { uint16_t size; uint8_t nfields; const kbtp_field *fields;",
           "                 const char *tail_key; int8_t tail_length;",
           "                 const kbtp_item *summary; uint8_t nsummary; } kbtp_layout;",
           "typedef struct { uint8_t features; uint16_t mask; } kbtp_cond;",
           "typedef struct { const char *name; const kbtp_flagset *flags; uint8_t addr_le_applies; uint8_t nconds;",
           "                 kbtp_cond conds[4]; uint16_t features_at; uint8_t features_size;",
           "                 const kbtp_layout *layouts; } kbtp_opcode;",
           "", *_names(), ""]
    table = []
    for msg in T.MESSAGES:
        conds = msg.body.conditions
        assert len(conds) <= 4 and all(c.source in ("flags", "features") for c in conds)
        inits = []
        for present in range(1 << len(conds)):
            decls, init = _layout(msg, present, index)
            out += decls
            inits.append(init)
        lname = f"kbtp_{msg.name.lower()}_layouts"
        out += [f"static const kbtp_layout {lname}[] = {{", *inits, "};"]
        at, size = _features(msg)
        cinit = ", ".join(f"{{ {int(c.source != 'flags')}, {c.mask:#x} }}" for c in conds) or "{ 0, 0 }"
        flags = f"&kbtp_flags_{msg.flags.name}" if msg.flags else "NULL"
        out.append(f"static const kbtp_opcode kbtp_{msg.name.lower()} = {{ {c_str(msg.name)}, {flags}, "
                   f"{int(msg.addr_le_applies)}, {len(conds)}, {{ {cinit} }}, {at}, {size}, {lname} }};")
        table.append(f"    [{msg.opcode:#04x}] = &kbtp_{msg.name.lower()},")
    out += ["", "static const kbtp_opcode *const kbtp_opcodes[256] = {", *table, "};", "", "#endif", ""]
    return "\n".join(out)


def outputs(path: Path = CORE_TABLES) -> dict[Path, str]:
    """The generated header at ``path``, with its contents."""
    return {path: header_source()}
