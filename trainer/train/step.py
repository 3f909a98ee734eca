"""One training step: micro-batches forward and backward, gradient sync, clipped AdamW update.

The loss of the step is the sum of per-token losses over the whole global batch divided by its
number of loss tokens, so every layout trains the same model as one process: each rank divides
its own sum by the global count before backward, and gradients are then summed (never averaged)
over the ranks that saw different tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from parallel.parallelize import ParallelModel
from trainer.data.batch import MicroBatch
from trainer.train.optim import ShardedAdamW

IGNORE = -100  # label of a position that carries no loss


class NonFiniteStep(Exception):
    """The global loss or gradient norm is not finite; the update was not applied (Megatron's
    check_for_nan_in_loss_and_grad)."""

    def __init__(self, loss: float, grad_norm: float):
        super().__init__(f"loss {loss}, gradient norm {grad_norm}")
        self.loss, self.grad_norm = loss, grad_norm


@dataclass
class StepResult:
    loss: float  # mean per-token loss of the global batch
    grad_norm: float  # before clipping
    loss_tokens: int


def train_step(model: ParallelModel, optimizer: ShardedAdamW, micro_batches: list[MicroBatch],
               lr: float) -> StepResult:
    groups, device = model.groups, next(model.parameters()).device
    # Counted over token_distinct: TP ranks (and pipeline stages) share their tokens.
    local = sum(int((mb.labels != IGNORE).sum()) for mb in micro_batches)
    count = torch.tensor(float(local), dtype=torch.float64, device=device)
    total_tokens = int(groups.token_distinct.all_reduce(count).item())
    if total_tokens == 0:
        raise ValueError("the global batch has no loss tokens (every label is ignored)")
    optimizer.zero_grad()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for mb in micro_batches:
        summed = _loss_sum(model, mb)
        (summed / total_tokens).backward()
        loss_sum += summed.detach().double()
    model.finish_grad_reduce()  # reduce-scatters still overlapping the last backward
    model.reduce_replicated_grads()
    # Both are global values, so every rank refuses a non-finite step together.
    loss = groups.token_distinct.all_reduce(loss_sum).item() / total_tokens
    grad_norm = optimizer.reduce_gradients()
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise NonFiniteStep(loss, grad_norm)
    optimizer.update(lr, grad_norm)
    return StepResult(loss=loss, grad_norm=grad_norm, loss_tokens=total_tokens)


@torch.no_grad()
def evaluate(model: ParallelModel, micro_batches: list[MicroBatch]) -> float:
    """Mean per-token loss over every rank's micro-batches (the whole evaluation batch)."""
    device = next(model.parameters()).device
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, loss tokens
    for mb in micro_batches:
        sums[0] += _loss_sum(model, mb).double()
        sums[1] += int((mb.labels != IGNORE).sum())
    total, tokens = model.groups.token_distinct.all_reduce(sums).tolist()
    return total / tokens


def _loss_sum(model: ParallelModel, mb: MicroBatch) -> torch.Tensor:
    losses = model.token_losses(model(mb.tokens, mb.positions), mb.labels)
    return losses.masked_fill(mb.labels == IGNORE, 0.0).sum()
