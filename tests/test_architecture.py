"""docs/ARCHITECTURE.md is true: every room of the package is on a floor of its table, and
every import between rooms (at module level or inside a function; not those under
``if TYPE_CHECKING:``) goes to a lower floor."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROW = re.compile(r"^\| (\d+) \| `([\w.]+/?)` \|", re.M)


def floors(page: Path) -> dict[str, int]:
    """Room (``tables``, ``codec``) -> floor, from the page's table."""
    return {room.removesuffix("/").removesuffix(".py"): int(n) for n, room in ROW.findall(page.read_text())}


def _type_only(tree: ast.Module) -> set[int]:
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside |= {id(n) for n in ast.walk(node)}
    return inside


def imports(package: Path) -> list[tuple[str, str, str]]:
    """(module, room it is in, room it imports) for every import of a sibling room."""
    name = package.name
    found = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        room = parts[0] if len(parts) > 1 or parts[0] != "__init__" else ""
        here = [name, *parts[:-1]]              # the package a relative import starts from
        tree = ast.parse(path.read_text())
        skip = _type_only(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom):
                base = here[:len(here) - node.level + 1] if node.level else []
                target = [*base, *(node.module.split(".") if node.module else [])]
                targets = [target + [a.name] if len(target) == 1 else target for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name.split(".") for a in node.names]
            else:
                continue
            for t in targets:
                if t[0] == name and len(t) > 1 and t[1] != room and t[1] != "__version__":
                    found.append((".".join(parts), room, t[1]))
    return found


def violations(package: Path, page: Path) -> list[str]:
    floor = floors(page)
    rooms = {p.name if p.is_dir() else p.stem for p in package.iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    out = [f"{r}: on no floor of {page.name}" for r in sorted(rooms - set(floor))]
    for module, room, other in imports(package):
        if room in floor and other in floor and floor[other] >= floor[room]:
            out.append(f"{module} (floor {floor[room]}) imports {other} (floor {floor[other]})")
    return out


def test_every_room_is_placed_and_every_import_goes_down():
    page = ROOT / "docs" / "ARCHITECTURE.md"
    assert len(floors(page)) >= 15
    assert violations(ROOT / "kbtp_scapy", page) == []


def test_an_upward_or_sideways_import_is_found(tmp_path):
    """The checker on a small package: the bottom importing the top, and two rooms of one
    floor, one of them inside a function; a type-only import is allowed."""
    pkg = tmp_path / "pkg"
    for room in ("low", "mid", "side"):
        (pkg / room).mkdir(parents=True)
        (pkg / room / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("__version__ = '1'\n")
    (pkg / "low" / "a.py").write_text("from ..mid import thing\n")
    (pkg / "mid" / "b.py").write_text("from .. import __version__\nfrom ..low import a\n"
                                      "def f():\n    from pkg.side import c\n")
    (pkg / "side" / "c.py").write_text("from typing import TYPE_CHECKING\n"
                                       "if TYPE_CHECKING:\n    from ..mid import b\n")
    (pkg / "top.py").write_text("import pkg.low.a\n")
    page = tmp_path / "ARCH.md"
    page.write_text("| 1 | `low/` | x |\n| 2 | `mid/` | y |\n| 2 | `side/` | z |\n")
    assert violations(pkg, page) == ["top: on no floor of ARCH.md",
                                     "low.a (floor 1) imports mid (floor 2)",
                                     "mid.b (floor 2) imports side (floor 2)"]
