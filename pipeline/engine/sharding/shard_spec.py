"""Which part of each stored tensor a rank of a sharded replica holds (pipeline.parallel for the layout).

:func:`linear_role` names how a linear (or embedding) is split; :func:`tensor_slice` turns a tensor name
into what the rank reads: ``None`` (not held: another rank's expert), ``FULL``, or ``(dim, start, end)``.

- column-parallel (output rows split): ``q_b_proj`` / ``q_proj`` and ``kv_b_proj`` by heads over tp, the
  dense MLP's and the shared expert's gate/up over tp, each held expert's gate/up over moe_tp. Every
  per-output tensor (``bias``, ``quant_bias``, ``deq_scale``, ``weight_scale``, ``weight_offset``) is
  split like the weight's rows; ``input_scale`` / ``input_offset`` are whole.
- row-parallel (input columns split): ``o_proj`` by heads over tp, the dense and shared down_proj over tp,
  each held expert's down_proj over moe_tp; the weight's columns only, everything else whole (the
  epilogue runs once, after the int32 products are reduced).
- vocab-parallel: ``embed_tokens`` and ``lm_head`` (and the MTP layer's ``shared_head.head``) by rows
  over tp.
- everything else (norms, router, ``q_a_proj``, ``kv_a_proj_with_mqa``, ``eh_proj``, fa_k): whole.
"""

from __future__ import annotations

import re
from typing import Union

from pipeline.config import DeepseekV3Config
from pipeline.parallel import ParallelConfig

FULL = "full"
COL, ROW, VOCAB, REPLICATED = "col", "row", "vocab", "replicated"
PER_INPUT_LEAVES = ("input_scale", "input_offset")

_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)$")
Slice = Union[None, str, tuple[int, int, int]]


def expert_range(cfg: DeepseekV3Config, parallel: ParallelConfig, rank: int) -> range:
    """The routed experts rank ``rank`` holds."""
    per = cfg.n_routed_experts // parallel.moe_ep
    e = parallel.ep_rank(rank)
    return range(e * per, (e + 1) * per)


def linear_role(cfg: DeepseekV3Config, prefix: str) -> tuple[str, str, int]:
    """(role, group, width split) of the module ``prefix`` (a name without its leaf): role COL, ROW, VOCAB
    or REPLICATED; group "tp" or "moe_tp"; the split dimension's full size (rows for COL/VOCAB, columns
    for ROW)."""
    H = cfg.num_attention_heads
    m = _EXPERT.search(prefix)
    if m:
        return (ROW if m.group(2) == "down_proj" else COL), "moe_tp", cfg.moe_intermediate_size
    if prefix.endswith(("self_attn.q_b_proj", "self_attn.q_proj")):
        return COL, "tp", H * cfg.qk_head_dim
    if prefix.endswith("self_attn.kv_b_proj"):
        return COL, "tp", H * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    if prefix.endswith("self_attn.o_proj"):
        return ROW, "tp", H * cfg.v_head_dim
    if prefix.endswith(("embed_tokens", "lm_head", "shared_head.head")):
        return VOCAB, "tp", cfg.vocab_size
    for part, width in ((".mlp.shared_experts.", cfg.moe_intermediate_size * cfg.n_shared_experts),
                        (".mlp.", cfg.intermediate_size)):
        if part in prefix + "." and prefix.endswith(("gate_proj", "up_proj", "down_proj")) and \
                ".experts." not in prefix:
            return (ROW if prefix.endswith("down_proj") else COL), "tp", width
    return REPLICATED, "tp", 0


def _group_rank(parallel: ParallelConfig, rank: int, group: str) -> tuple[int, int]:
    if group == "moe_tp":
        return parallel.moe_tp_rank(rank), parallel.moe_tp
    return parallel.tp_rank(rank), parallel.tp


def part(width: int, parallel: ParallelConfig, rank: int, group: str) -> tuple[int, int]:
    """[start, end) of a ``width`` split evenly over the rank's ``group``."""
    r, n = _group_rank(parallel, rank, group)
    if width % n:
        raise ValueError(f"parallel config: {group} {n} does not divide a width of {width}")
    step = width // n
    return r * step, (r + 1) * step


def tensor_slice(cfg: DeepseekV3Config, parallel: ParallelConfig, rank: int, name: str) -> Slice:
    """What rank ``rank`` holds of stored tensor ``name``: None, FULL or (dim, start, end)."""
    prefix, _, leaf = name.rpartition(".")
    m = _EXPERT.search(prefix)
    if m and int(m.group(1)) not in expert_range(cfg, parallel, rank):
        return None
    role, group, width = linear_role(cfg, prefix)
    if role == REPLICATED or leaf in PER_INPUT_LEAVES:
        return FULL
    a, b = part(width, parallel, rank, group)
    if role == ROW:
        return (1, a, b) if leaf == "weight" else FULL
    return (0, a, b)
