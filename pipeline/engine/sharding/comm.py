"""The collectives a sharded replica runs, over ``torch.distributed`` process groups (gloo on CPU, NCCL on
CUDA), named by what they join (pipeline.parallel): the tp group of a rank's dp group, its peers across
the dp groups (same tp_rank), its moe_tp group, and the world.

:class:`Comm` with one rank (``Comm.single()``) does no communication at all, so the sharded modules run
unchanged in one process. Every collective of a step is counted (``bytes_sent``: payload bytes each rank
contributes), for the benchmark's bytes-per-step figure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from pipeline.parallel import ParallelConfig


@dataclass
class Comm:
    parallel: ParallelConfig
    rank: int = 0
    tp_group: Any = None
    dp_group: Any = None
    moe_tp_group: Any = None
    world_group: Any = None
    bytes_sent: int = 0
    calls: dict = field(default_factory=dict)

    @classmethod
    def single(cls) -> "Comm":
        return cls(ParallelConfig())

    @classmethod
    def init(cls, parallel: ParallelConfig, rank: int, init_method: str, backend: Optional[str] = None,
             timeout_s: float = 120.0) -> "Comm":
        """Join the world process group (rank ``rank`` of ``parallel.world``) and make the sub-groups; every
        rank calls this with the same arguments but its rank."""
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=parallel.world,
                                timeout=timedelta(seconds=timeout_s))
        comm = cls(parallel, rank, world_group=dist.group.WORLD)
        p = parallel
        for d in range(p.dp):                       # every rank creates every group, in the same order
            g = dist.new_group(list(range(d * p.tp, (d + 1) * p.tp)))
            if p.dp_rank(rank) == d:
                comm.tp_group = g
        for t in range(p.tp):
            g = dist.new_group([d * p.tp + t for d in range(p.dp)])
            if p.tp_rank(rank) == t:
                comm.dp_group = g
        for e in range(p.moe_ep):
            g = dist.new_group(list(range(e * p.moe_tp, (e + 1) * p.moe_tp)))
            if p.ep_rank(rank) == e:
                comm.moe_tp_group = g
        return comm

    # ----- sizes ----------------------------------------------------------------------------------
    @property
    def tp(self) -> int:
        return self.parallel.tp

    @property
    def tp_rank(self) -> int:
        return self.parallel.tp_rank(self.rank)

    @property
    def moe_tp(self) -> int:
        return self.parallel.moe_tp

    @property
    def moe_tp_rank(self) -> int:
        return self.parallel.moe_tp_rank(self.rank)

    @property
    def ep_rank(self) -> int:
        return self.parallel.ep_rank(self.rank)

    # ----- collectives ----------------------------------------------------------------------------
    def _count(self, what: str, t: torch.Tensor) -> None:
        self.bytes_sent += t.numel() * t.element_size()
        self.calls[what] = self.calls.get(what, 0) + 1

    def all_reduce(self, t: torch.Tensor, group: str, op: str = "sum") -> torch.Tensor:
        """In place over ``group`` ("tp", "dp", "moe_tp" or "world"); a no-op when the group has one rank."""
        size = {"tp": self.parallel.tp, "dp": self.parallel.dp, "moe_tp": self.parallel.moe_tp,
                "world": self.parallel.world}[group]
        if size == 1:
            return t
        self._count(f"all_reduce_{op}_{group}", t)
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX,
                        group=getattr(self, f"{group}_group"))
        return t

    def all_gather_tp(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The tp group's equally shaped pieces, concatenated along ``dim`` in tp_rank order."""
        if self.parallel.tp == 1:
            return t
        self._count("all_gather_tp", t)
        parts = [torch.empty_like(t) for _ in range(self.parallel.tp)]
        dist.all_gather(parts, t.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=dim)

    def all_gather_dp(self, t: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Rows of every dp group (their counts may differ): (the rows concatenated in dp order, each
        group's row count)."""
        if self.parallel.dp == 1:
            return t, [t.shape[0]]
        n = torch.tensor([t.shape[0]], dtype=torch.int64)
        counts = [torch.zeros_like(n) for _ in range(self.parallel.dp)]
        dist.all_gather(counts, n, group=self.dp_group)
        counts = [int(c) for c in counts]
        m = max(counts)
        pad = torch.zeros((m - t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        mine = torch.cat([t, pad]) if m > t.shape[0] else t.contiguous()
        self._count("all_gather_dp", mine)
        parts = [torch.empty_like(mine) for _ in range(self.parallel.dp)]
        dist.all_gather(parts, mine, group=self.dp_group)
        return torch.cat([p[:c] for p, c in zip(parts, counts)]), counts

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank of the world (one pickled broadcast)."""
        if self.parallel.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def close(self) -> None:
        if self.parallel.world > 1 and dist.is_initialized():
            dist.destroy_process_group()
