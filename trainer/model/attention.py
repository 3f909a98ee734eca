"""Grouped-query attention with rotary positions as plain single-device PyTorch (the part "gqa":
trainer.parts.attention), with a sliding window and attention sinks where the config asks.
`attention_fn` is a plain function attribute, so wrapping it changes no parameter name: context
parallel replaces it, selective recompute wraps it.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from parallel.context.calls import plan_calls
from parallel.context.kernels import ChunkPairs, record_logits
from trainer.config import ModelConfig
from trainer.model.documents import document_attention
from trainer.model.norm import rms_norm
from trainer.model.rotary import apply_rotary, rotary_frequencies

# q [batch, heads, seq, head_dim], k and v [batch, groups, seq, head_dim] (grouped-query
# attention: groups divides heads), documents, window, sinks -> [batch, heads, seq, head_dim].
# documents: None (each sample one document), or for every position of the whole sequence where
# its document starts ([batch, seq], on the CPU; data.reset_attention_mask). window: how far
# back a query may look (None: to its document's start). sinks: [heads] logits that join every
# row's softmax denominator (None: none). logits: [heads] fp32 where the largest logit each head
# meets is maxed in (QK-clip, trainer.train.qk_clip; None: not recorded).
AttentionFn = Callable[..., torch.Tensor]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     documents: torch.Tensor | None = None, window: int | None = None,
                     sinks: torch.Tensor | None = None, logits: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """Causal attention; with documents, within each document only
    (trainer/model/documents.py). Values narrower than queries (multi-latent attention's) are
    padded with zeros to their width and the output cut back: the fused kernels take one
    width, and without them torch falls back to forming every score (memory of S^2). A window
    or sinks: kernel calls over the band the window and documents leave, merged by log-sum-exp
    with the sinks joined once (parallel.context.calls and kernels, as context parallel runs
    them on each chunk pair): no mask, and no work outside the window. logits: QK-clip's
    largest logit per head, maxed in over the pairs attended (None: not recorded)."""
    width = v.shape[-1]
    if width != q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - width))
        return causal_attention(q, k, v, documents, window, sinks, logits)[..., :width]
    if window is not None or sinks is not None:
        calls = plan_calls((0,), (0,), q.shape[2], documents, window)
        return ChunkPairs.apply(q, k, v, calls, sinks, logits)
    if logits is not None:
        record_logits(q, k, plan_calls((0,), (0,), q.shape[2], documents, None), logits)
    if documents is not None:
        return document_attention(q, k, v, documents)
    # The fused kernels read each K/V group for its query heads; nothing is repeated.
    return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                          enable_gqa=k.shape[1] != q.shape[1])


def _identity(weight: torch.Tensor) -> torch.Tensor:
    return weight


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, block: int = 0):
        super().__init__()
        h = cfg.hidden_size
        self.cfg, self.head_dim = cfg, cfg.head_dim
        self.window = cfg.window_of(block)  # this block's sliding window; None: global
        # Attention sinks (softmax_type=learnable): a logit per head, read through heads_fn
        # (tensor parallel narrows it to the rank's heads). off-by-one: a zero logit.
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads)) \
            if cfg.softmax_type == "learnable" else None
        self.heads_fn = _identity
        self.parts = cfg.qkv_heads  # q | k | v
        # q, k and v in one projection: one GEMM, and under TP one collective for all three.
        self.qkv = nn.Linear(h, cfg.q_proj_size + 2 * cfg.kv_size,
                             bias=cfg.add_bias_linear or cfg.add_qkv_bias)
        self.o = nn.Linear(cfg.q_size, h, bias=cfg.add_bias_linear)
        # qk_layernorm: one norm of head_dim shared by every head of q (and one of k).
        self.q_norm = rms_norm(cfg, cfg.head_dim) if cfg.qk_layernorm else None
        self.k_norm = rms_norm(cfg, cfg.head_dim) if cfg.qk_layernorm else None
        # model.softmax_scale: the kernels scale by head_dim ** -0.5, so q carries the rest
        self.q_scale = 1.0 if cfg.softmax_scale is None else \
            cfg.softmax_scale * cfg.head_dim ** 0.5
        self.attention_fn: AttentionFn = causal_attention
        # QK-clip's record of this step's largest logit per (this rank's) query head, set from
        # outside (trainer.train.qk_clip); None: not recorded
        self.max_logits: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        qkv = self.qkv(x)
        # Shapes come from the projections, not from x: a tensor-parallel projection has fewer
        # heads (q, k and v in the same proportions), and a sequence-parallel one sees the
        # whole sequence while x holds a slice.
        widths = [qkv.shape[-1] * n // sum(self.parts) for n in self.parts]
        q, k, v = qkv.split(widths, dim=-1)
        b, s = q.shape[:2]
        gate = None
        if self.cfg.attention_output_gate:  # each head's query, then its gate
            q, gate = q.view(b, s, -1, 2 * self.head_dim).chunk(2, dim=-1)
        q, k, v = (t.reshape(b, s, -1, self.head_dim) for t in (q, k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rotated(q, positions), self._rotated(k, positions)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        out = self.attention_fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                documents, self.window, self._sinks(q), logits=self.max_logits)
        out = out.transpose(1, 2).reshape(b, s, -1)
        if gate is not None:  # model.attention_output_gate (Qwen3-Next's gated attention)
            out = out * torch.sigmoid(gate.reshape(b, s, -1))
        return self.o(out)

    def _rotated(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x's rotary dims turned (the first rotary_dim of each head: model.rotary_percent),
        the rest as they are."""
        dim = self.cfg.rotary_dim
        freqs, factor = rotary_frequencies(self.cfg, dim, x.device, self.window)
        if dim == self.head_dim:
            return apply_rotary(x, positions, freqs, factor)
        return torch.cat([apply_rotary(x[..., :dim], positions, freqs, factor), x[..., dim:]],
                         dim=-1)

    def _sinks(self, q: torch.Tensor) -> torch.Tensor | None:
        """The sink logits of q's heads (this rank's under tensor parallel), or None."""
        if self.sinks is not None:
            return self.heads_fn(self.sinks)
        if self.cfg.softmax_type == "off-by-one":
            return torch.zeros(q.shape[2], dtype=torch.float32, device=q.device)
        return None
