"""The specification's normative sentences, found in its text (not in the checker's code).

The text as received has its headings run into the first sentence of each section and its
ASCII diagrams flattened onto single lines; ``sections`` cuts it at the known headings,
``sentences`` splits each section into sentences (a numbered step or a bullet is one),
drops the diagrams, and says of each what kind of requirement it is: a BCP 14 keyword,
a procedure step, a field definition, a HELLO_ACK promise, a Security Consideration, or
a plain rule (normative text without a keyword).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

#: The headings of the text, in order, with whether the section is normative.
HEADINGS: tuple[tuple[str, bool], ...] = (
    ("Introduction", False), ("Background", False), ("Problem Statement", False),
    ("Comparison of Approaches", False), ("Overview", False),
    ("Scope and Relationship to Other Work", False), ("Conventions and Definitions", True),
    ("Target Memory Structures", True), ("Block Pool", True), ("Block Table", True),
    ("Free-Block Ring", True), ("Allocation Quotas", True), ("Session Establishment", True),
    ("HELLO_ACK", True), ("Messages", True), ("Common Header", True), ("Descriptors", True),
    ("Operations", True), ("Block Load", True), ("Block Mapped Store", True),
    ("Block Unmapped Store", True), ("Block Free", True), ("Completion", True),
    ("Direct Modes", True), ("Status Codes", True), ("Target Execution Model", False),
    ("Transport Bindings", True), ("RDMAP Binding", True), ("InfiniBand and RoCEv2", True),
    ("Operational Considerations", True), ("Security Considerations", True),
    ("IANA Considerations", False), ("References", False), ("Examples", False),
    ("Acknowledgments", False),
)
#: Where each heading starts in the flattened text (its first words as they appear there).
STARTS = {
    "Introduction": "Introduction\n", "Background": "Background The KV cache",
    "Problem Statement": "Problem Statement Three", "Comparison of Approaches": "Comparison of Approaches",
    "Overview": "Overview A KBTP target", "Scope and Relationship to Other Work": "Scope and Relationship",
    "Conventions and Definitions": "Conventions and Definitions The key words",
    "Target Memory Structures": "Target Memory Structures\n", "Block Pool": "Block Pool The target",
    "Block Table": "Block Table The block table", "Free-Block Ring": "Free-Block Ring The free-block",
    "Allocation Quotas": "Allocation Quotas The target", "Session Establishment": "Session Establishment After",
    "HELLO_ACK": "HELLO_ACK Body (Target Descriptor)", "Messages": "Messages\n",
    "Common Header": "Common Header\n", "Descriptors": "Descriptors A Data Descriptor",
    "Operations": "Operations A target processes", "Block Load": "Block Load\n\n1.",
    "Block Mapped Store": "Block Mapped Store\n\n1.", "Block Unmapped Store": "Block Unmapped Store\n\n1.",
    "Block Free": "Block Free\n\n1.", "Completion": "Completion By default",
    "Direct Modes": "Direct Modes Direct modes expose", "Status Codes": "Status Codes KBTP Status",
    "Target Execution Model": "Target Execution Model This", "Transport Bindings": "Transport Bindings\n",
    "RDMAP Binding": "RDMAP Binding\n", "InfiniBand and RoCEv2": "InfiniBand and RoCEv2 Over",
    "Operational Considerations": "Operational Considerations\n",
    "Security Considerations": "Security Considerations The security",
    "IANA Considerations": "IANA Considerations IANA", "References": "References Normative",
    "Examples": "Examples ALLOC_STORE", "Acknowledgments": "Acknowledgments The authors",
}
BCP14 = re.compile(r"\b(MUST NOT|MUST|REQUIRED|SHALL NOT|SHALL|SHOULD NOT|SHOULD|NOT RECOMMENDED|"
                   r"RECOMMENDED|MAY|OPTIONAL)\b")
DIAGRAM = re.compile(r"\+-\+-")
FIELD = re.compile(r"\(\d+ bits\)|\b\d+-bit\b|\b\d+ octets\b|\b0x[0-9A-Fa-f]{4}\b|\bis the number of\b")


@dataclass(frozen=True)
class Sentence:
    section: str
    kind: str           # "BCP 14", "step", "field", "promise", "security" or "rule"
    keyword: str        # the BCP 14 keyword, if any
    text: str

    @property
    def key(self) -> str:
        """A stable short name: the section and the sentence's first words."""
        return f"{self.section}: {' '.join(self.text.split()[:10])}"


def sections(text: str) -> list[tuple[str, bool, str]]:
    """(heading, normative, body) in the order of the text."""
    found = []
    for heading, normative in HEADINGS:
        at = text.find(STARTS[heading])
        if at < 0:
            raise ValueError(f"the heading {heading!r} is not where the text should have it")
        found.append((at, heading, normative))
    found.sort()
    out = []
    for i, (at, heading, normative) in enumerate(found):
        end = found[i + 1][0] if i + 1 < len(found) else len(text)
        body = text[at:end]
        start = STARTS[heading].rstrip("\n")
        body = body[len(heading):] if body.startswith(heading) and start != heading else body[len(heading):]
        out.append((heading, normative, body.strip()))
    return out


TABLE_HEADINGS = {"Opcode Name Body after the header", "KBTP Status Codes", "Value Name Meaning",
                  "KBTP Opcodes"}
_SPLIT = re.compile(r"(?<=[.;])\s+(?=[A-Z(•])|\n+")


def _pieces(body: str) -> list[tuple[str, bool]]:
    """Sentences of a section body, each with whether it belongs to a numbered step of a
    procedure (the step's number stays on its first sentence). A diagram and the field
    list that follows it on its line are cut at the last '+' of the drawing; a defined
    term ("Block Handle:") goes in front of its definition."""
    out, label = [], ""
    for line in body.split("\n"):
        line = " ".join(line.split())
        if not line or line in TABLE_HEADINGS:
            continue
        if DIAGRAM.search(line):
            line = line[line.rfind("+") + 1:].strip()
        if line.endswith(":") and len(line.split()) <= 3:     # a defined term: "Block Handle:"
            label = line + " "
            continue
        step = re.match(r"(\d+)\.\s", line)
        number = f"{step.group(1)}. " if step else ""
        if step:
            line = line[step.end():]
        for piece in _SPLIT.split(line):
            piece = piece.strip(" •")
            if len(piece.split()) >= 2:
                out.append((label + number + piece, bool(step)))
                label = number = ""
    return out


def _kind(section: str, text: str, step: bool) -> tuple[str, str]:
    m = BCP14.search(text)
    if m:
        return "BCP 14", m.group(1)
    if section == "Security Considerations":
        return "security", ""
    if section == "HELLO_ACK":
        return "promise", ""
    if step or text.startswith(("Initialization:", "Allocation:", "Free:")):
        return "step", ""
    if FIELD.search(text):
        return "field", ""
    return "rule", ""


def sentences(text: str) -> list[Sentence]:
    """Every sentence of the normative sections, classified."""
    out = []
    for heading, normative, body in sections(text):
        if not normative:
            continue
        pieces = _pieces(body)
        if heading == "Conventions and Definitions":      # the BCP 14 boilerplate is no requirement
            pieces = [p for p in pieces if not p[0].startswith(("The key words", "This document uses"))]
        for piece, step in pieces:
            kind, keyword = _kind(heading, piece, step)
            out.append(Sentence(heading, kind, keyword, piece))
    return out
