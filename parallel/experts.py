"""Expert parallel's step: each mixture-of-experts layer keeps num_moe_experts / EP experts on a
rank, and its rows travel to their experts' ranks and back by all-to-all (Megatron's alltoall
token dispatcher, dropless).

The model's Experts module sorts its (token, expert) rows by expert and hands them to its
`dispatch` hook with each expert's row count (trainer.model.moe). Here that hook is an
AllToAllDispatch: the counts go to every EP rank first (one small all-to-all: each rank learns
how many rows it will receive for each of its experts), then the rows (a variable all-to-all in
the compute dtype), the rank runs its experts over what it received as one grouped GEMM per
projection, and the results go back the same way. Received rows arrive by source rank, each
source's sorted by expert; they are regrouped by expert for the GEMM and put back after. The
combine (each row times its router weight, summed into its token) stays with the model, on the
rank that owns the token. Under selective recompute the dispatch is not repeated (only the
activation is); full recompute replays the block, its two all-to-alls included.

Experts split on dim 0 over expert_model_parallel; their gradients are summed over
expert_data_parallel by the optimizer (trainer.train.optim: the experts' own flat buffer).
With EP = 1 the step still marks the experts as such (their buffer is sharded over expert DP).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from parallel.build import Build
from parallel.comm import Group


class AllToAllDispatch:
    """The `dispatch` hook of one Experts module of this rank: which experts it holds
    (first, count) of how many, over which group."""

    def __init__(self, group: Group, num_experts: int):
        self.group, self.num_experts = group, num_experts
        self.local = num_experts // group.size
        self.first = group.rank * self.local

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, run: Callable) -> torch.Tensor:
        """rows sorted by expert, counts [num_experts] -> the rows through their experts."""
        ep, local = self.group.size, self.local
        if ep == 1:
            return run(rows, counts)
        sent = counts.view(ep, local)
        received = self.group.all_to_all(sent)  # [source, my expert]: rows coming to me
        send, receive = sent.sum(1).tolist(), received.sum(1).tolist()
        arrived = _AllToAll.apply(rows, self.group, send, receive)
        # Arrived by source, each source's by expert: regroup by expert (stable).
        expert = torch.arange(local, device=rows.device).repeat(ep)
        order = expert.repeat_interleave(received.reshape(-1)).argsort(stable=True)
        done = run(arrived[order], received.sum(0))
        back = torch.empty_like(order).scatter_(0, order, torch.arange(
            len(order), device=order.device))  # the inverse permutation
        return _AllToAll.apply(done[back], self.group, receive, send)


class _AllToAll(torch.autograd.Function):
    """Rows to the group's ranks (send[i] to rank i), with the reverse exchange in backward."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, group: Group, send: list[int], receive: list[int]
                ) -> torch.Tensor:
        ctx.group, ctx.send, ctx.receive = group, send, receive
        return group.all_to_all_rows(rows, send, receive)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.group.all_to_all_rows(grad, ctx.receive, ctx.send), None, None, None


def expert_modules(model: nn.Module, suffixes: tuple[str, ...]) -> dict[str, nn.Module]:
    """The modules the plan names as experts (module-name suffixes), by name."""
    return {name: module for name, module in model.named_modules()
            if any(name == s or name.endswith("." + s) for s in suffixes)}


def shard_experts(build: Build) -> None:
    """On the meta device: each expert module keeps its EP rank's experts (dim 0 of its 3-D
    parameters) and dispatches by all-to-all over expert_model_parallel."""
    group = build.groups.expert_model_parallel
    for name, module in expert_modules(build.model, build.plan.experts).items():
        params = dict(module.named_parameters(recurse=False))
        total = next(iter(params.values())).shape[0]
        if total % group.size:
            raise ValueError(f"{name}: {total} experts do not split over "
                             f"parallel.expert_model_parallel_size={group.size}")
        for pname, param in params.items():
            local = torch.empty((total // group.size, *param.shape[1:]), dtype=param.dtype,
                                device=param.device)
            setattr(module, pname, nn.Parameter(local))
        module.dispatch = AllToAllDispatch(group, total)
