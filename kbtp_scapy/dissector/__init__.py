"""The Wireshark dissector in its two forms, generated from the field tables: Lua
(``generate``) and C (``generate_c``, which builds on the Lua generator's field list)."""
from __future__ import annotations

from pathlib import Path

from . import generate_c
from .generate import fields_markdown, lua_source

REPO_DISSECTOR = Path(__file__).resolve().parents[2] / "dissector"


def outputs(outdir: Path) -> dict[Path, str]:
    """The files the generator writes, with their contents: both forms and the reference."""
    return {outdir / "kbtp.lua": lua_source(), outdir / "FIELDS.md": fields_markdown(),
            **generate_c.outputs(outdir)}


def lua_path() -> Path:
    """kbtp.lua for ``tshark -X lua_script:PATH`` or pyshark: the committed dissector of
    this checkout, or one generated beside the user's cache when the package was
    installed without the repository."""
    path = REPO_DISSECTOR / "kbtp.lua"
    if path.exists():
        return path
    cache = Path.home() / ".cache" / "kbtp_scapy"
    cache.mkdir(parents=True, exist_ok=True)
    for out, text in outputs(cache).items():
        out.write_text(text)
    return cache / "kbtp.lua"
