"""``kbtp analyze``: questions about one capture or a fleet's, answered by SQL.

``rows`` turns captures into one row per KBTP message with derived columns (the session,
the request a COMPLETION answers, latency, credits in flight, the RDMA that carried its
data) and one per RDMA operation, which ``operations`` pairs with its answer; ``schema`` gives those rows
their Arrow types, generated from the tables; ``dataset`` writes them as Parquet files
partitioned by capture, so many hosts' captures form one dataset; ``queries`` runs the
statistics and the hazard checkers on that dataset with DuckDB, embedded, no server.
"""
