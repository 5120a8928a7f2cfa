"""Generate the Wireshark C dissector (packet-kbtp.c) and its plugin glue from the tables.

The same tables as kbtp.lua, declared the way Wireshark's C dissectors declare them:
one ``hf_`` id and ``hf_register_info`` row per field (the same ``kbtp.*`` names and
types as the Lua ProtoFields), one ``ett_`` per subtree, range strings with the Private
Use ranges, and the layouts as static C data. ``runtime.c`` (hand-written, no layout in
it) is appended and interprets them, as runtime.lua does for the Lua form.
"""
from __future__ import annotations

from pathlib import Path

from .. import __version__, tables as T
from ..wire.address import ROCE_PORT
from .generate import EXTRA_FIELDS, _flag_sets_of, subtrees

#: Hand-written C appended after the generated declarations, in this order.
RUNTIME_PARTS = tuple(Path(__file__).with_name(n) for n in ("runtime.c", "rdma.c"))

#: The opening comment of each file as doc/README.dissector's skeleton has it: the file's
#: name, what it holds, Wireshark's notice, the licence (words the tools/check_*.py scripts
#: take for "generated", which they then skip, stay out of it).
_WIRESHARK_NOTICE = (" *", " * Wireshark - Network traffic analyzer", " * By Gerald Combs <gerald@wireshark.org>",
                     " * Copyright 1998 Gerald Combs", " *", " * SPDX-License-Identifier: GPL-2.0-or-later", " */")
_ABOUT = """\
/*
 * KBTP moves KV cache blocks between inference systems and cache tiers over RDMA: its
 * requests and completions travel in untagged Sends (iWARP DDP/RDMAP; InfiniBand and RoCE),
 * the blocks in RDMA Reads and Writes. Specification: the Internet-Draft "KV Cache Block
 * Transfer Protocol (KBTP)".
 */
"""
#: The end of each file, as the skeleton's: the editor settings of Wireshark's sources.
_MODELINES = """\
/*
 * Editor modelines  -  https://www.wireshark.org/tools/modelines.html
 *
 * Local variables:
 * c-basic-offset: 4
 * tab-width: 8
 * indent-tabs-mode: nil
 * End:
 *
 * vi: set shiftwidth=4 tabstop=8 expandtab:
 * :indentSize=4:tabSize=8:noTabs=true:
 */
"""

_FT = {1: "FT_UINT8", 2: "FT_UINT16", 4: "FT_UINT32", 8: "FT_UINT64"}
_ORDER = {T.Order.NETWORK: "'N'", T.Order.ADDRESS: "'A'", T.Order.MEMORY: "'M'"}
#: Items whose tree item an expert info is put under (as runtime.lua's EXPERT_AT).
_EXPERT_AT = ("flags", "status", "request_id")


def ident(key: str) -> str:
    """C identifier part of a field key: ``dd.stag`` -> ``dd_stag``."""
    return key.replace(".", "_")


