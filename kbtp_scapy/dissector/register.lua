-- Hook the dissector into Wireshark: heuristics on the RDMA payload tables, strict, so
-- they never claim other protocols' frames (they run before the built-in ones).
kbtp:register_heuristic("infiniband.payload", heur_infiniband)
kbtp:register_heuristic("iwarp_ddp_rdmap", heur_iwarp)
