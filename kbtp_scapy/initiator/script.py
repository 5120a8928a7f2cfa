"""Operation scripts: what an initiator under test is asked to do, in a few words.

The initiator checker (``kbtp conform --role initiator``) runs the program under test
once per case and tells it what to do with a script such as
``alloc_store 7 @in seal; load 7 @out; free 7``. Statements are separated by ``;`` or
new lines and run one after the other; the operations of one statement joined by ``&``
are issued together (so that several requests can be in flight). A handle is an offset
into the range the HELLO_ACK grants (``7`` is Handle Base + 7), so a script does not
depend on the target. ``@name`` names a file: the data of a store in the input
directory, the destination of a load in the output directory.

The program writes one line per operation, in script order, to ``results`` in the output
directory: the operation, its handle offset (``-`` for none) and the status name
(``OK``, ``NOT_VALID``, ... or ``ERROR`` when no status came back). ``docs/
INITIATOR_CONFORMANCE.md`` is the interface's user documentation; ``driver.py`` runs a
script on the reference initiator.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field

#: operation -> (takes a handle, takes a file, words it accepts)
OPS: dict[str, tuple[bool, bool, frozenset[str]]] = {
    "alloc_store": (True, True, frozenset({"seal", "inline", "noinline", "record"})),
    "store": (True, True, frozenset({"seal", "inline", "noinline", "record"})),
    "load": (True, True, frozenset({"unsealed", "record"})),
    "free": (True, False, frozenset({"record"})),
    "direct_load": (True, True, frozenset()),
    "direct_alloc": (True, True, frozenset()),
    "goodbye": (False, False, frozenset({"release"})),
}
RESULTS = "results"


class ScriptError(ValueError):
    """A script that does not parse: the message names the operation and what is wrong."""


@dataclass(frozen=True)
class Op:
    name: str
    handle: int | None = None          # offset into the granted handle range
    file: str | None = None
    words: frozenset[str] = field(default_factory=frozenset)

    def __str__(self) -> str:
        parts = [self.name] + ([str(self.handle)] if self.handle is not None else [])
        parts += [f"@{self.file}"] if self.file else []
        return " ".join(parts + sorted(self.words))


Script = list[list[Op]]
"""Statements in order; the operations of one statement are issued together."""


def parse(text: str) -> Script:
    """The statements of ``text``; ``ScriptError`` for anything that is not an operation."""
    out: Script = []
    for raw in text.replace("\n", ";").split(";"):
        if not raw.strip():
            continue
        out.append([_op(part) for part in raw.split("&")])
    return out


def _op(text: str) -> Op:
    words = shlex.split(text)
    if not words:
        raise ScriptError("an empty operation between '&'")
    name, rest = words[0].lower().replace("-", "_"), words[1:]
    if name not in OPS:
        raise ScriptError(f"unknown operation {words[0]!r}; choose from {', '.join(OPS)}")
    takes_handle, takes_file, allowed = OPS[name]
    handle = None
    if takes_handle:
        if not rest:
            raise ScriptError(f"{name}: a handle (an offset into the granted range) is missing")
        try:
            handle = int(rest.pop(0), 0)
        except ValueError:
            raise ScriptError(f"{name}: the handle must be a number") from None
        if handle < 0:
            raise ScriptError(f"{name}: the handle offset must not be negative")
    file = None
    files = [w for w in rest if w.startswith("@")]
    if takes_file:
        if len(files) != 1 or len(files[0]) < 2 or "/" in files[0]:
            raise ScriptError(f"{name}: needs one @FILE (a plain file name)")
        file = files[0][1:]
    elif files:
        raise ScriptError(f"{name}: takes no @FILE")
    extra = {w.lower() for w in rest if not w.startswith("@")}
    if extra - allowed:
        raise ScriptError(f"{name}: unknown word(s) {', '.join(sorted(extra - allowed))}")
    if {"inline", "noinline"} <= extra:
        raise ScriptError(f"{name}: inline and noinline together")
    return Op(name, handle, file, frozenset(extra))


def result_line(op: Op, status: str) -> str:
    return f"{op.name} {'-' if op.handle is None else op.handle} {status}"


#: The status of an operation the program under test does not implement (it sends nothing
#: for it): the checker skips the case rather than judging a feature that is not there.
UNSUPPORTED = "UNSUPPORTED"


def parse_results(text: str) -> list[tuple[str, str, str]]:
    """``(operation, handle offset, status)`` of each line of a results file."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3:
            out.append((parts[0], parts[1], parts[2]))
    return out
