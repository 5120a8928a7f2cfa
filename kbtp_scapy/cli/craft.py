"""``kbtp craft``: build any KBTP message, every field settable, lies included."""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import click

from .. import tables as T
from ..layers.kbtp import _write_word, build_packet
from .errors import file_trouble
from .options import Output

#: opcodes the target sends: a pcap carries them target-to-initiator unless told otherwise
RESPONSES = {T.BY_NAME[m.answer].opcode for m in T.MESSAGES if m.answer}
#: suffixes of -o that choose the output format when --format is not given
SUFFIX_FORMATS = {".pcap": "pcap", ".pcapng": "pcap", ".hex": "hex", ".txt": "hex"}


#: fields whose plain option name means something else on a command line
RENAMED = {"version": "--kbtp-version"}     # --version is the program's version


def _option_name(key: str) -> str:
    return RENAMED.get(key) or "--" + key.replace(".", "-").replace("_", "-")


def _all_fields() -> dict[str, T.Field]:
    """Every settable key of every message, header first, in table order (Opcode is
    the command's argument)."""
    out = {f.key: f.field for f in T.flatten(T.HEADER) if f.field is not T.HEADER.item("opcode")}
    for msg in T.MESSAGES:
        for f in T.flatten(msg.body):
            out.setdefault(f.key, f.field)
    return out


FIELDS = _all_fields()


def _parse_int(text: str, field: T.Field, flag_set: T.FlagSet | None) -> int:
    """A number, an enumeration name, or flag names joined with + (or , or |)."""
    if flag_set is not None:
        names = {f.name: f.value for f in flag_set.flags}
        parts = text.replace(",", "+").replace("|", "+").split("+")
    else:
        names = field.enum.by_name() if field.enum is not None else {}
        parts = [text]
    value = 0
    for part in (p.strip() for p in parts):
        if part.upper() in names:
            value |= names[part.upper()]
            continue
        try:
            value |= int(part, 0)
        except ValueError:
            raise click.BadParameter(f"{part!r} is not {', '.join(names) or 'a number'}") from None
    if not 0 <= value < 1 << (8 * field.size):
        raise click.BadParameter(f"{value} does not fit in {8 * field.size} bits")
    return value


def _hex(text: str, option: str) -> bytes:
    """Hex octets; 0x, colons and spaces allowed."""
    digits = text.replace(":", "").replace(" ", "")
    digits = digits[2:] if digits[:2].lower() == "0x" else digits
    if len(digits) % 2:
        raise click.BadParameter(f"{option}: odd number of hex digits ({len(digits)})")
    try:
        return bytes.fromhex(digits)
    except ValueError:
        raise click.BadParameter(f"{option}: not a hex string: {text[:40]!r}") from None


def _parse(key: str, text: str, msg: T.Message | None) -> Any:
    field = FIELDS[key]
    if field.is_bytes:
        value = _hex(text, _option_name(key))
        if field.size and len(value) != field.size:
            raise click.BadParameter(f"{_option_name(key)}: {len(value)} octets given; the field "
                                     f"is {field.size} octets ({2 * field.size} hex digits)")
        return value
    flag_set = (msg.flags if msg else None) if field.per_opcode_flags else field.flags
    try:
        return _parse_int(text, field, flag_set)
    except click.BadParameter as exc:
        raise click.BadParameter(f"{_option_name(key)}: {exc.message}") from None


def _opcode(text: str) -> int:
    names = T.OPCODES.by_name()
    if text.upper().replace("-", "_") in names:
        return names[text.upper().replace("-", "_")]
    try:
        value = int(text, 0)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not one of {', '.join(names)} or a number 0-255",
                                 param_hint="OPCODE") from None
    if not 0 <= value <= 255:
        raise click.BadParameter(f"{value} is not 0-255", param_hint="OPCODE")
    return value


def _field_options(func):
    for key, field in reversed(list(FIELDS.items())):
        hint = "HEX" if field.is_bytes else ("NAMES|N" if field.flags or field.per_opcode_flags
                                             else ("NAME|N" if field.enum else "N"))
        func = click.option(_option_name(key), key.replace(".", "__"), metavar=hint,
                            help=f"{field.title}: {field.doc}.")(func)
    return func


