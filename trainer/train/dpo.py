"""train.objective=dpo: Direct Preference Optimization on packed preference pairs, exact under
every layout.

A pair is two documents of one sample (trainer.data.preference): documents 2j and 2j + 1 of
the sample, the chosen and the rejected response after the same prompt. Its log-probability
under a model is the sum of its counted tokens' log-probabilities. With s = beta ((c - c_ref) -
(r - r_ref)) (IPO: each difference divided by its response's token count, as TRL does), the
step's loss is the mean over the global batch's pairs of
    sigmoid: -(1 - eps) log sigmoid(s) - eps log sigmoid(-s)   (eps: dpo.label_smoothing)
    ipo:     (s / beta - 1 / (2 beta))^2
The reference log-probabilities come from a pass without gradients before the step's own: the
model with its adapters off (peft=lora), or a frozen copy of the starting weights.

Under a layout a document's tokens may sit on several ranks (context parallel, sequence shards):
each rank sums its own tokens per document, and one all-reduce over the context group gives the
whole sums, the same on each. The loss is not a sum over tokens, so its gradient is formed as
one: sum over pairs of dloss/ds * (the rank's own part of s), divided by the global pair count;
the gradients then add up over the ranks as the next-token loss's do.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F

from trainer.config import DpoConfig
from trainer.train import routing
from trainer.train.batch import IGNORE, MicroBatch


@dataclass(frozen=True)
class Dpo:
    """What a DPO step needs beyond the batch: the config, and the reference: a frozen model
    (full fine-tuning), or the model itself with its adapters switched off (peft=lora)."""

    cfg: DpoConfig
    reference: object | None = None  # a ParallelModel; None: the trained one
    adapters_off: Callable[[], ContextManager] | None = None


@dataclass
class PairSums:
    """One micro-batch's pairs: the whole per-document sums of the counted tokens' values."""

    chosen: torch.Tensor  # [pairs]
    rejected: torch.Tensor


@dataclass
class DpoStep:
    """One step's pairs: their token counts and the reference's log-probabilities, then the
    policy's loss as the pipeline's last stage forms it."""

    cfg: DpoConfig
    model: object  # the ParallelModel
    micro_batches: list[MicroBatch]
    keep: list[torch.Tensor] = field(default_factory=list)  # per micro-batch: its pairs' slots
    counts: list[PairSums] = field(default_factory=list)  # counted tokens of each document
    reference: list[PairSums | None] = field(default_factory=list)
    pairs: int = 0  # of the global batch
    sums: torch.Tensor | None = None  # the loss and METRICS, summed over the pairs

    def begin(self, reference_model, inputs: list[tuple], adapters_off=None) -> None:
        """Count the pairs, then run the reference pass (`reference_model`, or the model under
        `adapters_off()`) on `inputs`, the model's forward inputs of each micro-batch (without
        gradients: the step's own). Collective over the model's groups."""
        device = self.micro_batches[0].tokens.device
        for mb in self.micro_batches:
            ones = (mb.labels != IGNORE).to(torch.float64)
            counts = self._whole(self._per_document(ones, mb))
            there_c, there_r = counts.chosen > 0, counts.rejected > 0
            if bool((there_c != there_r).any()):  # the stream packs pairs whole: never
                raise ValueError("train.objective=dpo: a sample holds half a preference pair "
                                 "(a response with no counted token). Fix: prepare the data "
                                 "with python -m trainer.prepare --preference")
            self.keep.append(there_c)
            self.counts.append(self._kept(counts, len(self.keep) - 1))
        local = sum(int(k.sum()) for k in self.keep)
        self.pairs = int(self.model.groups.batch_lane.all_reduce(
            torch.tensor(float(local), dtype=torch.float64, device=device)).item())
        if self.pairs == 0:
            raise ValueError("train.objective=dpo: the global batch holds no preference pair")
        self.reference = [None] * len(self.micro_batches)

        def last(i: int, logits: torch.Tensor) -> torch.Tensor:
            mb = self.micro_batches[i]
            logp = -reference_model.token_losses(logits, mb.labels).double()
            self.reference[i] = self._kept(self._whole(self._per_document(logp, mb)), i)
            return logits

        routing.begin(reference_model.module, len(self.micro_batches))  # its records go
        with torch.no_grad(), (adapters_off() if adapters_off else nullcontext()):
            reference_model.runner.run(inputs, last, train=False)
        self.sums = torch.zeros(len(METRICS) + 1, dtype=torch.float64, device=device)

    def loss(self, i: int, out) -> torch.Tensor:
        """The last stage's loss of micro-batch i (its backward gives the exact gradient)."""
        mb, model = self.micro_batches[i], self.model
        logits = out[0] if isinstance(out, tuple) else out
        logp = -model.token_losses(logits, mb.labels)
        own = self._kept(self._per_document(logp, mb), i)  # this rank's tokens, with the graph
        whole = self._kept(self._whole(self._per_document(logp.detach().double(), mb)), i)
        ref, counts, beta = self.reference[i], self.counts[i], self.cfg.beta
        if self.cfg.loss_type == "ipo":  # TRL's: per token of the response
            norm_c, norm_r = counts.chosen, counts.rejected
        else:
            norm_c = norm_r = torch.ones_like(counts.chosen)
        margin = ((whole.chosen - ref.chosen) / norm_c
                  - (whole.rejected - ref.rejected) / norm_r).requires_grad_()
        losses = pair_losses(margin, self.cfg)
        (slope,) = torch.autograd.grad(losses.sum(), margin)
        if model.groups.context.rank == 0:  # each pair once over the context group
            rewards_c = beta * (whole.chosen - ref.chosen)
            rewards_r = beta * (whole.rejected - ref.rejected)
            self.sums += torch.stack([
                losses.detach().sum(), rewards_c.sum(), rewards_r.sum(),
                (rewards_c - rewards_r).sum(), (rewards_c > rewards_r).double().sum(),
                whole.chosen.sum(), whole.rejected.sum()])
        surrogate = (slope / norm_c).to(logp.dtype) @ own.chosen \
            - (slope / norm_r).to(logp.dtype) @ own.rejected
        return surrogate / self.pairs

    def metrics(self, sums: torch.Tensor) -> tuple[float, dict[str, float]]:
        """(the step's loss, TRL's logged values): means over the global batch's pairs."""
        means = (sums / self.pairs).tolist()
        return means[0], dict(zip(METRICS, means[1:]))

    def _per_document(self, values: torch.Tensor, mb: MicroBatch) -> PairSums:
        """This rank's sums of `values` over each document's counted tokens, as pairs: every
        slot of every sample of the micro-batch ([rows x slots / 2] each, most of them 0)."""
        if mb.document_index is None:
            raise ValueError("train.objective=dpo needs data.reset_attention_mask=true (a "
                             "pair's documents apart)")
        rows, seq = values.shape[0], mb.documents.shape[1]
        slots = seq + 2 - seq % 2  # documents a sample may hold, rounded up to pairs
        counted = mb.labels != IGNORE
        key = torch.arange(rows, device=values.device)[:, None] * slots + mb.document_index
        total = values.new_zeros(rows * slots).index_add(0, key[counted], values[counted])
        per_pair = total.view(rows * slots // 2, 2)
        return PairSums(per_pair[:, 0], per_pair[:, 1])

    def _whole(self, own: PairSums) -> PairSums:
        """The sums over the context group's tokens (the same on each of its ranks)."""
        both = torch.stack([own.chosen, own.rejected])
        self.model.groups.context.all_reduce(both)
        return PairSums(both[0], both[1])

    def _kept(self, sums: PairSums, i: int) -> PairSums:
        return PairSums(sums.chosen[self.keep[i]], sums.rejected[self.keep[i]])


METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
           "logps/chosen", "logps/rejected")


def pair_losses(margin: torch.Tensor, cfg: DpoConfig) -> torch.Tensor:
    """Each pair's loss from its margin (c - c_ref) - (r - r_ref) (IPO's length-normalised)."""
    if cfg.loss_type == "ipo":
        return (margin - 1 / (2 * cfg.beta)) ** 2
    eps = cfg.label_smoothing
    return -(1 - eps) * F.logsigmoid(cfg.beta * margin) - eps * F.logsigmoid(-cfg.beta * margin)

