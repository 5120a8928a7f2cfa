"""Every code block of the README runs as written, from the checkout's root, in a sandbox of
its own (``tests/sandbox.py``): a private network namespace, so the README's addresses and
ports are the test's, a HOME of its own and ``kbtp`` on PATH as after ``. .venv/bin/activate``.
A block that talks to a target without starting one gets one on its defaults."""
from __future__ import annotations

import re

import pytest

from .sandbox import ROOT, Sandbox

README = (ROOT / "README.md").read_text()
FENCED = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)
#: the README's two set-up commands, its only indented blocks: .ci/run runs the second, and
#: tests/test_demo.py runs the demo as the first does
SET_UP = ["./tools/install.sh && .venv/bin/kbtp demo", "./tools/install.sh && .venv/bin/python -m pytest -q"]


def fenced() -> list[tuple[int, str, str]]:
    """(line number, language, text) of every fenced block."""
    return [(README.count("\n", 0, m.start()) + 1, m[1], m[2]) for m in FENCED.finditer(README)]


def commands(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_every_block_says_what_it_is():
    """Runnable blocks are sh or python; the one text block is the layout tree; the only
    indented blocks are the two set-up commands."""
    kinds = [lang for _, lang, _ in fenced()]
    assert set(kinds) == {"sh", "python", "text"} and kinds.count("text") == 1
    outside = FENCED.sub("", README)
    indented = [line.strip() for line in outside.splitlines() if line.startswith("    ") and line.strip()]
    assert indented == SET_UP


RUNNABLE = [b for b in fenced() if b[1] in ("sh", "python")]


@pytest.mark.parametrize("line,lang,text", RUNNABLE, ids=[f"line{b[0]}-{b[1]}" for b in RUNNABLE])
def test_readme_block_runs(tmp_path, line, lang, text):
    box = Sandbox(tmp_path)
    if lang == "python":
        box.write("readme_block.py", text)
        steps = box.run(["python readme_block.py"], names=text)
    else:
        steps = box.run(commands(text))
    failed = [s for s in steps if not s.ok]
    assert not failed, f"README line {line}:\n" + "\n\n".join(s.why() for s in failed)