def _names(values: tuple[T.Value, ...], width: int) -> str:
    return ", ".join(f"{v.name} {v.value:#x}" if width else f"{v.name} {v.value}" for v in values)


def _name_lists() -> str:
    """The names OPCODE and the flag and enumeration options take, from the tables."""
    rows = [("OPCODE", _names(T.OPCODES.values, 1) + "; Private Use "
             + "-".join(f"{v:#x}" for v in T.OPCODES.private_range))]
    for flag_set in dict.fromkeys(m.flags for m in T.MESSAGES if m.flags is not None):
        ops = ", ".join(m.name for m in T.MESSAGES if m.flags is flag_set)
        rows.append((f"--flags of {ops}", _names(flag_set.flags, 1)))
    by_set: dict[str, list[str]] = {}
    for key, field in FIELDS.items():
        names = field.flags or (field.enum if field.enum is not T.OPCODES else None)
        if names is not None and not field.per_opcode_flags:
            by_set.setdefault(names.name, []).append(_option_name(key))
    for set_ in (*T.FLAG_SETS, *T.ENUMERATIONS):
        if set_.name in by_set:
            values = set_.flags if isinstance(set_, T.FlagSet) else set_.values
            rows.append((", ".join(by_set[set_.name]),
                         _names(values, isinstance(set_, T.FlagSet))))
    lines = ["\b", "Names (numbers work too; join flags with +):"]
    for label, text in rows:
        lines.append(f"  {label}:")
        lines += textwrap.wrap(text, 92, initial_indent="    ", subsequent_indent="    ")
    return "\n".join(lines)


@click.command(context_settings={"max_content_width": 100}, epilog=_name_lists())
@click.argument("opcode")
@click.option("--inline-data-file", type=click.File("rb"), help="Read the inline data from a file.")
@click.option("--trailer", metavar="HEX", default=None,
              help="Octets appended after the message as built (in the same Send).")
@click.option("--addr-le", is_flag=True, help="Encode address fields little-endian (an ADDR_LE session).")
@click.option("--format", "fmt", type=click.Choice(["hex", "raw", "pcap"]), default=None,
              help="Output: hex text, raw octets, or a pcap [default: hex on standard output; "
                   "with -o by its suffix: .pcap/.pcapng a pcap, .hex/.txt hex, others raw].")
@click.option("--transport", type=click.Choice(["roce", "iwarp"]), default="roce", show_default=True,
              help="RDMA binding that carries the message in a pcap.")
@click.option("--from-target/--from-initiator", "from_target", default=None,
              help="Who sends it in a pcap [default: the target for HELLO_ACK and COMPLETION].")
@click.option("-o", "--output", type=Output(), help="Write here instead of stdout.")
@_field_options
def craft(opcode: str, inline_data_file, trailer: str | None, addr_le: bool, fmt: str | None,
          transport: str, from_target: bool | None, output: str | None, **given: str | None) -> None:
    """Build one KBTP message of OPCODE (a name such as ALLOC_STORE, or a number, including
    Private Use and unknown ones) and write it as hex, raw octets or a pcap.

    Every field of every message has an option (--request-id, --dd-stag, --hello-ack-features,
    ...). Flags, Features and the Data Descriptor Length are computed when not given, and
    kept as given otherwise, so a message can lie: an item given whose flag or feature bit
    the given word lacks is built all the same, with a note on stderr. Numbers take 0x
    prefixes; flag and enumeration fields also take names (--flags INLINE+SEAL, --status
    NOT_VALID), listed below.

    \b
    Examples:
      kbtp craft ALLOC_STORE --request-id 7 --handle 0x4001 --inline-data 4b56424c4f434b21
      kbtp craft STORE --flags INLINE --dd-length 4096 --inline-data 00   # a length lie
      kbtp craft LOAD --flags 0 --cd-stag 0x99        # a Completion Descriptor without RECORD
      kbtp craft LOAD --handle 7 --dd-stag 0x1234 --dd-length 32768 -o load.pcap
      kbtp craft COMPLETION --request-id 7 --status NOT_VALID -o answer.pcap   # target to initiator
      kbtp craft FREE --handle 0x4001 --trailer deadbeef -o free.raw      # raw octets
      kbtp craft 0xC3 --transport iwarp -o private.pcap
    """
    op = _opcode(opcode)
    msg = T.BY_OPCODE.get(op)
    valid = {f.key for f in T.flatten(T.HEADER)} | {f.key for f in (T.flatten(msg.body) if msg else ())}
    values: dict[str, Any] = {"opcode": op}
    for name, text in given.items():
        if text is None:
            continue
        key = name.replace("__", ".")
        if key not in valid:
            raise click.UsageError(f"{_option_name(key)} does not apply to "
                                   f"{T.OPCODES.describe(op)}")
        values[key] = _parse(key, text, msg)
    if inline_data_file is not None:
        if "inline_data" not in valid:
            raise click.UsageError(f"--inline-data-file does not apply to {T.OPCODES.describe(op)}")
        values["inline_data"] = inline_data_file.read()
    wire = _build(values, msg, addr_le) + (_hex(trailer, "--trailer") if trailer else b"")
    fmt = fmt or (SUFFIX_FORMATS.get(Path(output).suffix.lower(), "raw") if output else "hex")
    if fmt == "pcap":
        if not output:
            raise click.UsageError("--format pcap needs -o FILE")
        from ..builders.recorder import write_pcap
        by_target = op in RESPONSES if from_target is None else from_target
        try:
            write_pcap(output, transport, [("response" if by_target else "request", wire)])
        except OSError as exc:
            raise file_trouble(output, exc, option="-o") from None
        click.echo(f"wrote {output}: 1 KBTP message over {transport}, "
                   f"{'target to initiator' if by_target else 'initiator to target'}", err=True)
    elif fmt == "raw":
        _write(output, wire)
    else:
        _write(output, (wire.hex() + "\n").encode())


