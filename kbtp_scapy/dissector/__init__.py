"""The Wireshark Lua dissector, generated from the field tables (``generate``)."""
from __future__ import annotations

from pathlib import Path

from .generate import outputs

REPO_DISSECTOR = Path(__file__).resolve().parents[2] / "dissector"


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
