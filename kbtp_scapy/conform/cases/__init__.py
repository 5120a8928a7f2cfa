"""The cases, one module per part of the specification; importing registers them."""
from . import (  # noqa: F401
    canary,
    completion,
    direct,
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