def _build(values: dict[str, Any], msg: T.Message | None, addr_le: bool) -> bytes:
    """The message's octets. A conditional item given while the given controlling word
    (Flags, HELLO_ACK Features) lacks its bit is a lie the user asked for: it is built with
    the bit set, then the word is written back as given, and a note says so."""
    forced: dict[str, tuple[T.Struct, int, int]] = {}     # word key -> (struct, given, forced)
    for cond, items in _given_conditions(values, msg).items():
        assert msg is not None                  # the conditions are of its body
        struct_, key = (T.HEADER, "flags") if cond.source == "flags" else (
            msg.body, _word_key(msg.body, cond.source))
        word = values.get(key)
        if word is None or word & cond.mask:
            continue
        given, built = forced.get(key, (struct_, word, word))[1:]
        forced[key] = (struct_, given, built | cond.mask)
        bit = _flag_name(struct_, cond, msg)
        click.echo(f"kbtp craft: note: {', '.join(items)} built although "
                   f"{struct_.item(cond.source).title} lacks {bit}, as asked", err=True)
    wire = bytes(build_packet({**values, **{k: v[2] for k, v in forced.items()}}, addr_le=addr_le))
    for key, (struct_, given, _) in forced.items():
        at = 0 if struct_ is T.HEADER else T.HEADER_SIZE
        wire = wire[:at] + _write_word(wire[at:], struct_, key.rsplit(".", 1)[-1], given)
    return wire


def _given_conditions(values: dict[str, Any], msg: T.Message | None) -> dict[T.Condition, list[str]]:
    """Conditions of the body items given, with the titles of the items each gates."""
    out: dict[T.Condition, list[str]] = {}
    for f in T.flatten(msg.body) if msg else ():
        if f.when is not None and f.key in values:
            out.setdefault(f.when, [])
    for cond, titles in out.items():
        assert msg is not None
        titles += [msg.body.item(name).title for name in msg.body.gated(cond)]
    return out


def _word_key(struct_: T.Struct, name: str) -> str:
    return next(f.key for f in T.flatten(struct_) if f.path == (name,))


def _flag_name(struct_: T.Struct, cond: T.Condition, msg: T.Message) -> str:
    field = struct_.item(cond.source)
    assert isinstance(field, T.Field)           # a controlling word
    flag_set = msg.flags if field.per_opcode_flags else field.flags
    flags = flag_set.flags if flag_set is not None else ()
    return next((f.name for f in flags if f.value == cond.mask), f"{cond.mask:#x}")


def _write(output: str | None, data: bytes) -> None:
    if output:
        try:
            Path(output).write_bytes(data)
        except OSError as exc:
            raise file_trouble(output, exc, option="-o") from None
    else:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
