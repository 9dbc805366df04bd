"""Running a sharded replica's model: rank 0 drives, the other ranks follow (docs/serving.md, "Sharded
serving").

Rank 0 holds the engine (scheduler, sampling) and a :class:`ShardedRunner`: each call that runs the model
(``forward``, ``mtp_forward``) or changes the cache (``write_blocks``) is first broadcast to every rank as
one message (:class:`Forward`, :class:`MtpForward`, ... below) with the step's spans (plain ids,
positions, block ids), then run on rank 0's own shard. Every other rank runs :func:`follow`: it receives the message
and makes the same call on its shard, so all ranks enter the same collectives in the same order; the logits and
tokens are rank 0's. A rank keeps the hidden state of its last ``forward`` for the MTP call that follows it (only the
rows are sent).

A failure in a collective (a rank that died, a timeout) leaves the replica unusable as a unit:
``ShardedRunner`` then refuses every later call (``broken`` says why) so that the serving layer reports
the replica unhealthy and it is replaced whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from pipeline.engine.protocol import ReplicaBroken
from pipeline.engine.sharding.comm import Comm
from pipeline.engine.worker.runner import ModelRunner, Span


# ----- rank 0's messages to the other ranks -------------------------------------------------------------

@dataclass(frozen=True)
class Forward:
    spans: list
    rows: list


@dataclass(frozen=True)
class MtpForward:
    spans: list
    hidden_rows: list           # rows of the hidden state the rank kept from its last Forward
    rows: list


@dataclass(frozen=True)
class WriteBlocks:
    blocks: list
    data: Any


@dataclass(frozen=True)
class ForwardDP:
    per_group: list             # per dp group: (spans, rows), or None


@dataclass(frozen=True)
class MtpDP:
    per_group: list             # per dp group: (spans, hidden_rows, rows), or None


@dataclass(frozen=True)
class ReadBlocksDP:
    group: int
    blocks: list


@dataclass(frozen=True)
class WriteBlocksDP:
    group: int
    blocks: list
    data: Any


@dataclass(frozen=True)
class Stop:
    pass


class ShardedRunner(ModelRunner):
    """Rank 0's runner of a sharded replica (module docstring). ``comm``: rank 0's Comm; ``on_close``:
    called once when the runner is closed (stops the other ranks' processes)."""

    def __init__(self, *args, comm: Comm, on_close=None, **kw):
        super().__init__(*args, **kw)
        self.comm, self._on_close = comm, on_close
        self.broken: Optional[str] = None
        self.steps = 0

    def _send(self, msg) -> None:
        if self.broken:
            raise ReplicaBroken(f"sharded replica unusable: {self.broken}")
        try:
            self.comm.broadcast_object(msg)
        except Exception as e:  # noqa: BLE001 - any collective failure breaks the whole replica
            self.broken = f"{type(e).__name__}: {e}"
            raise ReplicaBroken(f"sharded replica unusable: {self.broken}") from e

    def _run(self, fn, *args):
        try:
            return fn(*args)
        except Exception as e:
            if isinstance(e, (ValueError, TypeError)) and not _is_comm_error(e):
                raise                                   # the same bad input failed on every rank: not fatal
            self.broken = f"{type(e).__name__}: {e}"
            raise ReplicaBroken(f"sharded replica unusable: {self.broken}") from e

    @torch.no_grad()
    def forward(self, spans: Sequence[Span], rows: Sequence[int]):
        self._send(Forward(list(spans), list(rows)))
        self.steps += 1
        return self._run(super().forward, spans, rows)

    @torch.no_grad()
    def mtp_forward(self, spans: Sequence[Span], hidden: torch.Tensor, hidden_rows: Sequence[int],
                    rows: Sequence[int]) -> torch.Tensor:
        self._send(MtpForward(list(spans), list(hidden_rows), list(rows)))
        return self._run(super().mtp_forward, spans, hidden, hidden_rows, rows)

    def write_blocks(self, blocks, data) -> None:
        self._send(WriteBlocks(list(blocks), data))
        self._run(super().write_blocks, blocks, data)

    def close(self) -> None:
        """Tell the other ranks to stop (when they still listen) and leave the process group."""
        if self._on_close is None:
            return
        try:
            if not self.broken:
                self.comm.broadcast_object(Stop())
        except Exception:  # noqa: BLE001 - stopping a replica whose rank already died
            pass
        finally:
            on_close, self._on_close = self._on_close, None
            self.comm.close()
            on_close()


class DPRunner(ShardedRunner):
    """Rank 0's runner of a DP-attention replica (dp > 1): each step runs every dp group's own spans at
    once (:func:`dp_forward`); rank 0 runs group 0's and receives every group's logits. The engine calls
    ``forward_dp`` / ``mtp_dp`` (pipeline.engine.sharding.dp_engine), never ``forward``."""

    def __init__(self, *args, **kw):
        super().__init__(*args, scratch=True, **kw)
        self.hidden: Optional[torch.Tensor] = None

    def forward(self, spans, rows):
        raise TypeError("a DP-attention replica runs all its groups at once: use forward_dp (dp_engine)")

    def forward_dp(self, per_group: list) -> list:
        self._send(ForwardDP(per_group))
        self.steps += 1
        return self._run(dp_forward, self, self.comm, per_group)

    def mtp_dp(self, per_group: list) -> list:
        self._send(MtpDP(per_group))
        return self._run(dp_mtp, self, self.comm, per_group)

    def read_blocks_dp(self, group: int, blocks) -> dict:
        self._send(ReadBlocksDP(group, list(blocks)))
        return self._run(dp_read_blocks, self, self.comm, group, list(blocks))

    def write_blocks_dp(self, group: int, blocks, data) -> None:
        self._send(WriteBlocksDP(group, list(blocks), data))
        self._run(dp_write_blocks, self, self.comm, group, list(blocks), data)

    def read_blocks(self, blocks):
        raise TypeError("a DP-attention replica's blocks live in one group: use read_blocks_dp")

    def write_blocks(self, blocks, data):
        raise TypeError("a DP-attention replica's blocks live in one group: use write_blocks_dp")


def dp_read_blocks(runner: ModelRunner, comm: Comm, group: int, blocks: list) -> dict:
    """Blocks of dp group ``group``'s cache, from its first rank to every rank (one broadcast)."""
    src = group * comm.parallel.tp
    return comm.broadcast_object(ModelRunner.read_blocks(runner, blocks) if comm.rank == src else None, src=src)


def dp_write_blocks(runner: ModelRunner, comm: Comm, group: int, blocks: list, data: dict) -> None:
    """Store handed-over blocks in dp group ``group``'s cache (its ranks only; the data came in rank 0's
    broadcast of the call)."""
    if comm.parallel.dp_rank(comm.rank) == group:
        ModelRunner.write_blocks(runner, blocks, data)


def _gather(comm: Comm, logits: torch.Tensor) -> list[torch.Tensor]:
    rows, counts = comm.all_gather_dp(logits)
    out, a = [], 0
    for c in counts:
        out.append(rows[a:a + c])
        a += c
    return out


def dp_forward(runner: ModelRunner, comm: Comm, per_group: list) -> list[torch.Tensor]:
    """This rank's dp group's part of a step (``per_group[g]``: (spans, rows), or None for a group without
    work, which runs one token in the scratch block so that every rank joins the MoE's collectives), then
    every group's logits, gathered over the dp groups in dp order. The hidden state stays on the rank
    (``runner.hidden``) for the MTP call."""
    mine = per_group[comm.parallel.dp_rank(comm.rank)]
    spans, rows = mine if mine is not None else ([Span([0], 0, [runner.scratch_block])], [])
    logits, runner.hidden = ModelRunner.forward(runner, spans, rows)
    return _gather(comm, logits)


def dp_mtp(runner: ModelRunner, comm: Comm, per_group: list) -> list[torch.Tensor]:
    """The MTP layer's part, as :func:`dp_forward` (``per_group[g]``: (spans, hidden_rows, rows) or None)."""
    mine = per_group[comm.parallel.dp_rank(comm.rank)]
    spans, hidden_rows, rows = mine if mine is not None else ([Span([0], 0, [runner.scratch_block])], [0], [])
    return _gather(comm, ModelRunner.mtp_forward(runner, spans, runner.hidden, hidden_rows, rows))


def _is_comm_error(e: BaseException) -> bool:
    text = str(e).lower()
    return any(w in text for w in ("gloo", "nccl", "connection", "timed out", "timeout", "peer"))


def follow(runner: ModelRunner, comm: Comm) -> int:
    """A rank other than 0: run rank 0's calls on this shard until it says stop; returns the steps run.
    A call that fails here with bad input failed on rank 0 too (the same checks run first everywhere)."""
    hidden, steps = None, 0
    with torch.no_grad():
        while True:
            msg = comm.broadcast_object()
            if isinstance(msg, Stop):
                comm.close()
                return steps
            try:
                if isinstance(msg, Forward):
                    _, hidden = runner.forward(msg.spans, msg.rows)
                    steps += 1
                elif isinstance(msg, MtpForward):
                    runner.mtp_forward(msg.spans, hidden, msg.hidden_rows, msg.rows)
                elif isinstance(msg, WriteBlocks):
                    runner.write_blocks(msg.blocks, msg.data)
                elif isinstance(msg, ForwardDP):
                    dp_forward(runner, comm, msg.per_group)
                    steps += 1
                elif isinstance(msg, MtpDP):
                    dp_mtp(runner, comm, msg.per_group)
                elif isinstance(msg, ReadBlocksDP):
                    dp_read_blocks(runner, comm, msg.group, msg.blocks)
                elif isinstance(msg, WriteBlocksDP):
                    dp_write_blocks(runner, comm, msg.group, msg.blocks, msg.data)
                else:
                    raise ValueError(f"unknown message {type(msg).__name__} from rank 0")
            except (ValueError, TypeError) as e:
                if _is_comm_error(e):
                    raise
