"""Multi-latent attention (DeepSeek-V2/V3's) as plain single-device PyTorch (the part "mla":
trainer.parts.mla).

q is projected down to a latent of q_lora_rank, normed and projected up to every head's
[qk_head_dim | qk_pos_emb_head_dim] (or projected directly when q_lora_rank is null). The keys
and values share one latent of kv_lora_rank, projected down together with a rotary key of
qk_pos_emb_head_dim that every head of a token reads (the decoupled rope); the latent is
normed and projected up to every head's [qk_head_dim | v_head_dim]. A key head is its own part
and the shared rotary key; values are narrower than queries and keys, which every attention
path takes (trainer.model.attention's, the documents', context parallel's, the KV cache's).

Hooks (plain function attributes, replaced from outside; no parameter name changes):
`attention_fn` as in grouped-query attention; `shared_key_fn`, the identity on one process,
which tensor parallel replaces so that each rank holds the shared rotary key for the whole
sequence and its gradient sums every rank's heads (parallel.tensor).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from trainer.config import ModelConfig
from trainer.model.attention import AttentionFn, causal_attention
from trainer.model.norm import RMSNorm
from trainer.model.rotary import apply_rotary, rotary_frequencies, softmax_correction


def _unchanged(x: torch.Tensor) -> torch.Tensor:
    return x


class MultiLatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, block: int = 0):
        super().__init__()
        h, n = cfg.hidden_size, cfg.num_heads
        self.cfg = cfg
        self.nope, self.rope, self.v_dim = (cfg.qk_head_dim, cfg.qk_pos_emb_head_dim,
                                            cfg.v_head_dim)
        self.kv_lora_rank = cfg.kv_lora_rank
        q_out = n * (self.nope + self.rope)
        if cfg.q_lora_rank is None:
            self.q = nn.Linear(h, q_out, bias=False)
        else:
            self.q_down = nn.Linear(h, cfg.q_lora_rank, bias=False)
            self.q_latent_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.q_up = nn.Linear(cfg.q_lora_rank, q_out, bias=False)
        self.kv_down = nn.Linear(h, cfg.kv_lora_rank + self.rope, bias=False)
        self.kv_latent_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps)
        self.kv_up = nn.Linear(cfg.kv_lora_rank, n * (self.nope + self.v_dim), bias=False)
        self.o = nn.Linear(n * self.v_dim, h, bias=False)
        # The kernels scale scores by 1/sqrt(q's width); YaRN's correction rides on q.
        self.q_scale = softmax_correction(cfg)
        self.attention_fn: AttentionFn = causal_attention
        self.shared_key_fn: Callable[[torch.Tensor], torch.Tensor] = _unchanged
        self.max_logits: torch.Tensor | None = None  # QK-clip's record, as in attention.py

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        q = self.q(x) if self.cfg.q_lora_rank is None else \
            self.q_up(self.q_latent_norm(self.q_down(x)))
        latent, k_rope = self.kv_down(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_up(self.kv_latent_norm(latent))
        k_rope = self.shared_key_fn(k_rope)
        # Shapes from the up-projections: under TP they hold this rank's heads, under SP the
        # whole sequence while x holds a slice.
        b, s = q.shape[:2]
        q_nope, q_rope = q.view(b, s, -1, self.nope + self.rope).split([self.nope, self.rope], -1)
        k_nope, v = kv.view(b, s, -1, self.nope + self.v_dim).split([self.nope, self.v_dim], -1)
        heads = q_nope.shape[2]
        freqs, factor = rotary_frequencies(self.cfg, self.rope, x.device)
        q_rope = apply_rotary(q_rope, positions, freqs, factor)
        k_rope = apply_rotary(k_rope[:, :, None], positions, freqs, factor)
        q = torch.cat((q_nope, q_rope), dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        k = torch.cat((k_nope, k_rope.expand(b, s, heads, self.rope)), dim=-1)
        out = self.attention_fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                documents, logits=self.max_logits)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))
