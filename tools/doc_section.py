"""Replace the generated section between two markers of a Markdown file (the benchmark tables)."""
from __future__ import annotations

import re
import sys
from pathlib import Path


def replace_section(doc: Path, begin: str, end: str, text: str) -> bool:
    """Put ``text`` between ``begin`` and ``end`` in ``doc``; False (and a line on stderr)
    when the markers are not there."""
    content = doc.read_text() if doc.is_file() else ""
    if begin not in content or end not in content:
        print(f"{doc}: no {begin} ... {end} section to replace", file=sys.stderr)
        return False
    doc.write_text(re.sub(f"{re.escape(begin)}.*?{re.escape(end)}",
                          lambda _: f"{begin}\n{text}\n{end}", content, flags=re.S))
    return True
