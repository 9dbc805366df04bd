"""How one replica is laid over its ranks, in MindIE's names (docs/serving.md, "Sharded serving").

``world = dp * tp = moe_ep * moe_tp`` ranks (devices). Attention and the dense parts run data-parallel over
``dp`` groups of ``tp`` ranks; the routed experts run over the same ranks as ``moe_ep`` groups of
``moe_tp``::

    rank r:  dp_rank = r // tp,        tp_rank = r % tp          (a tp group: consecutive ranks, one node)
             ep_rank = r // moe_tp,    moe_tp_rank = r % moe_tp

- attention (DP-attention): each dp group owns its sequences and their latent cache (MLA's one latent per
  token would only be copied by head-parallelism); inside the group the heads are split over tp
  (``q_b_proj`` and ``kv_b_proj`` by heads, ``o_proj`` row-parallel, its int32 products reduced);
- the dense MLP and the shared expert: tp inside the group (gate/up by columns, down row-parallel);
- the routed experts: rank r holds experts ``[ep_rank * E / moe_ep, (ep_rank + 1) * E / moe_ep)``, each
  one's intermediate width split over ``moe_tp``; every rank routes every token (the router is replicated);
- embedding and lm_head: vocab-parallel over tp; the MTP layer as a decoder layer.

``sp`` (sequence parallelism) is MindIE's too; this engine takes only ``sp = 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

SIZES = ("tp", "dp", "moe_ep", "moe_tp", "sp")


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    dp: int = 1
    moe_ep: int = 1
    moe_tp: int = 0          # 0: what fills the world, dp * tp // moe_ep
    sp: int = 1

    def __post_init__(self):
        for name in SIZES:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "moe_tp" else 1):
                raise ValueError(f"parallel config: {name} must be a positive integer, got {v!r}")
        if self.moe_tp == 0:
            if (self.dp * self.tp) % self.moe_ep:
                raise ValueError(f"parallel config: moe_ep {self.moe_ep} does not divide dp x tp = "
                                 f"{self.dp * self.tp} ranks; set moe_ep to a divisor of dp x tp (or give moe_tp)")
            object.__setattr__(self, "moe_tp", self.dp * self.tp // self.moe_ep)
        if self.dp * self.tp != self.moe_ep * self.moe_tp:
            raise ValueError(f"parallel config: dp x tp = {self.dp}x{self.tp} = {self.dp * self.tp} but moe_ep x "
                             f"moe_tp = {self.moe_ep}x{self.moe_tp} = {self.moe_ep * self.moe_tp}: attention and "
                             "the experts run over the same ranks; make the products equal")
        if self.sp != 1:
            raise ValueError(f"parallel config: sp {self.sp} is not supported by this engine (sequence "
                             "parallelism); set sp to 1")

    @property
    def world(self) -> int:
        return self.dp * self.tp

    @property
    def single(self) -> bool:
        return self.world == 1

    def dp_rank(self, rank: int) -> int:
        return rank // self.tp

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def ep_rank(self, rank: int) -> int:
        return rank // self.moe_tp

    def moe_tp_rank(self, rank: int) -> int:
        return rank % self.moe_tp

    def tp_group(self, rank: int) -> list[int]:
        d = self.dp_rank(rank)
        return list(range(d * self.tp, (d + 1) * self.tp))

    def dp_peers(self, rank: int) -> list[int]:
        """The ranks with the same tp_rank in every dp group (one per group, in dp order)."""
        return [d * self.tp + self.tp_rank(rank) for d in range(self.dp)]

    def moe_tp_group(self, rank: int) -> list[int]:
        e = self.ep_rank(rank)
        return list(range(e * self.moe_tp, (e + 1) * self.moe_tp))

    def check_model(self, num_heads: int, n_routed_experts: int, moe_intermediate: int, intermediate: int,
                    vocab: int, shared_intermediate: int = 0) -> None:
        """Refuse a layout this model's shapes cannot be split by, naming the size and the fix."""
        rules = [("tp", self.tp, num_heads, "attention heads"), ("tp", self.tp, intermediate, "dense MLP width"),
                 ("tp", self.tp, vocab, "vocabulary"), ("moe_ep", self.moe_ep, n_routed_experts, "routed experts"),
                 ("moe_tp", self.moe_tp, moe_intermediate, "expert width")]
        if shared_intermediate:
            rules.append(("tp", self.tp, shared_intermediate, "shared-expert width"))
        for name, size, dim, what in rules:
            if dim % size:
                raise ValueError(f"parallel config: {name} {size} does not divide the model's {dim} {what}; "
                                 f"choose {name} among the divisors of {dim}")

    def check_config(self, cfg) -> None:
        """:meth:`check_model` with a DeepseekV3Config's sizes."""
        self.check_model(cfg.num_attention_heads, cfg.n_routed_experts, cfg.moe_intermediate_size,
                         cfg.intermediate_size, cfg.vocab_size, cfg.moe_intermediate_size * cfg.n_shared_experts)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in SIZES}

    def describe(self) -> str:
        return (f"{self.world} rank(s): dp {self.dp} x tp {self.tp} for attention, moe_ep {self.moe_ep} x "
                f"moe_tp {self.moe_tp} for the experts")
