"""Counts in words: "1 octet", "2 octets", "4,096 octets", never "1 octets" or "1 session(s)"."""
from __future__ import annotations


def count(n: int, noun: str, plural: str = "") -> str:
    """``n`` (thousands grouped) and ``noun``, in the plural (``plural``, or ``noun`` + "s")
    unless ``n`` is 1."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"
