"""A mixture of experts' routers as a step sees them (trainer/model/moe.py): joined to the ranks
that hold other tokens of each micro-batch, weighted in the step's loss, and read after it:
the balance losses, how evenly the experts were used, and the expert bias moved towards equal
counts (DeepSeek-V3's auxiliary-loss-free balancing).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from parallel.comm import Group
from parallel.groups import Groups
from trainer.model.moe import Router


def routers(model: nn.Module) -> list[tuple[str, Router]]:
    """The model's routers by block, in forward order (none in a dense model)."""
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, Router)]


def token_groups(groups: Groups, sequence_parallel: bool) -> tuple[Group, ...]:
    """The groups whose product is every rank holding other tokens of a micro-batch: the
    loss's (token_distinct), and TP with sequence parallel (each TP rank routes its own part
    of the sequence; without SP a mixture of experts under TP is refused at compose)."""
    return (groups.token_distinct, groups.tp) if sequence_parallel else (groups.token_distinct,)


def sum_over(over: tuple[Group, ...]):
    """An all-reduce over the product of groups of different axes, one group after another
    (one of a single rank is nothing to do, and left out: compiled, each call of a collective
    ends a graph, even one that returns at once)."""
    over = tuple(group for group in over if group.size > 1)

    def total(tensor: torch.Tensor) -> torch.Tensor:
        for group in over:
            tensor = group.all_reduce(tensor)
        return tensor
    return total


def wire(model: nn.Module, groups: Groups, sequence_parallel: bool = False) -> None:
    """Each router's sums over ranks: token counts over every rank that sees other tokens of
    the micro-batch (token_groups), a sequence's over the ranks that split it (context, and TP
    with sequence parallel)."""
    sequence = (groups.context, groups.tp) if sequence_parallel else (groups.context,)
    for _, router in routers(model):
        router.token_sum = sum_over(token_groups(groups, sequence_parallel))
        router.sequence_sum = sum_over(sequence)


def begin(model: nn.Module, micro_batches: int) -> None:
    """Before a step's micro-batches: the balance losses of each count 1/micro_batches of the
    step's loss (each is a mean over its micro-batch's tokens, as Megatron's are)."""
    for _, router in routers(model):
        router.loss_scale = 1.0 / micro_batches
        router.records.clear()


def finish(model: nn.Module, groups: Groups, stages: Group | None = None,
           sequence_parallel: bool = False) -> dict:
    """After a step's update: what metrics.jsonl records of the routing (empty for a dense
    model), and each expert bias moved by its update rate towards equal token counts (the
    counts are the whole step's, so every rank moves it alike). stages: the pipeline group of
    a mixture of experts (every stage calls, one without routers too; None: no stages)."""
    found = routers(model)
    if not found and stages is None:
        return {}
    losses, imbalance, dropped, pairs = [], {}, 0.0, 0.0
    for name, router in found:
        counts = torch.stack([r.counts for r in router.records]).sum(0)
        losses.append(sum(float(r.loss) for r in router.records) * router.loss_scale)
        dropped += sum(float(r.dropped) for r in router.records)  # the micro-batches' (global)
        pairs += float(counts.sum())
        block = _block(name) if router.block is None else router.block
        imbalance[block] = float(counts.max() / counts.mean())
        if router.expert_bias is not None:
            step = torch.sign(counts.mean() - counts) * router.bias_update_rate
            router.expert_bias.add_(step.to(router.expert_bias.dtype))
        router.records.clear()
    # Each rank holds its part of each balance loss: their sum is the loss.
    device = next(model.parameters()).device
    total = sum_over(token_groups(groups, sequence_parallel))(
        torch.tensor([sum(losses)], dtype=torch.float64, device=device))
    total = torch.cat([total, total.new_tensor([dropped, pairs])])  # those two are global
    if stages is not None and stages.size > 1:
        total, imbalance = _over_stages(stages, total, imbalance)
    # moe_dropped: the share of (token, expert) pairs beyond their expert's capacity
    # (model.moe_expert_capacity_factor; 0 when dropless)
    return {"moe_aux_loss": float(total[0]),
            "moe_imbalance": round(max(imbalance.values()), 4),
            "moe_imbalance_per_layer": {b: round(v, 4) for b, v in sorted(imbalance.items())},
            "moe_dropped": round(float(total[1] / total[2]), 6)}


def _block(name: str) -> int:
    """The index of the block a router is in ("layers.3.mlp.router"; 0 for a lone block)."""
    return next((int(part) for part in name.split(".") if part.isdigit()), 0)


def _over_stages(stages: Group, total: torch.Tensor, imbalance: dict[int, float]
                 ) -> tuple[torch.Tensor, dict[int, float]]:
    """Every stage's blocks into one: the loss and the dropped and routed pairs summed, the
    imbalance of each block (each is on one stage; a dense block's stays 0, an expert layer's
    is 1 or more)."""
    ends = total.new_tensor([max(imbalance, default=-1) + 1])
    blocks = int(stages.all_reduce(ends, op=dist.ReduceOp.MAX).item())
    packed = total.new_zeros(blocks + 3)
    packed[:3] = total
    for block, value in imbalance.items():
        packed[block + 3] = value
    stages.all_reduce(packed)
    return packed[:3], {b: float(v) for b, v in enumerate(packed[3:].tolist()) if v}
