"""A quoted requirement as people read it: the draft's blank cross-references filled in.

The text as received lost its cross-references ("rules 3 and 5 of ),", "Send with
Invalidate ,"). Cases quote it as it is, so the requirement-to-case matrix still finds
each quote in the text; what reports show fills each blank with the document that
``NOTES.md`` section 1 restores for it, and marks a blank it cannot restore (an empty
"()" pointed at a section of the draft itself, whose numbering the text lost too).
"""
from __future__ import annotations

import re

SECTION = "[section reference omitted in the draft]"
OTHER = "[reference omitted in the draft]"
#: The words before a blank, and what fills it: the document NOTES.md section 1 names for
#: it, or the mark of a section of the draft itself.
CITED: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\brules? (?:3 and )?5 of$"), "[RFC 5040, section 5.5]"),
    (re.compile(r"\bSend with Invalidate$"), "[RFC 5040]"),
    (re.compile(r"\b(?:atomic operations|Add Mask) of$"), "[RFC 7306]"),
    (re.compile(r"\benhanced connection establishment of$"), "[RFC 6581]"),
    (re.compile(r"\bOpcodes are listed in$"), SECTION),
)
#: An empty "()", or a space left before punctuation where a reference was (not an ellipsis).
_BLANK = re.compile(r"\s*\(\s*\)|\s(?=[,;)]|\.(?!\.))")


def readable(quote: str) -> str:
    """``quote`` with every blank reference filled from NOTES.md or marked."""
    def fill(blank: re.Match[str]) -> str:
        if "(" in blank.group():
            return " " + SECTION
        before = quote[:blank.start()]
        return " " + next((ref for words, ref in CITED if words.search(before)), OTHER)
    return _BLANK.sub(fill, quote)
