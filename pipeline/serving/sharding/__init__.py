"""One replica of the quantized model sharded over ranks, on paper (what ``scripts/sharding_table.py``
prints): ``plan`` (per-rank weights, KV capacity, the suggested layouts), ``placement`` (where each tensor
lives) and ``collectives`` (what a decode step communicates). No weight read, no compute."""
