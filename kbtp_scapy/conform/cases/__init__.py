"""The cases, one module per part of the specification; importing registers them.

The registry knows nothing of the modules that fill it: ``all_cases`` is here, where the
imports that register them are, so that no import runs from the registry back up.
"""
from ..registry import CASES, Case
from . import (  # noqa: F401
    canary,
    completion,
    direct,
    flags,
    generation,
    late,
    limits,
    negotiation,
    ops,
    precedence,
    security,
    session,
    width,
)


def all_cases() -> list[Case]:
    """Every case of target conformance, in registration order."""
    return list(CASES)
