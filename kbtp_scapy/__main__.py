"""``python -m kbtp_scapy`` runs the kbtp command."""
from .cli import entry

entry()
