"""The vocabulary grid and its process groups: which shard a rank holds, and one dedicated group
per reduction channel (x broadcast, statistics, input gradient, embedding sum, embedding
gradient), so that each channel's collectives are issued in microbatch order on every rank
whatever the interleaving of the passes (NCCL needs one order per communicator)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch.distributed as dist

from ...runtime.communicators import warm_up_groups
from ...runtime.p2p import group_timeout_kwargs
from .config import VocabConfigError

__all__ = ["VocabGroups"]


@dataclass
class VocabGroups:
    """This rank's place in the vocabulary grid and the dedicated groups of each channel.

    ``grid[p][t]`` is the global rank of pipeline rank p, tensor rank t of this model replica;
    shard index = p * tp + t.
    """

    grid: list[list[int]]
    pp_rank: int
    tp_rank: int
    stats: object = None        # all pp*tp ranks: the statistics (and Alg. 2's input gradient)
    dx: object = None           # all pp*tp ranks: Alg. 1's input gradient
    x: object = None            # the pipeline line of this tp rank: x broadcast from the last stage
    emb: object = None          # the pipeline line: partial embeddings reduced into the first stage
    embgrad: object = None      # the pipeline line: embedding gradient broadcast from the first stage
    emb_tp: object = None       # the first stage's tp ranks: the reduced embedding summed over tp
    order: list[int] = field(default_factory=list)   # shard of each group rank of ``stats``
    first_pp: int = 0           # pipeline rank of the first stage
    last_pp: int = -1           # pipeline rank of the last stage (-1: pp - 1; 0 with the V placement)
    #: one-queue mode (``VocabParallelConfig(one_queue_comms=k)``): the k groups of each channel
    #: (``stats``, ``dx``, ``x``, ``emb``, ``embgrad``); microbatch m uses group m mod k
    comms: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.last_pp < 0:
            self.last_pp = len(self.grid) - 1

    def comm(self, name: str, m: int):
        """The group of channel ``name`` that microbatch ``m`` uses (one-queue mode)."""
        grps = self.comms.get(name)
        if not grps:
            return getattr(self, name)
        return grps[m % len(grps)]

    @property
    def pp(self) -> int:
        return len(self.grid)

    @property
    def tp(self) -> int:
        return len(self.grid[0])

    @property
    def size(self) -> int:
        return self.pp * self.tp

    @property
    def shard(self) -> int:
        return self.pp_rank * self.tp + self.tp_rank

    @property
    def is_first(self) -> bool:
        return self.pp_rank == self.first_pp

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.last_pp

    @property
    def last_rank(self) -> int:
        """Global rank of the last stage in this rank's pipeline line."""
        return self.grid[self.last_pp][self.tp_rank]

    @property
    def first_rank(self) -> int:
        return self.grid[self.first_pp][self.tp_rank]

    @classmethod
    def build(cls, replicas: Sequence[Sequence[Sequence[int]]], my_rank: int | None = None, *, first_pp: int = 0,
              last_pp: int = -1, comms: int = 1) -> "VocabGroups":
        """Create the groups of every replica (collective: every rank of the world calls it with
        the same ``replicas`` = [replica][pp][tp] global ranks) and return this rank's.
        ``first_pp`` / ``last_pp``: pipeline ranks of the first / last stage. ``comms`` > 1
        (one-queue mode): k groups per channel, all created and warmed in one global order."""
        comms = int(comms)
        if comms < 1:
            raise VocabConfigError(f"one_queue_comms {comms} must be >= 1")
        me = dist.get_rank() if my_rank is None else my_rank
        mine = None
        made: dict = {}
        created: list = []   # (group, members) in creation order: the order of their warm-up

        def new(ranks: list, name: str):
            grp = dist.new_group(ranks=ranks, group_desc=f"mppx-vocab-{name}", **group_timeout_kwargs())
            created.append((grp, ranks))
            return grp

        for grid in replicas:
            grid = [list(row) for row in grid]
            pp, tp = len(grid), len(grid[0])
            flat = [grid[p][t] for p in range(pp) for t in range(tp)]
            inside = me in flat
            g = {}
            ks: dict = {}
            for name in ("stats", "dx"):
                ks[name] = [new(flat, name if k == 0 else f"{name}{k}") for k in range(comms)]
                g[name] = ks[name][0]
            for t in range(tp):
                line = [grid[p][t] for p in range(pp)]
                for name in ("x", "emb", "embgrad"):
                    grps = [new(line, name if k == 0 else f"{name}{k}") for k in range(comms)]
                    if me in line:
                        g[name] = grps[0]
                        ks[name] = grps
            if comms > 1:
                g["comms"] = ks
            first_tp = new([grid[first_pp][t] for t in range(tp)], "emb_tp")
            if me in grid[first_pp]:
                g["emb_tp"] = first_tp
            if inside:
                p = next(i for i in range(pp) if me in grid[i])
                mine = (grid, p, grid[p].index(me))
                made = g
        # every communicator now, in one global order: on NCCL each is created at its first
        # collective, and the passes first use them in different orders on different ranks
        warm_up_groups(grp for grp, ranks in created if me in ranks)
        if mine is None:
            raise VocabConfigError(f"rank {me} is in none of the vocabulary-parallel grids {replicas}")
        grid, p, t = mine
        shard_of = {grid[pp_][tp_]: pp_ * len(grid[0]) + tp_ for pp_ in range(len(grid)) for tp_ in range(len(grid[0]))}
        order = [shard_of[r] for r in sorted(shard_of)]
        return cls(grid, p, t, order=order, first_pp=first_pp, last_pp=last_pp, **made)

    @classmethod
    def from_grid(cls, pp: int, tp: int, *, first_pp: int = 0, last_pp: int = -1, comms: int = 1) -> "VocabGroups":
        """One replica of pp x tp ranks, global rank = p * tp + t (the world must be pp * tp)."""
        return cls.build([[[p * tp + t for t in range(tp)] for p in range(pp)]], first_pp=first_pp, last_pp=last_pp,
                         comms=comms)

    @classmethod
    def from_parallel_state(cls, *, has_first: bool | None = None, has_last: bool | None = None,
                            comms: int = 1) -> "VocabGroups":
        """The grids of Megatron-Core's parallel state (one per data/context-parallel replica).
        ``has_first`` / ``has_last``: whether this rank holds the first / last stage (default:
        pipeline rank 0 / pp - 1); gathered to find those ranks (the V placement puts both on
        pipeline rank 0)."""
        from megatron.core import parallel_state as ps
        me = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
              ps.get_data_parallel_rank(), ps.get_context_parallel_rank())
        if ps.get_context_parallel_world_size() > 1:
            raise VocabConfigError("vocabulary parallelism does not support context parallelism yet "
                                   "(--context-parallel-size 1)")
        world = dist.get_world_size()
        everyone: list = [None] * world
        pp, tp = ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()
        if has_first is None:
            has_first = me[0] == 0
        if has_last is None:
            has_last = me[0] == pp - 1
        dist.all_gather_object(everyone, (dist.get_rank(),) + me + (bool(has_first), bool(has_last)))
        replicas: dict = {}
        firsts, lasts = set(), set()
        for rank, p, t, d, c, hf, hl in everyone:
            replicas.setdefault((d, c), [[None] * tp for _ in range(pp)])[p][t] = rank
            if hf:
                firsts.add(p)
            if hl:
                lasts.add(p)
        if len(firsts) != 1 or len(lasts) != 1:
            raise VocabConfigError(f"vocabulary parallelism: the first stage is on pipeline ranks {sorted(firsts)} and "
                                   f"the last on {sorted(lasts)}; expected one each")
        grids = [replicas[k] for k in sorted(replicas)]
        return cls.build(grids, first_pp=firsts.pop(), last_pp=lasts.pop(), comms=comms)
