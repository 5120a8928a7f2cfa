"""Every code block of the README runs as written, from the checkout's root, in a sandbox of
its own (``tests/sandbox.py``): a private network namespace, so the README's addresses and
ports are the test's, a HOME of its own and ``kbtp`` on PATH as after ``. .venv/bin/activate``.
A block that talks to a target without starting one gets one on its defaults. A ``text``
block right after a runnable one is the output its last command prints; the ``console``
block is the install, which needs the network and is checked against pyproject.toml."""
from __future__ import annotations

import re
import tomllib

import pytest

from .sandbox import ROOT, Sandbox, campaign_marks

README = (ROOT / "README.md").read_text()
FENCED = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)
#: the README's two set-up commands, its only indented blocks: the install that puts the
#: environment's ``kbtp`` on PATH for every command after it, and the suite, as .ci/run runs it
SET_UP = ["./tools/install.sh && . .venv/bin/activate", "./tools/install.sh && .venv/bin/python -m pytest -q"]
QUICK_START = README[README.index("## Quick start"):README.index("\n## ", README.index("## Quick start") + 3)]


def _adjacent(first: re.Match, then: re.Match) -> bool:
    return not README[first.end():then.start()].strip()


def fenced() -> list[tuple[int, str, str, list[str]]]:
    """(line number, language, text, the output shown right after it) of every fenced block,
    but for those shown outputs."""
    found = list(FENCED.finditer(README))
    out = []
    for i, m in enumerate(found):
        if m[1] == "text" and i and _adjacent(found[i - 1], m):
            continue
        after = found[i + 1] if i + 1 < len(found) else None
        shown = after[2].splitlines() if after and after[1] == "text" and _adjacent(m, after) else []
        out.append((README.count("\n", 0, m.start()) + 1, m[1], m[2], shown))
    return out


def commands(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_every_block_says_what_it_is():
    """Runnable blocks are sh or python, each text block is the output of the block before
    it, one console block installs; the only indented blocks are the two set-up commands."""
    kinds = [lang for _, lang, _, _ in fenced()]
    assert set(kinds) <= {"sh", "python", "console"} and kinds.count("console") == 1
    assert README.count("```text\n") == sum(1 for *_, shown in fenced() if shown) >= 1
    outside = FENCED.sub("", README)
    indented = [line.strip() for line in outside.splitlines() if line.startswith("    ") and line.strip()]
    assert indented == SET_UP


def test_ci_runs_the_readme_test_command():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#")]
    assert ci[-1] == SET_UP[1]


def test_commands_find_kbtp_as_written():
    """The quick start puts the environment on PATH (activates it) before its first command,
    and no block names the environment's ``kbtp`` by path: every ``kbtp`` line runs as written
    in the shell the install left (it was "kbtp: command not found" after the demo)."""
    first_block = QUICK_START.index("```sh")
    assert ". .venv/bin/activate" in QUICK_START[:first_block]
    assert SET_UP[0] in QUICK_START[:first_block]
    assert not [text for _, lang, text, _ in fenced() if ".venv/bin/kbtp" in text]


def test_case_counts_are_the_registrys():
    """The numbers of cases the README gives are those ``kbtp conform --list`` lists."""
    from kbtp_scapy.conform.cases import all_cases
    from kbtp_scapy.conform.initiator.runner import all_cases as initiator_cases
    said = [int(n) for n in re.findall(r"(\d+)\s+cases \(`kbtp conform (?:--role initiator )?--list`\)", README)]
    assert said == [len(all_cases()), len(initiator_cases())]


def requirements(extras: dict[str, list[str]], extra: str) -> set[str]:
    """The distributions an extra brings, through the extras of this project it names."""
    out = set()
    for dep in extras[extra]:
        name, inner = re.match(r"([\w.-]+)(?:\[([\w,]+)\])?", dep).groups()
        if name == "kbtp_scapy":
            out = out.union(*(requirements(extras, e) for e in inner.split(",")))
        else:
            out.add(name)
    return out


def test_the_install_names_the_extras_there_are():
    """Each extra the install block names exists, every extra is named in the README with
    what it brings, and [test] brings what tools/install.sh checks the suite can import."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    [install] = [text for _, lang, text, _ in fenced() if lang == "console"]
    named = {x for group in re.findall(r"pip install '\.\[([\w,]+)\]'", install) for x in group.split(",")}
    assert named and named <= set(extras)
    for extra in extras:
        assert f"`[{extra}]` adds" in README, extra
    checked = re.search(r"python -c 'import kbtp_scapy\.cli, ([\w, ]+)'", (ROOT / "tools" / "install.sh").read_text())
    assert set(checked[1].split(", ")) <= requirements(extras, "test")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", ["README.md", "docs/DECISIONS.md", "docs/PERFORMANCE.md", "docs/ARCHITECTURE.md",
                                  "docs/TOOLS.md", "docs/LAB.md"])
def test_links_lead_somewhere(page):
    """Every relative link of the guide and of the records names a file of the checkout,
    every #anchor a heading of its page."""
    path = ROOT / page
    text = FENCED.sub("", path.read_text())
    anchors = {_slug(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        if link.startswith("#"):
            assert link[1:] in anchors, link
        elif "://" not in link:
            assert (path.parent / link.split("#")[0]).exists(), link


RUNNABLE = [b for b in fenced() if b[1] in ("sh", "python")]


def shows(output: str, shown: list[str]) -> bool:
    """The shown lines appear in the output in order; ``...`` stands for lines left out."""
    lines = iter(line.rstrip() for line in output.splitlines())
    return all(any(line == want.rstrip() for line in lines) for want in shown if want != "...")


@pytest.mark.slow
@pytest.mark.parametrize("line,lang,text,shown", [pytest.param(*b, marks=campaign_marks(b[2]), id=f"line{b[0]}-{b[1]}")
                                                  for b in RUNNABLE])
def test_readme_block_runs(tmp_path, line, lang, text, shown):
    box = Sandbox(tmp_path)
    if lang == "python":
        box.write("readme_block.py", text)
        steps = box.run(["python readme_block.py"], names=text)
    else:
        steps = box.run(commands(text))
    failed = [s for s in steps if not s.ok]
    assert not failed, f"README line {line}:\n" + "\n\n".join(s.why() for s in failed)
    if shown:
        last = [s for s in steps if not s.target][-1]
        assert shows(last.stdout + last.stderr, shown), \
            f"README line {line}: output shown after it is not what it prints:\n{last.why()}"


@pytest.mark.slow
def test_quick_start_runs_in_order(tmp_path):
    """The quick start's commands, every block in the order a newcomer follows them, in one
    sandbox: the target of "Run the reference target" serves the conformance check after it
    (in the other order the check found nothing listening)."""
    lines = [line for m in FENCED.finditer(QUICK_START) if m[1] == "sh" for line in commands(m[2])]
    assert lines[0] == "kbtp demo" and any(line == "kbtp target" for line in lines)
    steps = Sandbox(tmp_path).run(lines)
    failed = [s for s in steps if not s.ok]
    assert not failed, "\n\n".join(s.why() for s in failed)
    assert not [s for s in steps if s.target and not s.line.startswith("kbtp target")], \
        "the sandbox started a target the quick start did not"
