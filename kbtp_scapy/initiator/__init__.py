"""The reference KBTP initiator (``Initiator.connect(url)``) and its results."""
from .client import Initiator
from .limits import Limits, NoAnswer, PeerLimit
from .results import KbtpError, Result, SessionEnded, TargetInfo

__all__ = ["Initiator", "KbtpError", "Limits", "NoAnswer", "PeerLimit", "Result", "SessionEnded", "TargetInfo"]
