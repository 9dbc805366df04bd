"""One replica of the quantized model sharded over ranks, on paper (what ``scripts/sharding_table.py``
prints): ``plan`` (per-rank weights, KV capacity, the suggested layouts), ``placement`` (where each tensor
lives) and ``collectives`` (what a decode step communicates), for DeepSeek-V3's config and a header-only
replica of the 671B release (``replica``, which the quantize job's planner is tested against too). No
weight read, no compute."""
