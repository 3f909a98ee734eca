"""Expert parallel's step: each mixture-of-experts layer keeps num_moe_experts / EP experts on a
rank, and its rows travel to their experts' ranks and back (Megatron's token dispatchers;
model.moe_token_dispatcher_type).

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

Experts split on dim 0 over expert_model_parallel, and each over expert_tensor_parallel as
the model's plan says (ParallelPlan.expert_splits: ExpertWeight); under ETP every ETP peer's
rows pass through this rank's slice and the partial outputs are summed on each row's rank
(ExpertDispatch._across_split). Their gradients are summed over expert_data_parallel by the
optimizer (trainer.train.optim: the experts' own flat buffer). With EP = ETP = 1 the step still
marks the experts as such (their buffer is sharded over expert DP).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from parallel.build import Build
from parallel.comm import Group
from parallel.regions import all_to_all_rows, gather_along, scatter_along


@dataclass(frozen=True)
class ExpertWeight:
    """One 3-D parameter of an expert module ([experts, out, in]) as the single device holds
    it, and the dim ETP splits: 1 (out, a column split: each fused part, e.g. gate|up, split
    alike), 2 (in, a row split: the partial outputs are summed over ETP) or None (whole on
    every ETP rank: a LoRA factor, whose gradient each ETP rank forms a part of)."""

    shape: tuple[int, ...]
    dim: int | None
    parts: tuple[int, ...] = (1,)  # fused parts' relative sizes along dim

    @property
    def whole(self) -> bool:
        return self.dim is None


class ExpertDispatch(ABC):
    """The `dispatch` hook of one Experts module of this rank: which experts it holds (from
    `first`, `local` of them) of how many, over which group (EP); `split` (ETP) splits each
    of them; `exchange` is how the rows travel (DISPATCHERS, model.moe_token_dispatcher_type).
    It also knows where this rank's slice of each weight sits in the single-device weight."""

    def __init__(self, group: Group, split: Group, weights: dict[str, ExpertWeight]):
        self.group, self.split, self.weights = group, split, weights
        self.num_experts = next(iter(weights.values())).shape[0]
        self.local = self.num_experts // group.size
        self.first = group.rank * self.local

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, run: Callable) -> torch.Tensor:
        """rows sorted by expert, counts [num_experts] -> the rows through their experts."""
        if self.split.size > 1:
            run = self._across_split(run)
        if self.group.size == 1:
            return run(rows, counts)
        return self.exchange(rows, counts, run)

    @abstractmethod
    def exchange(self, rows: torch.Tensor, counts: torch.Tensor, run: Callable) -> torch.Tensor:
        """The rows to their experts' ranks, through `run` there, and back (EP > 1)."""

    def _across_split(self, run: Callable) -> Callable:
        """ETP (Megatron's all-gather and reduce-scatter over the expert tensor group): every
        ETP peer's rows (each sorted by expert) go through this rank's slice of the experts,
        regrouped by expert for the grouped GEMM, and each row's partial outputs come back to
        its own rank and are summed there. Sending each peer the same rows is the all-gather
        (variable sizes); the autograd of the exchange and the repeat sums their gradients."""
        split = self.split

        def across(rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            everyone = split.all_gather(counts.view(1, -1))  # [peer, my expert]
            n, sizes, k = rows.shape[0], everyone.sum(1).tolist(), split.size
            order = _by_expert(everyone)
            # Each name rebound as soon as the next tensor exists: a row-sized buffer is
            # freed once used, so no more than two are alive beside what autograd keeps.
            rows = all_to_all_rows(rows.repeat(k, 1), split, [n] * k, sizes)[order]
            rows = run(rows, everyone.sum(0))[_inverse(order)]
            rows = all_to_all_rows(rows, split, sizes, [n] * k)
            return rows.view(k, n, rows.shape[-1]).sum(0)  # n may be 0: no row routed here
        return across

    def local_shape(self, name: str) -> tuple[int, ...]:
        weight = self.weights[name]
        shape = [self.local, *weight.shape[1:]]
        if not weight.whole:
            shape[weight.dim] //= self.split.size
        return tuple(shape)

    def chunks(self, name: str, local: torch.Tensor
               ) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        """Where `local` (this rank's slice of weight `name`, or a tensor of its shape) sits
        in the single-device weight: (offsets, view) pairs, one per fused part."""
        weight, etp = self.weights[name], self.split
        if weight.whole:
            return [((self.first,) + (0,) * (local.ndim - 1), local)]
        full = weight.shape[weight.dim]
        sizes = [full * p // sum(weight.parts) for p in weight.parts]
        out, start = [], 0
        for size, piece in zip(sizes, local.split([s // etp.size for s in sizes], weight.dim)):
            offsets = [self.first] + [0] * (local.ndim - 1)
            offsets[weight.dim] = start + etp.rank * piece.shape[weight.dim]
            out.append((tuple(offsets), piece))
            start += size
        return out

    def full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The single-device weight (collective over ETP and EP): each element is on one
        rank of the two groups, so a sum of each rank's slice in place assembles it."""
        whole = local.new_zeros(self.weights[name].shape)
        for offsets, view in self.chunks(name, local):
            whole[tuple(slice(o, o + n) for o, n in zip(offsets, view.shape))] = view
        if not self.weights[name].whole:
            whole = self.split.all_reduce(whole)
        return self.group.all_reduce(whole)


class AllToAllDispatch(ExpertDispatch):
    """Megatron's alltoall dispatcher: each row to its expert's rank and back."""

    def exchange(self, rows: torch.Tensor, counts: torch.Tensor, run: Callable) -> torch.Tensor:
        ep, local = self.group.size, self.local
        sent = counts.view(ep, local)
        received = self.group.all_to_all(sent)  # [source, my expert]: rows coming to me
        send, receive = sent.sum(1).tolist(), received.sum(1).tolist()
        # Arrived by source, each source's by expert: regroup by expert (stable). Each
        # row-sized buffer is let go once the next exists (as in _across_split).
        order = _by_expert(received)
        arrived = all_to_all_rows(rows, self.group, send, receive)[order]
        done = run(arrived, received.sum(0))[_inverse(order)]
        del arrived  # autograd keeps what it needs of it
        return all_to_all_rows(done, self.group, receive, send)


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


def _by_expert(counts: torch.Tensor) -> torch.Tensor:
    """Rows that arrived by source, each source's sorted by expert (counts [source, expert]):
    the stable order that groups them by expert."""
    sources, experts = counts.shape
    expert = torch.arange(experts, device=counts.device).repeat(sources)
    return expert.repeat_interleave(counts.reshape(-1)).argsort(stable=True)


def _inverse(order: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(order).scatter_(0, order, torch.arange(len(order),
                                                                   device=order.device))


def _ranges(sizes: torch.Tensor) -> torch.Tensor:
    """0..n-1 for each n of sizes, concatenated."""
    starts = sizes.cumsum(0) - sizes
    return torch.arange(int(sizes.sum()), device=sizes.device) - starts.repeat_interleave(sizes)


class _ColumnsOfRank:
    """A row-split projection's bias as this ETP rank adds it ([experts, out / ETP, 1] ->
    [experts, out, 1]): its slice at its columns, zeros elsewhere, so the partial outputs'
    sum over ETP adds each entry once and each slice's gradient is its columns' (a class, not
    a closure: compiled blocks guard on it cheaply)."""

    def __init__(self, split: Group):
        self.split = split

    def __call__(self, bias: torch.Tensor) -> torch.Tensor:
        width, rank = bias.shape[1], self.split.rank
        return torch.nn.functional.pad(bias, (0, 0, rank * width,
                                              (self.split.size - 1 - rank) * width))


def expert_modules(model: nn.Module, suffixes: tuple[str, ...]) -> dict[str, nn.Module]:
    """The modules the plan names as experts (module-name suffixes), by name."""
    return {name: module for name, module in model.named_modules()
            if any(name == s or name.endswith("." + s) for s in suffixes)}


def shard_experts(build: Build) -> None:
    """On the meta device: each expert module keeps its EP rank's experts (dim 0 of its 3-D
    parameters), each split over ETP as the model's plan says (plan.expert_splits), and
    dispatches over expert_model_parallel (EP and ETP dividing the experts and their FFN are
    checked with the model's rules: trainer.plan.axis_costs.expert)."""
    dispatcher = DISPATCHERS[build.options.moe_token_dispatcher_type]
    groups = build.groups
    for module in expert_modules(build.model, build.plan.experts).values():
        # its weights and, under peft=lora, its adapters' factors (submodules' parameters)
        params = dict(module.named_parameters())
        weights = {name: ExpertWeight(tuple(param.shape), *build.plan.expert_splits[name])
                   for name, param in params.items()}
        module.dispatch = dispatcher(groups.expert_model_parallel,
                                     groups.expert_tensor_parallel, weights)
        if groups.expert_tensor_parallel.size > 1 and hasattr(module, "row_bias_fn"):
            module.row_bias_fn = _ColumnsOfRank(groups.expert_tensor_parallel)
        for pname, param in params.items():
            local = torch.empty(module.dispatch.local_shape(pname), dtype=param.dtype,
                                device=param.device)
            owner, _, leaf = pname.rpartition(".")
            setattr(module.get_submodule(owner), leaf,
                    nn.Parameter(local, requires_grad=param.requires_grad))
