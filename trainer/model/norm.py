"""RMSNorm: the norm of every block (before its attention and its MLP, and with sandwich_norm
after each too), of the final hidden states and, with qk_layernorm, of each head of q and k.
Gemma's zero-centred form (model.layernorm_zero_centered_gamma) is one flag of the same layer.
"""
from __future__ import annotations

import torch
from torch import nn

from trainer.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.eps, self.zero_centered = eps, zero_centered
        # Zero-centred: the weight is stored as gamma - 1 and starts at zero (trainer.model.
        # transformer.initial_values), so weight decay pulls gamma towards one.
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.zero_centered:
            # Gemma's order (transformers' Gemma3RMSNorm): normalised and scaled by (1 + w) in
            # fp32 (fp64 stays fp64), cast back to x's dtype once, after the scale.
            dtype = torch.promote_types(x.dtype, torch.float32)
            normed = self._normed(x.to(dtype))
            return (normed * (1.0 + self.weight.to(dtype))).type_as(x)
        return self._normed(x) * self.weight

    def _normed(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rms_norm(cfg: ModelConfig, dim: int) -> RMSNorm:
    """An RMSNorm `dim` wide of the config's kind (plain, or zero-centred)."""
    return RMSNorm(dim, cfg.norm_eps, cfg.layernorm_zero_centered_gamma)


def hidden_norm(cfg: ModelConfig, block: int = 0) -> RMSNorm:
    """The norm of hidden states: a block's pre-norms (and post-norms), the final norm."""
    return rms_norm(cfg, cfg.hidden_size)
