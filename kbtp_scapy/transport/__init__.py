"""RDMA transports that carry KBTP: iWARP (TCP/MPA/DDP/RDMAP) and RoCEv2 (UDP/BTH)."""
