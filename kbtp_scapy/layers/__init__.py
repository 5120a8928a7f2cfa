"""Scapy layers: KBTP itself (generated from the tables) and the RDMA transports."""
from .iwarp import *  # noqa: F401,F403
from .kbtp import *  # noqa: F401,F403
from .roce import *  # noqa: F401,F403
