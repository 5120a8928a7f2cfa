# scapy.contrib.description = KBTP, the KV Cache Block Transfer Protocol (iWARP and RoCEv2)
# scapy.contrib.status = loads
"""Loaded by Scapy as ``scapy.contrib.kbtp``: re-exports the layers defined once in
``kbtp_scapy.layers`` so the classes and their bindings are never defined twice."""
from kbtp_scapy.layers import *  # noqa: F401,F403
