"""Multi-token prediction as plain single-device PyTorch (trainer.parts.mtp describes it).

The depths run after the model's blocks and final norm, on the same positions and documents:
depth k's input at position i is the embedding of the token k ahead (the batch gives those ids,
trainer.train.batch: under context parallel each rank's come with its own positions, so no
rank asks another for a token) and depth k - 1's hidden state at i.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from trainer.config import ModelConfig
from trainer.model.norm import hidden_norm
from trainer.parts.mtp import depths


class MtpDepth(nn.Module):
    def __init__(self, cfg: ModelConfig, block: nn.Module):
        super().__init__()
        h = cfg.hidden_size
        self.enorm, self.hnorm = hidden_norm(cfg), hidden_norm(cfg)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = block
        self.norm = hidden_norm(cfg)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, positions: torch.Tensor,
                documents: torch.Tensor | None) -> torch.Tensor:
        # Megatron's and DeepSeek's order: the embedding first, then the hidden state
        x = self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1))
        return self.norm(self.block(x, positions, documents))


class MultiTokenPrediction(nn.Module):
    """The D depths (model.mtp_num_layers), by index."""

    def __init__(self, cfg: ModelConfig, block: Callable[[], nn.Module]):
        super().__init__()
        self.depths = nn.ModuleDict({str(d): MtpDepth(cfg, block())
                                     for d in range(depths(cfg))})
        # each depth's mean loss weighs this in the step's loss (Megatron's factor / D)
        self.loss_scale = cfg.mtp_loss_scaling_factor / depths(cfg)

    def forward(self, hidden: torch.Tensor, ahead: torch.Tensor, embedding: nn.Module,
                head: nn.Module, positions: torch.Tensor, documents: torch.Tensor | None
                ) -> list[torch.Tensor]:
        """hidden: the model's final-normed output; ahead [D, batch, seq]: depth k's token ids
        (the token k ahead of each position) -> each depth's logits."""
        logits = []
        for d, depth in enumerate(self.depths.values()):
            hidden = depth(hidden, embedding(ahead[d]), positions, documents)
            logits.append(head(hidden))
        return logits
