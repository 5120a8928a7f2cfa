"""The reference KBTP initiator (``Initiator.connect(url)``) and its results."""
from .client import Initiator
from .results import KbtpError, Result, SessionEnded, TargetInfo

__all__ = ["Initiator", "KbtpError", "Result", "SessionEnded", "TargetInfo"]
