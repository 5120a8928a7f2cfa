"""The generated vocabulary (kbtp_scapy.vocab) against the tables and the codec.

The enums must name exactly the tables' values, the flag classes must mask as the int
constants they replaced did, and each record must have exactly the keys the codec
reads and writes for its message.
"""
from __future__ import annotations

import enum
import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from kbtp_scapy import codec, tables as T, vocab
from kbtp_scapy.tables import generate

CLASSES = [(e, getattr(vocab, generate.enum_class(e))) for e in T.ENUMERATIONS] + [
    (f, getattr(vocab, generate.flag_class(f))) for f in T.FLAG_SETS]


def _values(table: T.Enumeration | T.FlagSet) -> tuple[T.Value, ...]:
    return table.values if isinstance(table, T.Enumeration) else table.flags


@pytest.mark.parametrize("table, cls", CLASSES, ids=[c.__name__ for _, c in CLASSES])
def test_every_table_value_is_a_member_with_its_name(table, cls):
    assert [(m.name, m.value) for m in cls] == [(v.name, v.value) for v in _values(table)]
    assert issubclass(cls, enum.IntEnum if isinstance(table, T.Enumeration) else enum.IntFlag)


def test_committed_vocabulary_is_fresh():
    """The stale-file check without tshark (test_dissector runs the CLI's ``--check``)."""
    assert generate.VOCAB_PATH.read_text() == generate.vocab_source(), "run 'kbtp dissector generate'"


def test_names_follow_the_tables():
    assert (vocab.Opcode.LOAD, vocab.Status.NOT_VALID, vocab.RequestFlag.RECORD, vocab.Feature.ADDR_LE,
            vocab.GoodbyeFlag.RELEASE, vocab.EntryFlag.SEALED) == (0x10, 3, 4, 8, 1, 2)
    assert {generate.enum_class(e) for e in T.ENUMERATIONS} | {generate.flag_class(f) for f in T.FLAG_SETS} \
        == {"Opcode", "Status", "RequestFlag", "GoodbyeFlag", "Feature", "EntryFlag"}


def test_members_print_and_serialize_as_numbers():
    """What the int constants printed, so output that formats them does not change."""
    both = vocab.RequestFlag.INLINE | vocab.RequestFlag.RECORD
    assert (f"{vocab.Opcode.LOAD}", str(vocab.Status.OK), f"{both}", f"{vocab.Feature.ADDR_LE:#06x}") \
        == ("16", "0", "5", "0x0008")
    assert json.dumps({"opcode": vocab.Opcode.LOAD, "flags": both}) == '{"opcode": 16, "flags": 5}'
    assert (vocab.Opcode.LOAD.name, vocab.RequestFlag(both).name) == ("LOAD", "INLINE|RECORD")


def test_flag_masks_keep_the_bits_the_set_does_not_declare():
    """Clearing one flag keeps Private Use and undefined bits, as ``& ~int`` did;
    IntFlag's own complement would clear them. Bitwise results are plain ints."""
    word = 0xF000 | 0x0100 | vocab.Feature.ADDR_LE | vocab.Feature.DIRECT_LOAD
    assert word & ~vocab.Feature.ADDR_LE == 0xF101
    assert ~vocab.Feature.ADDR_LE == -9
    results = (word & vocab.Feature.ADDR_LE, vocab.Feature.ADDR_LE & word, word | vocab.Feature.ADDR_LE,
               vocab.Feature.ADDR_LE | vocab.Feature.DIRECT_LOAD, vocab.Feature.ADDR_LE ^ word)
    assert results == (8, 8, 0xF109, 9, 0xF101) and {type(r) for r in results} == {int}
    assert vocab.Feature(0x1001).value == 0x1001 and vocab.Feature["ADDR_LE"] is vocab.Feature.ADDR_LE


def _keys(record: type) -> set[str]:
    return set(typing.get_type_hints(record))


def _decoded_keys(opcode: int) -> set[str]:
    """Keys the codec decodes for every layout variant of an opcode, from real octets."""
    out: set[str] = set()
    for op, present in codec.layout_variants():
        if op != opcode:
            continue
        conds = T.BY_OPCODE[op].body.conditions
        on = {c for c, p in zip(conds, present) if p}
        flags = sum(c.mask for c in on if c.source == "flags")
        values: dict[str, int] = {"opcode": op, "flags": flags}
        for c in on - {c for c in conds if c.source == "flags"}:
            key = next(f.key for f in T.flatten(T.BY_OPCODE[op].body) if f.field.name == c.source)
            values[key] = values.get(key, 0) | c.mask
        out |= set(codec.decode(codec.encode(values)))
    return out


@pytest.mark.parametrize("msg", T.MESSAGES, ids=[m.name for m in T.MESSAGES])
def test_message_records_have_the_codecs_keys(msg):
    record = getattr(vocab, generate.message_record(msg))
    assert _keys(record) == _decoded_keys(msg.opcode)
    assert _keys(record) <= _keys(vocab.AnyMessage)
    assert record.__total__ is False


def test_any_message_is_every_message_field():
    assert _keys(vocab.AnyMessage) == set().union(*(_decoded_keys(m.opcode) for m in T.MESSAGES))
    assert _keys(vocab.AnyMessage) == set(T.wire_fields())


@pytest.mark.parametrize("struct_", generate.STRUCTS, ids=[s.name for s in generate.STRUCTS])
def test_struct_records_have_the_codecs_keys(struct_):
    record = getattr(vocab, generate.struct_record(struct_))
    assert _keys(record) == set(codec.decode_struct(struct_, bytes(struct_.size)))
    assert _keys(record) <= _keys(vocab.AnyStruct)


def test_records_type_bytes_fields_as_bytes():
    hints = typing.get_type_hints(vocab.AnyMessage)
    assert {k for k, t in hints.items() if t is bytes} == {
        k for k, (f, _) in T.wire_fields().items() if f.is_bytes}


_MYPY_PROBE = '''
from kbtp_scapy import codec
from kbtp_scapy.vocab import HelloAck, Opcode


def probe(stag: int, ack: HelloAck) -> int:
    codec.encode({"opcode": Opcode.LOAD, "dd.stag": stag, "dd.length": 8})
    codec.encode(ack)
    codec.encode({"opcode": Opcode.LOAD, "dd.stagg": stag})          # line 9: no such key
    msg = codec.decode(b"")
    return msg["dd.stag"] + msg["hello_ack.block_sise"]             # line 11: no such key
'''


def test_mypy_checks_record_keys(tmp_path):
    """What the records are for: mypy rejects a key no message has, in what the codec is
    given and in what it returns, and accepts the ones the tables declare."""
    pytest.importorskip("mypy")
    probe = tmp_path / "probe.py"
    probe.write_text(_MYPY_PROBE)
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-m", "mypy", "--follow-imports=silent", "--no-error-summary",
                           "--cache-dir", str(tmp_path / "cache"), "--config-file", "", str(probe)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "MYPYPATH": str(root)})
    errors = sorted({int(line.split(":")[1]) for line in proc.stdout.splitlines() if ": error:" in line})
    assert errors == [9, 11], proc.stdout
    assert '"hello_ack.block_sise"' in proc.stdout
