"""kbtp_scapy: Scapy layers, a fast codec and tools for KBTP over iWARP and RoCEv2."""
__version__ = "0.1.0"
