"""A replica sharded over ranks: collectives, which slice each rank holds, the sharded modules and loader,
rank 0's runner and the followers, the DP-attention engine."""
