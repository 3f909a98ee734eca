"""The dense MLP, a gated linear unit, as plain single-device PyTorch (the part "swiglu":
trainer.parts.mlp; a mixture of experts' shared expert is one too, and its experts use the same
activation). `activation_fn` is a plain function attribute: selective recompute wraps it.
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import ModelConfig

# (gate, up) each [batch, seq, ffn] -> [batch, seq, ffn]
ActivationFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
QUICK_GELU_ALPHA = 1.702  # Megatron's quick_gelu and gpt-oss's sigmoid slope


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(QUICK_GELU_ALPHA * x)


# model.activation_func (Megatron's names, trainer.parts.mlp.ACTIVATION_FUNCS): the function of
# the gate in act(gate) * (up + model.glu_linear_offset).
GATE_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,  # SwiGLU: Llama's, Qwen's, Mixtral's, DeepSeek's
    "fast_gelu": partial(F.gelu, approximate="tanh"),  # GeGLU: Gemma 3's gelu_pytorch_tanh
    "quick_gelu": quick_gelu,  # gpt-oss's, with glu_linear_offset 1 and a clamp of 7
}


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


def gated(gate: torch.Tensor, up: torch.Tensor, *, func: Callable, offset: float,
          clamp: float | None) -> torch.Tensor:
    """func(gate) * (up + offset), gate clamped from above and up on both sides first where
    `clamp` is set (Megatron's activation_func_clamp_value: gpt-oss's clamped SwiGLU)."""
    if clamp is not None:
        gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
    return func(gate) * (up + offset) if offset else func(gate) * up


def activation(cfg: ModelConfig) -> ActivationFn:
    """The MLP's activation the config names; SwiGLU and GeGLU without offset or clamp are the
    plain functions (what every model before these keys ran, unchanged)."""
    offset, clamp = cfg.glu_linear_offset, cfg.activation_func_clamp_value
    if not offset and clamp is None and cfg.activation_func in ("silu", "fast_gelu"):
        return swiglu if cfg.activation_func == "silu" else geglu
    return partial(gated, func=GATE_FUNCTIONS[cfg.activation_func], offset=offset, clamp=clamp)


class GatedMLP(nn.Module):
    def __init__(self, h: int, f: int, activation_fn: ActivationFn = swiglu, bias: bool = False):
        super().__init__()
        self.gate_up = nn.Linear(h, 2 * f, bias=bias)  # fused like qkv
        self.down = nn.Linear(f, h, bias=bias)
        self.activation_fn: ActivationFn = activation_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.activation_fn(gate, up))


def dense_mlp(cfg: ModelConfig, block: int = 0) -> GatedMLP:
    """A dense block's MLP, of model.ffn_hidden_size."""
    return GatedMLP(cfg.hidden_size, cfg.ffn_hidden_size, activation(cfg), cfg.add_bias_linear)
