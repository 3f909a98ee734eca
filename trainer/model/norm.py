"""RMSNorm: the norm of every block (before its attention and its MLP), of the final hidden
states and, with qk_layernorm, of each head of q and k."""
from __future__ import annotations

import torch
from torch import nn

from trainer.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def hidden_norm(cfg: ModelConfig, block: int = 0) -> RMSNorm:
    """The norm of hidden states: a block's pre-norms and the final norm."""
    return RMSNorm(cfg.hidden_size, cfg.norm_eps)