def c_str(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _value_keys() -> list[str]:
    return list(T.wire_fields())


def _hf_rows() -> tuple[list[str], list[str]]:
    """Declarations of the hf ids and the rows of hf_register_info."""
    decls, rows = [], []

    def add(key: str, title: str, ft: str, base: str, strings: str, mask: str, doc: str) -> None:
        decls.append(f"static int hf_kbtp_{ident(key)} = -1;")
        blurb = c_str(doc) if doc else "NULL"
        rows.append(f"        {{ &hf_kbtp_{ident(key)}, {{ {c_str(title)}, {c_str('kbtp.' + key)}, {ft}, {base}, "
                    f"{strings}, {mask}, {blurb}, HFILL }} }},")

    for key, (f, _) in T.wire_fields().items():
        if f.is_bytes:
            add(key, f.title, "FT_BYTES", "BASE_NONE", "NULL", "0x0", f.doc)
            continue
        if f.enum is not None:     # value strings: display filters accept the names
            base = "BASE_HEX" if f.hex else "BASE_DEC"
            strings = f"VALS(vs_kbtp_{f.enum.name})"
        else:
            base, strings = ("BASE_HEX" if f.hex else "BASE_DEC"), "NULL"
        add(key, f.title, _FT[f.size], base, strings, "0x0", f.doc)
        for flag_set in _flag_sets_of(f):
            for bit in flag_set.flags:
                add(f"{key}.{bit.key}", bit.name, "FT_BOOLEAN", str(8 * f.size), "NULL", f"{bit.value:#06x}", bit.doc)
    for key, title in subtrees().items():
        add(key, title, "FT_NONE", "BASE_NONE", "NULL", "0x0", "")
    for key, kind, title, doc, frametype in EXTRA_FIELDS:
        if kind == "framenum":
            ft_ = f"FRAMENUM_TYPE(FT_FRAMENUM_{frametype})" if frametype else "NULL"
            add(key, title, "FT_FRAMENUM", "BASE_NONE", ft_, "0x0", doc)
        elif kind == "relative_time":
            add(key, title, "FT_RELATIVE_TIME", "BASE_NONE", "NULL", "0x0", doc)
        elif kind == "bool":
            add(key, title, "FT_BOOLEAN", "BASE_NONE", "NULL", "0x0", doc)
        else:
            add(key, title, "FT_UINT32", "BASE_DEC", "NULL", "0x0", doc)
    return decls, rows


def _enums() -> list[str]:
    out = []
    for e in T.ENUMERATIONS:
        out.append(f"static const value_string vs_kbtp_{e.name}[] = {{")
        out += [f"    {{ {v.value:#x}, {c_str(v.name)} }}," for v in e.values]
        out.append("    { 0, NULL }\n};")
        out.append(f"static const range_string rs_kbtp_{e.name}[] = {{")
        for v in e.values:
            out.append(f"    {{ {v.value:#x}, {v.value:#x}, {c_str(v.name)} }},")
        if e.private_use:
            lo, hi = e.private_use
            out.append(f"    {{ {lo:#x}, {hi:#x}, \"Private Use\" }},")
        out.append("    { 0, 0, NULL }\n};")
    return out


def _flagsets() -> list[str]:
    out = []
    for fs in T.FLAG_SETS:
        bits = ", ".join(f"{{ {f.value:#06x}, {c_str(f.name)} }}" for f in fs.flags)
        out.append(f"static const kbtp_bit_t kbtp_bits_{fs.name}[] = {{ {bits}, {{ 0, NULL }} }};")
    out.append("static const kbtp_flagset_t kbtp_flagsets[] = {")
    for fs in T.FLAG_SETS:
        out.append(f"    {{ {fs.defined_mask:#06x}, kbtp_bits_{fs.name} }},")
    out.append("};")
    out += [f"#define KBTP_FS_{fs.name.upper()} {i}" for i, fs in enumerate(T.FLAG_SETS)]
    return out


def _flagset_index(fs: T.FlagSet | None) -> str:
    return f"KBTP_FS_{fs.name.upper()}" if fs else "-1"


def _bit_hfs() -> list[str]:
    """Per field and flag set, the hf ids of its bits (the order of the flag set)."""
    out, cases = [], []
    for key, (f, _) in T.wire_fields().items():
        for fs in _flag_sets_of(f):
            name = f"kbtp_bithf_{ident(key)}_{fs.name}"
            out.append(f"static int * const {name}[] = {{ "
                       + ", ".join(f"&hf_kbtp_{ident(key + '.' + bit.key)}" for bit in fs.flags) + ", NULL };")
            cases.append((key, fs, name))
    out.append("/* The boolean fields of the bits of value ``vid`` read as flag set ``fs``. */")
    out.append("static int * const *kbtp_bit_hfs(int vid, int fs)\n{")
    for key, fs, name in cases:
        out.append(f"    if (vid == V_{ident(key).upper()} && fs == {_flagset_index(fs)}) return {name};")
    out.append("    return NULL;\n}")
    return out


def _values() -> list[str]:
    out = ["/* Every wire field read into the values of a message, by key. */", "enum {"]
    out += [f"    V_{ident(k).upper()}," for k in _value_keys()]
    out.append("    V_COUNT\n};")
    out.append("static const kbtp_fmt_t kbtp_fmt[V_COUNT] = {")
    for key, (f, _) in T.wire_fields().items():
        if f.enum:
            fmt = f"{{ KBTP_FMT_ENUM, 0, rs_kbtp_{f.enum.name}, {'TRUE' if f.hex else 'FALSE'} }}"
        elif f.is_bytes:
            fmt = "{ KBTP_FMT_BYTES, 0, NULL, FALSE }"
        elif f.flags:
            fmt = f"{{ KBTP_FMT_FLAGS, {_flagset_index(f.flags)}, NULL, FALSE }}"
        else:
            fmt = f"{{ {'KBTP_FMT_HEX' if f.hex else 'KBTP_FMT_DEC'}, 0, NULL, FALSE }}"
        out.append(f"    [V_{ident(key).upper()}] = {fmt},")
    out.append("};")
    return out


def _items(name: str, items: tuple[T.Field | T.Member, ...], prefix: str, body_prefix: str, out: list[str]) -> None:
    """Emit ``static const kbtp_item_t name[]`` (members first, as their own arrays)."""
    rows = []
    for i, item in enumerate(items):
        key = f"{prefix}.{item.name}" if prefix else item.name
        if item.when:
            source = "flags" if item.when.source == "flags" else ".".join(
                p for p in (body_prefix, item.when.source) if p)
            when = f"V_{ident(source).upper()}, {item.when.mask:#06x}"
        else:
            when = "-1, 0"
        if isinstance(item, T.Member):
            sub = f"{name}_{i}"
            _items(sub, item.struct.items, key, body_prefix, out)
            rows.append(f"    {{ &hf_kbtp_{ident(key)}, &ett_kbtp_{ident(key)}, -1, {item.size}, 'N', {when}, "
                        f"-1, -1, FALSE, {sub}, G_N_ELEMENTS({sub}) }},")
        else:
            length_from = f"V_{ident(item.length_from).upper()}" if item.length_from else "-1"
            fs = "-2" if item.per_opcode_flags else _flagset_index(item.flags)
            keep = "TRUE" if key in _EXPERT_AT else "FALSE"
            rows.append(f"    {{ &hf_kbtp_{ident(key)}, NULL, V_{ident(key).upper()}, {item.size}, "
                        f"{_ORDER[item.order]}, {when}, {length_from}, {fs}, {keep}, NULL, 0 }},")
    out.append(f"static const kbtp_item_t {name}[] = {{")
    out += rows
    out.append("};")


def _layouts() -> list[str]:
    out: list[str] = []
    _items("kbtp_header", T.HEADER.items, "", "", out)
    for msg in T.MESSAGES:
        _items(f"kbtp_body_{msg.name.lower()}", msg.body.items, msg.body.prefix, msg.body.prefix, out)
        pairs = ", ".join(f"{{ {c_str(label)}, V_{ident(key).upper()} }}" for label, key in msg.summary)
        out.append(f"static const kbtp_pair_t kbtp_summary_{msg.name.lower()}[] = {{ {pairs}{', ' if pairs else ''}"
                   "{ NULL, -1 } };")
    out.append("/* kbtp-draft: one row per message, by opcode. */")
    out.append("static const kbtp_msg_t kbtp_messages[] = {")
    for msg in T.MESSAGES:
        answer = f"{T.BY_NAME[msg.answer].opcode:#04x}" if msg.answer else "-1"
        body = f"kbtp_body_{msg.name.lower()}"
        out.append(f"    {{ {msg.opcode:#04x}, {c_str(msg.name)}, {_flagset_index(msg.flags)}, "
                   f"{'TRUE' if msg.addr_le_applies else 'FALSE'}, {answer}, kbtp_summary_{msg.name.lower()}, "
                   f"{body}, G_N_ELEMENTS({body}) }},  /* {msg.title} ({msg.body.section}) */")
    out.append("};")
    return out


def _constants() -> list[str]:
    lo, hi = T.OPCODES.private_range
    out = [f"#define KBTP_VERSION {T.VERSION}", f"#define KBTP_HEADER_SIZE {T.HEADER_SIZE}",
           *(f"#define KBTP_AT_{name.upper()} {T.HEADER.offset(name)}" for name in ("version", "opcode", "request_id")),
           f"#define KBTP_PRIVATE_LO {lo:#x}", f"#define KBTP_PRIVATE_HI {hi:#x}",
           f"#define KBTP_STATUS_OK {T.STATUS.by_name()['OK']}",
           f"#define KBTP_PORT_ROCEV2 {ROCE_PORT}"]
    out += [f"#define KBTP_OP_{m.name} {m.opcode:#04x}" for m in T.MESSAGES]
    out += [f"#define KBTP_FEATURE_{f.name} {f.value:#06x}" for f in T.FEATURES.flags]
    out += [f"#define KBTP_FLAG_{fs.name.upper()}_{f.name} {f.value:#06x}" for fs in T.FLAG_SETS for f in fs.flags
            if fs is not T.FEATURES]
    rc = T.RING_COUNTER
    out += [f"#define KBTP_RING_TICKET_SHIFT {rc.ticket_shift}", f"#define KBTP_RING_SLOT_SIZE {rc.slot_size}",
            f"#define KBTP_RING_MASKED_ADD G_GUINT64_CONSTANT({rc.masked_add_data:#018x})",
            f"#define KBTP_RING_UNMASKED_ADD G_GUINT64_CONSTANT({rc.unmasked_add_data:#018x})",
            "/* RFC 7306 Add Mask of a ring counter: bits 63, 31 and n + 3 (kbtp-draft, Free-Block Ring) */",
            "#define KBTP_RING_MASK_BITS ((G_GUINT64_CONSTANT(1) << 63) | (G_GUINT64_CONSTANT(1) << 31))",
            "#define KBTP_RING_MASK_N_OFFSET 3"]
    return out


def _register() -> list[str]:
    decls, rows = _hf_rows()
    etts = [f"ett_kbtp_{ident(k)}" for k in subtrees()]
    flag_etts = [f"ett_kbtp_{ident(k)}" for k, (f, _) in T.wire_fields().items() if _flag_sets_of(f)]
    out = decls + [f"static gint {e} = -1;" for e in ["ett_kbtp", *etts, *flag_etts]]
    out.append("/* The subtree of the bits of a flags field, by value. */")
    out.append("static gint *kbtp_flag_ett(int vid)\n{")
    for k, (f, _) in T.wire_fields().items():
        if _flag_sets_of(f):
            out.append(f"    if (vid == V_{ident(k).upper()}) return &ett_kbtp_{ident(k)};")
    out.append("    return &ett_kbtp;\n}")
    out.append("static void kbtp_register_fields(int proto)\n{")
    out.append("    static hf_register_info hf[] = {")
    out += rows
    out.append("    };")
    out.append("    static gint *ett[] = { " + ", ".join(f"&{e}" for e in ["ett_kbtp", *etts, *flag_etts]) + " };")
    out.append("    proto_register_field_array(proto, hf, array_length(hf));")
    out.append("    proto_register_subtree_array(ett, array_length(ett));")
    out.append("}")
    return out


_PRELUDE = """\
#include "config.h"

#include <math.h>

#include <epan/packet.h>
#include <epan/expert.h>
#include <epan/prefs.h>
#include <epan/proto_data.h>
#include <epan/srt_table.h>
#include <epan/tap.h>
#include <epan/to_str.h>
#include <epan/dissectors/packet-infiniband.h>
#include <epan/dissectors/packet-iwarp-ddp-rdmap.h>
#include <wsutil/crc32.h>
#include <wsutil/str_util.h>
#include <wsutil/wmem/wmem.h>

void proto_register_kbtp(void);
void proto_reg_handoff_kbtp(void);

/* How the runtime reads the generated layouts. */
typedef struct { guint32 mask; const char *name; } kbtp_bit_t;
typedef struct { guint32 defined; const kbtp_bit_t *bits; } kbtp_flagset_t;
enum { KBTP_FMT_DEC, KBTP_FMT_HEX, KBTP_FMT_ENUM, KBTP_FMT_FLAGS, KBTP_FMT_BYTES };
typedef struct { int kind; int flagset; const range_string *names; gboolean hex; } kbtp_fmt_t;
typedef struct kbtp_item kbtp_item_t;
struct kbtp_item {
    int *hf;                   /* the field, or the subtree of a member */
    gint *ett;                 /* a member's subtree */
    int vid;                   /* the value it is read into (-1: a member) */
    guint size;                /* octets; 0: the rest of the message (inline data) */
    char order;                /* 'N' network, 'A' address (little-endian in ADDR_LE), 'M' memory */
    int when_vid;              /* present only when this value ... */
    guint32 when_mask;         /* ... has one of these bits set */
    int length_from;           /* the value that declares an inline tail's length */
    int flagset;               /* its bits: a flag set, -2 the message's, -1 none */
    gboolean keep;             /* an expert info may be put under it */
    const kbtp_item_t *items;  /* a member's items */
    guint n_items;
};
typedef struct { const char *label; int vid; } kbtp_pair_t;
typedef struct {
    int opcode;
    const char *name;
    int flagset;
    gboolean addr_le;
    int answer;
    const kbtp_pair_t *summary;
    const kbtp_item_t *items;
    guint n_items;
} kbtp_msg_t;
"""


def c_source() -> str:
    lines = [
        "/* packet-kbtp.c",
        " * Routines for KBTP (KV Cache Block Transfer Protocol) dissection, Wireshark 4.0 and newer.",
        f" * Generated by `kbtp dissector generate` (kbtp_scapy {__version__}) from kbtp_scapy/tables:",
        " * do not edit; change the tables and regenerate.",
        *_WIRESHARK_NOTICE,
        "",
        _ABOUT,
        _PRELUDE,
        *_constants(),
        "",
        *_enums(),
        "",
        *_flagsets(),
        "",
        *_values(),
        "",
        *_register(),
        "",
        *_bit_hfs(),
        "",
        *_layouts(),
        "",
    ]
    for part in RUNTIME_PARTS:
        lines += [f"/* ---- hand-written runtime: kbtp_scapy/dissector/{part.name} ---- */", part.read_text()]
    return "\n".join([*lines, _MODELINES])


def plugin_source() -> str:
    """The plugin glue Wireshark's plugin loader looks for (doc/plugins.example)."""
    return "\n".join([
        "/* plugin.c",
        " * Plugin glue of the KBTP (KV Cache Block Transfer Protocol) dissector, as Wireshark's",
        " * plugin loader looks for it. Generated by `kbtp dissector generate`: do not edit.",
        *_WIRESHARK_NOTICE,
        "",
        '#include "config.h"',
        "",
        "#include <gmodule.h>",
        "#include <epan/packet.h>",
        "",
        "void proto_register_kbtp(void);",
        "void proto_reg_handoff_kbtp(void);",
        "",
        f'WS_DLL_PUBLIC_DEF const gchar plugin_version[] = "{__version__}";',
        "WS_DLL_PUBLIC_DEF const int plugin_want_major = WIRESHARK_VERSION_MAJOR;",
        "WS_DLL_PUBLIC_DEF const int plugin_want_minor = WIRESHARK_VERSION_MINOR;",
        "",
        "WS_DLL_PUBLIC void plugin_register(void);",
        "",
        "void plugin_register(void)",
        "{",
        "    static proto_plugin plug;",
        "",
        "    plug.register_protoinfo = proto_register_kbtp;",
        "    plug.register_handoff = proto_reg_handoff_kbtp;",
        "    proto_register_plugin(&plug);",
        "}",
        "",
        _MODELINES,
    ])


def outputs(outdir: Path) -> dict[Path, str]:
    return {outdir / "packet-kbtp.c": c_source(), outdir / "plugin.c": plugin_source()}
