"""The reference KBTP target: its state in registered memory, in the specification's formats."""
from .config import TargetConfig
from .server import Target

__all__ = ["Target", "TargetConfig"]
