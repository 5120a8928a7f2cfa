"""``kbtp craft``: build any KBTP message, every field settable, lies included."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from .. import tables as T
from ..layers.kbtp import build_packet


def _option_name(key: str) -> str:
    return "--" + key.replace(".", "-").replace("_", "-")


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


def _parse(key: str, text: str, msg: T.Message | None) -> Any:
    field = FIELDS[key]
    if field.is_bytes:
        try:
            return bytes.fromhex(text.replace(":", "").replace(" ", ""))
        except ValueError:
            raise click.BadParameter(f"{_option_name(key)}: not a hex string") from None
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


@click.command(context_settings={"max_content_width": 100})
@click.argument("opcode")
@click.option("--inline-data-file", type=click.File("rb"), help="Read the inline data from a file.")
@click.option("--addr-le", is_flag=True, help="Encode address fields little-endian (an ADDR_LE session).")
@click.option("--format", "fmt", type=click.Choice(["hex", "raw", "pcap"]), default=None,
              help="Output: hex text (default), raw octets, or a pcap (default when -o ends in .pcap).")
@click.option("--transport", type=click.Choice(["roce", "iwarp"]), default="roce", show_default=True,
              help="RDMA binding that carries the message in a pcap.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write here instead of stdout.")
@_field_options
def craft(opcode: str, inline_data_file, addr_le: bool, fmt: str | None, transport: str,
          output: str | None, **given: str | None) -> None:
    """Build one KBTP message of OPCODE (a name such as ALLOC_STORE, or a number, including
    Private Use and unknown ones) and write it as hex, raw octets or a pcap.

    Every field of every message has an option (--request-id, --dd-stag, --hello-ack-features,
    ...). Flags, Features and the Data Descriptor Length are computed when not given, and
    kept as given otherwise, so a message can lie. Numbers take 0x prefixes; flag and
    enumeration fields also take names (--flags INLINE+SEAL, --status NOT_VALID).

    \b
    Examples:
      kbtp craft ALLOC_STORE --request-id 7 --handle 0x4001 --inline-data 4b56424c4f434b21
      kbtp craft STORE --flags INLINE --dd-length 4096 --inline-data 00   # a length lie
      kbtp craft LOAD --handle 7 --dd-stag 0x1234 --dd-length 32768 -o load.pcap
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
    wire = bytes(build_packet(values, addr_le=addr_le))
    fmt = fmt or ("pcap" if output and Path(output).suffix in (".pcap", ".pcapng") else "hex")
    if fmt == "pcap":
        if not output:
            raise click.UsageError("--format pcap needs -o FILE")
        from ..framing import write_pcap
        write_pcap(output, transport, [("request", wire)])
        click.echo(f"wrote {output}: 1 KBTP message over {transport}", err=True)
    elif fmt == "raw":
        _write(output, wire)
    else:
        _write(output, (wire.hex() + "\n").encode())


def _write(output: str | None, data: bytes) -> None:
    if output:
        Path(output).write_bytes(data)
    else:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
