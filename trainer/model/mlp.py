"""The dense MLP, a SwiGLU, as plain single-device PyTorch (the part "swiglu":
trainer.parts.mlp; a mixture of experts' shared expert is one too). `activation_fn` is a plain
function attribute: selective recompute wraps it.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import ModelConfig

# (gate, up) each [batch, seq, ffn] -> [batch, seq, ffn]
ActivationFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class SwiGLU(nn.Module):
    def __init__(self, h: int, f: int):
        super().__init__()
        self.gate_up = nn.Linear(h, 2 * f, bias=False)  # fused like qkv
        self.down = nn.Linear(f, h, bias=False)
        self.activation_fn: ActivationFn = swiglu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.activation_fn(gate, up))


def dense_mlp(cfg: ModelConfig, block: int = 0) -> SwiGLU:
    """A dense block's MLP, of model.ffn_hidden_size."""
    return SwiGLU(cfg.hidden_size, cfg.ffn_hidden_size)
