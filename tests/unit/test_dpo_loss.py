"""train.objective=dpo's loss against TRL's own code (trl 1.16, offline): DPOTrainer's
_compute_loss, run on a stand-in trainer and model that hand it given per-token
log-probabilities, gives the loss and the rewards our pair_losses and metrics give from the same
sums.

TRL 1.16's sigmoid loss has no label smoothing (its earlier sigmoid, conservative DPO, had it:
-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)); with label smoothing the oracle is
that formula written here, and TRL's "robust" loss is not ours.
"""
from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from trl.trainer.dpo_trainer import DPOTrainer

from trainer.config import DpoConfig
from trainer.train.dpo import pair_losses

PAIRS, LENGTH = 5, 12


def _trl(loss_type: str, beta: float, logps: torch.Tensor, ref: torch.Tensor,
         mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """TRL's loss and logged metrics for a batch [chosen..., rejected...] whose completion
    tokens have per-token log-probabilities `logps` (the reference's summed: `ref`)."""
    seq = logps.shape[1] + 1
    outputs = SimpleNamespace(
        log_probs=logps, entropy=torch.zeros_like(logps), mean_logits=torch.zeros_like(logps),
        is_top1=torch.zeros_like(logps, dtype=torch.bool))
    stand_in = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t,
                                    gather_for_metrics=lambda t: t),
        aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True,
        f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0], beta=beta,
        label_smoothing=0.0, use_weighting=False, _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0, _tp_size=1)
    completion = torch.cat([torch.zeros(2 * PAIRS, 1, dtype=torch.long), mask.long()], dim=1)
    inputs = {"input_ids": torch.zeros(2 * PAIRS, seq, dtype=torch.long),
              "attention_mask": torch.ones(2 * PAIRS, seq, dtype=torch.long),
              "completion_mask": completion,
              "ref_chosen_logps": ref[:PAIRS], "ref_rejected_logps": ref[PAIRS:]}
    loss = DPOTrainer._compute_loss(stand_in, lambda **kwargs: outputs, inputs, False)
    return loss, {k: v[-1] for k, v in stand_in._metrics["train"].items()}


def _batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(2 * PAIRS, LENGTH, generator=gen) < 0.7).double()
    mask[:, 0] = 1  # every response counts a token
    logps = -torch.rand(2 * PAIRS, LENGTH, generator=gen, dtype=torch.float64) * 3 * mask
    ref = (logps.sum(1) + torch.randn(2 * PAIRS, generator=gen, dtype=torch.float64))
    return logps, ref, mask


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_our_dpo_loss_is_trls(loss_type):
    beta = 0.2
    logps, ref, mask = _batch(1)
    want, logged = _trl(loss_type, beta, logps, ref, mask)
    sums, counts = logps.sum(1), mask.sum(1)
    norm = counts if loss_type == "ipo" else torch.ones_like(counts)
    margin = (sums[:PAIRS] - ref[:PAIRS]) / norm[:PAIRS] - (sums[PAIRS:] - ref[PAIRS:]) / \
        norm[PAIRS:]
    got = pair_losses(margin, DpoConfig(beta, loss_type, 0.0)).mean()
    print(f"\nDPO {loss_type}: ours {got.item():.12f}, TRL's {want.item():.12f}")
    assert got.item() == pytest.approx(want.item(), rel=1e-12)
    rewards_c, rewards_r = beta * (sums[:PAIRS] - ref[:PAIRS]), beta * (sums[PAIRS:] - ref[PAIRS:])
    assert logged["rewards/chosen"] == pytest.approx(rewards_c.mean().item(), rel=1e-12)
    assert logged["rewards/margins"] == pytest.approx((rewards_c - rewards_r).mean().item(),
                                                      rel=1e-12)
    # (TRL takes the accuracy's mean in fp32)
    assert logged["rewards/accuracies"] == pytest.approx(
        (rewards_c > rewards_r).double().mean().item(), rel=1e-7)


def test_label_smoothing_is_conservative_dpo_and_zero_is_ln2_at_the_reference():
    margin = torch.tensor([0.0, 0.7, -1.3], dtype=torch.float64)
    eps, beta = 0.1, 0.5
    want = -(1 - eps) * F.logsigmoid(beta * margin) - eps * F.logsigmoid(-beta * margin)
    assert torch.equal(pair_losses(margin, DpoConfig(beta, "sigmoid", eps)), want)
    assert pair_losses(margin[:1], DpoConfig(beta, "sigmoid", 0.0)).item() == \
        pytest.approx(math.log(2), rel=1e-15)
