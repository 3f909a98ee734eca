"""Expert parallel's step: each mixture-of-experts layer keeps num_moe_experts / EP experts on a
rank, and its rows travel to their experts' ranks and back (Megatron's token dispatchers,
dropless; model.moe_token_dispatcher_type).

The model's Experts module sorts its (token, expert) rows by expert and hands them to its
`dispatch` hook with each expert's row count (trainer.model.moe). Here that hook is an
ExpertDispatch. AllToAllDispatch (alltoall, the default): the counts go to every EP rank
first (one small all-to-all: each rank learns how many rows it will receive for each of its
experts), then the rows (a variable all-to-all in
the compute dtype), the rank runs its experts over what it received as one grouped GEMM per
projection, and the results go back the same way. Received rows arrive by source rank, each
source's sorted by expert; they are regrouped by expert for the GEMM and put back after. The
combine (each row times its router weight, summed into its token) stays with the model, on the
rank that owns the token. AllGatherDispatch (allgather) gathers every rank's rows instead and
reduce-scatters the answers back: the same rows through the same experts in the same order, so
both compute the same. Under selective recompute the dispatch is not repeated (only the
activation is); full recompute replays the block, its exchanges included.

Experts split on dim 0 over expert_model_parallel; their gradients are summed over
expert_data_parallel by the optimizer (trainer.train.optim: the experts' own flat buffer).
With EP = 1 the step still marks the experts as such (their buffer is sharded over expert DP).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch
from torch import nn

from parallel.build import Build
from parallel.comm import Group
from parallel.regions import all_to_all_rows, gather_along, scatter_along


class ExpertDispatch(ABC):
    """The `dispatch` hook of one Experts module of this rank: which experts it holds (from
    `first`, `local` of them) of how many, over which group; `exchange` is how the rows
    travel (DISPATCHERS, model.moe_token_dispatcher_type)."""

    def __init__(self, group: Group, num_experts: int):
        self.group, self.num_experts = group, num_experts
        self.local = num_experts // group.size
        self.first = group.rank * self.local

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, run: Callable) -> torch.Tensor:
        """rows sorted by expert, counts [num_experts] -> the rows through their experts."""
        if self.group.size == 1:
            return run(rows, counts)
        return self.exchange(rows, counts, run)

    @abstractmethod
    def exchange(self, rows: torch.Tensor, counts: torch.Tensor, run: Callable) -> torch.Tensor:
        """The rows to their experts' ranks, through `run` there, and back (EP > 1)."""


class AllToAllDispatch(ExpertDispatch):
    """Megatron's alltoall dispatcher: each row to its expert's rank and back."""

    def exchange(self, rows: torch.Tensor, counts: torch.Tensor, run: Callable) -> torch.Tensor:
        ep, local = self.group.size, self.local
        sent = counts.view(ep, local)
        received = self.group.all_to_all(sent)  # [source, my expert]: rows coming to me
        send, receive = sent.sum(1).tolist(), received.sum(1).tolist()
        arrived = all_to_all_rows(rows, self.group, send, receive)
        # Arrived by source, each source's by expert: regroup by expert (stable).
        expert = torch.arange(local, device=rows.device).repeat(ep)
        order = expert.repeat_interleave(received.reshape(-1)).argsort(stable=True)
        done = run(arrived[order], received.sum(0))
        return all_to_all_rows(done[_inverse(order)], self.group, receive, send)


class AllGatherDispatch(ExpertDispatch):
    """Megatron's allgather dispatcher: every rank's rows (padded to the most any rank has)
    gathered to every rank, each rank's experts run over theirs, and the results, zero where
    another rank's experts answer, reduce-scattered back to the rows' ranks. More bytes than
    alltoall (EP x the rows, twice) in collectives of one size."""

    def exchange(self, rows: torch.Tensor, counts: torch.Tensor, run: Callable) -> torch.Tensor:
        ep, local, first = self.group.size, self.local, self.first
        everyone = self.group.all_gather(counts.view(1, -1))  # [source, expert]
        most = int(everyone.sum(1).max())
        padded = torch.cat([rows, rows.new_zeros(most - rows.shape[0], rows.shape[1])])
        gathered = gather_along(padded, self.group, 0)  # [source x most, h]
        # My experts' rows, by expert then source (as alltoall's regrouping orders them).
        mine = everyone[:, first:first + local]  # [source, my expert]
        starts = everyone.cumsum(1)[:, first:first + local] - mine
        base = (torch.arange(ep, device=rows.device)[:, None] * most + starts).T.reshape(-1)
        sizes = mine.T.reshape(-1)
        index = base.repeat_interleave(sizes) + _ranges(sizes)
        done = run(gathered[index], mine.sum(0))
        answers = done.new_zeros(ep * most, done.shape[1]).index_add(0, index, done)
        return scatter_along(answers, self.group, 0)[:rows.shape[0]]


DISPATCHERS = {"alltoall": AllToAllDispatch, "allgather": AllGatherDispatch}


def _inverse(order: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(order).scatter_(0, order, torch.arange(len(order),
                                                                   device=order.device))


def _ranges(sizes: torch.Tensor) -> torch.Tensor:
    """0..n-1 for each n of sizes, concatenated."""
    starts = sizes.cumsum(0) - sizes
    return torch.arange(int(sizes.sum()), device=sizes.device) - starts.repeat_interleave(sizes)


def expert_modules(model: nn.Module, suffixes: tuple[str, ...]) -> dict[str, nn.Module]:
    """The modules the plan names as experts (module-name suffixes), by name."""
    return {name: module for name, module in model.named_modules()
            if any(name == s or name.endswith("." + s) for s in suffixes)}


def shard_experts(build: Build) -> None:
    """On the meta device: each expert module keeps its EP rank's experts (dim 0 of its 3-D
    parameters) and dispatches over expert_model_parallel (EP dividing the experts is checked
    with the model's rules: trainer.plan.axes.expert)."""
    dispatcher = DISPATCHERS[build.options.moe_token_dispatcher_type]
    for module in expert_modules(build.model, build.plan.experts).values():
        params = dict(module.named_parameters(recurse=False))
        module.dispatch = dispatcher(build.groups.expert_model_parallel,
                                     next(iter(params.values())).shape[0])
        for pname, param in params.items():
            local = torch.empty((module.dispatch.local, *param.shape[1:]), dtype=param.dtype,
                                device=param.device)
            setattr(module, pname, nn.Parameter(local))
