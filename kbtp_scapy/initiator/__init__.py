"""The reference KBTP initiator (``Initiator.connect(url)``) and its results."""
from .client import Initiator
from .results import KbtpError, Result, TargetInfo

__all__ = ["Initiator", "KbtpError", "Result", "TargetInfo"]
