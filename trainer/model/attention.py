"""Grouped-query attention with rotary positions as plain single-device PyTorch (the part "gqa":
trainer.parts.attention). `attention_fn` is a plain function attribute, so wrapping it changes
no parameter name: context parallel replaces it, selective recompute wraps it.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import ModelConfig
from trainer.model.documents import document_attention
from trainer.model.norm import RMSNorm
from trainer.parts.attention import LLAMA3_ROPE_CONTEXT, LLAMA3_ROPE_HIGH, LLAMA3_ROPE_LOW

# q [batch, heads, seq, head_dim], k and v [batch, groups, seq, head_dim] (grouped-query
# attention: groups divides heads), documents -> [batch, heads, seq, head_dim]. documents:
# None (each sample one document), or for every position of the whole sequence where its
# document starts ([batch, seq], on the CPU; data.reset_attention_mask).
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
                       torch.Tensor]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     documents: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention; with documents, within each document only
    (trainer/model/documents.py)."""
    if documents is not None:
        return document_attention(q, k, v, documents)
    # The fused kernels read each K/V group for its query heads; nothing is repeated.
    return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                          enable_gqa=k.shape[1] != q.shape[1])


def rotary_frequencies(head_dim: int, theta: float, scaling_factor: float | None = None,
                       device: torch.device | None = None) -> torch.Tensor:
    """[head_dim / 2] fp32 frequencies theta^(-2i/d), Llama-3-scaled when a factor is given."""
    half = head_dim // 2
    freqs = theta ** (-torch.arange(half, device=device, dtype=torch.float32) / half)
    if scaling_factor is None:
        return freqs
    context, low, high = LLAMA3_ROPE_CONTEXT, LLAMA3_ROPE_LOW, LLAMA3_ROPE_HIGH
    wavelength = 2 * math.pi / freqs
    scaled = torch.where(wavelength > context / low, freqs / scaling_factor, freqs)
    smooth = (context / wavelength - low) / (high - low)
    between = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(between, (1 - smooth) * scaled / scaling_factor + smooth * scaled, scaled)


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [batch, seq, heads, head_dim] at integer `positions` [batch, seq].
    Positions are global token positions, so a sequence split over ranks rotates the same."""
    half = x.shape[-1] // 2
    angles = positions.to(torch.float32)[..., None] * freqs  # [batch, seq, half]
    cos, sin = angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h = cfg.hidden_size
        self.head_dim, self.rope_theta = cfg.head_dim, cfg.rope_theta
        self.rope_scaling = cfg.rope_scaling_factor if cfg.use_rope_scaling else None
        self.parts = cfg.qkv_heads  # q | k | v
        # q, k and v in one projection: one GEMM, and under TP one collective for all three.
        self.qkv = nn.Linear(h, cfg.q_size + 2 * cfg.kv_size, bias=False)
        self.o = nn.Linear(cfg.q_size, h, bias=False)
        # qk_layernorm: one norm of head_dim shared by every head of q (and one of k).
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_layernorm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_layernorm else None
        self.attention_fn: AttentionFn = causal_attention

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        qkv = self.qkv(x)
        # Shapes come from the projections, not from x: a tensor-parallel projection has fewer
        # heads (q, k and v in the same proportions), and a sequence-parallel one sees the
        # whole sequence while x holds a slice.
        widths = [qkv.shape[-1] * n // sum(self.parts) for n in self.parts]
        q, k, v = qkv.split(widths, dim=-1)
        b, s = q.shape[:2]
        q, k, v = (t.view(b, s, -1, self.head_dim) for t in (q, k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        freqs = rotary_frequencies(self.head_dim, self.rope_theta, self.rope_scaling, x.device)
        q, k = apply_rotary(q, positions, freqs), apply_rotary(k, positions, freqs)
        out = self.attention_fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                documents)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))
