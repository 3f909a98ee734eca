"""One training step: micro-batches forward and backward, gradient sync, clipped AdamW update.

The loss of the step is the sum of per-token losses over the whole global batch divided by its
number of loss tokens, so every layout trains the same model as one process: each rank divides
its own sum by the global count before backward, and gradients are then summed (never averaged)
over the ranks that saw different tokens. The micro-batches run in the pipeline schedule's
order (parallel.pipeline.runner); only the last stage computes the loss, and it is shared from
there, so every rank reports, and refuses, the same step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from parallel.parallelize import ParallelModel
from trainer.train import routing
from trainer.train.batch import IGNORE, MicroBatch
from trainer.train.dpo import Dpo, DpoStep
from trainer.train.optim import ShardedOptimizer


class NonFiniteStep(Exception):
    """The global loss or gradient norm is not finite; the update was not applied (Megatron's
    check_for_nan_in_loss_and_grad)."""

    def __init__(self, loss: float, grad_norm: float):
        super().__init__(f"loss {loss}, gradient norm {grad_norm}")
        self.loss, self.grad_norm = loss, grad_norm


@dataclass
class StepResult:
    loss: float  # mean per-token loss of the global batch (a mixture of experts' balance
    # losses, which the gradient includes, are moe["moe_aux_loss"])
    grad_norm: float  # before clipping
    loss_tokens: int
    empty_samples: int = 0  # samples of the global batch with no counted token (a loss mask)
    moe: dict = field(default_factory=dict)  # trainer.train.routing.finish (dense: empty)
    # multi-token prediction: each depth's mean per-token loss over its own label tokens
    mtp_losses: list[float] = field(default_factory=list)
    # QK-clip's largest attention logit of the step, before clipping (None: QK-clip off)
    max_attention_logit: float | None = None
    # train.objective=dpo: the pairs' rewards, margins and accuracies (TRL's names); loss is
    # then the mean DPO loss of the global batch's pairs
    dpo: dict = field(default_factory=dict)


def train_step(model: ParallelModel, optimizer: ShardedOptimizer, micro_batches: list[MicroBatch],
               lr: float, mark: Callable[[str], None] | None = None,
               weight_decay: float | None = None, dpo: Dpo | None = None) -> StepResult:
    """mark: told "micro_batches" and then "update" as each part of the step begins (the
    measured dry run counts what each allocates). weight_decay: this step's (Megatron's
    schedule); None keeps optim.weight_decay. dpo: train.objective=dpo (trainer.train.dpo)."""
    mark = mark or (lambda phase: None)
    groups, device = model.groups, next(model.parameters()).device
    # Counted over token_distinct: TP ranks (and pipeline stages) share their tokens.
    # With them, the samples that count no token (each counted by one rank).
    # Multi-token prediction's depths count their own label tokens, as the main loss does.
    depths = 0 if micro_batches[0].ahead_labels is None else len(micro_batches[0].ahead_labels)
    local = [sum(int((mb.labels != IGNORE).sum()) for mb in micro_batches),
             sum(mb.empty_samples for mb in micro_batches),
             *(sum(int((mb.ahead_labels[d] != IGNORE).sum()) for mb in micro_batches)
               for d in range(depths))]
    counts = groups.token_distinct.all_reduce(
        torch.tensor(local, dtype=torch.float64, device=device)).tolist()
    total_tokens, empty_samples, depth_tokens = int(counts[0]), int(counts[1]), counts[2:]
    if total_tokens == 0:
        raise ValueError("the global batch has no loss tokens (every label is ignored)")
    mark("micro_batches")
    pairs = None
    if dpo is not None:  # the reference pass, before the step's own
        pairs = DpoStep(dpo.cfg, model, micro_batches)
        pairs.begin(dpo.reference or model, _inputs(micro_batches, train=False),
                    dpo.adapters_off)
    optimizer.zero_grad()
    sums = torch.zeros(1 + depths, dtype=torch.float64, device=device)  # main, each depth
    routing.begin(model.module, len(micro_batches))

    def last_stage(i: int, out: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
        mb = micro_batches[i]
        logits, *ahead = out if isinstance(out, tuple) else (out,)
        summed = _masked_sum(model.token_losses(logits, mb.labels), mb.labels)
        sums[0] += summed.detach().double()
        loss = summed / total_tokens
        # Megatron's MTP loss: mtp_loss_scaling_factor / D times each depth's mean
        for d, depth_logits in enumerate(ahead):
            depth = _masked_sum(model.token_losses(depth_logits, mb.ahead_labels[d]),
                                mb.ahead_labels[d])
            sums[1 + d] += depth.detach().double()
            loss = loss + model.module.mtp.loss_scale * depth / max(depth_tokens[d], 1.0)
        return loss

    model.runner.run(_inputs(micro_batches), pairs.loss if pairs else last_stage)
    model.finish_grads()  # sharded, replicated, then tied embeddings' (ParallelModel)
    # Both are global values, so every rank refuses a non-finite step together.
    sums = _from_last_stage(model, sums)
    loss, rewards = sums[0].item() / total_tokens, {}
    if pairs is not None:
        loss, rewards = pairs.metrics(_from_last_stage(model, pairs.sums))
    mtp_losses = [sums[1 + d].item() / max(depth_tokens[d], 1.0) for d in range(depths)]
    mark("update")
    grad_norm = optimizer.reduce_gradients()
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise NonFiniteStep(loss, grad_norm)
    optimizer.update(lr, grad_norm, weight_decay)
    model.sync_stage_copies()
    return StepResult(loss=loss, grad_norm=grad_norm, loss_tokens=total_tokens,
                      empty_samples=empty_samples, moe=routing.finish(model.module, groups,
                                         groups.pp if model.mixture else None,
                                         model.sequence_parallel), mtp_losses=mtp_losses,
                      max_attention_logit=optimizer.max_attention_logit, dpo=rewards)


@torch.no_grad()
def evaluate(model: ParallelModel, micro_batches: list[MicroBatch]) -> float:
    """Mean per-token loss over every rank's micro-batches (the whole evaluation batch)."""
    device = next(model.parameters()).device
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    tokens = torch.tensor(float(sum(int((mb.labels != IGNORE).sum()) for mb in micro_batches)),
                          dtype=torch.float64, device=device)

    def last_stage(i: int, logits: torch.Tensor) -> torch.Tensor:
        labels = micro_batches[i].labels
        loss_sum.add_(_masked_sum(model.token_losses(logits, labels), labels).double())
        return logits

    model.runner.run(_inputs(micro_batches, train=False), last_stage, train=False)
    total = _from_last_stage(model, loss_sum).item()
    return total / model.groups.token_distinct.all_reduce(tokens).item()


def _inputs(micro_batches: list[MicroBatch], train: bool = True) -> list[tuple]:
    """What the model's forward takes of each micro-batch: with multi-token prediction's ids
    when training (evaluation counts the main loss only)."""
    return [(mb.tokens, mb.positions, mb.documents,
             *((mb.ahead,) if train and mb.ahead is not None else ())) for mb in micro_batches]


def _masked_sum(losses: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return losses.masked_fill(labels == IGNORE, 0.0).sum()


def _from_last_stage(model: ParallelModel, value: torch.Tensor) -> torch.Tensor:
    """A loss sum over the global batch, on every rank: summed over the ranks that saw other
    tokens, then sent from the stage that runs the model's last chunk (the others hold 0) to
    every stage."""
    model.groups.token_distinct.all_reduce(value)
    return model.groups.pp.broadcast(value, root=model.runner.last_stage)
