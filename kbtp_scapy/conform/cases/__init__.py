"""The cases, one module per part of the specification; importing registers them."""
from . import completion, direct, generation, ops, security, session  # noqa: F401
