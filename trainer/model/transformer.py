"""The model: a decoder-only transformer as plain single-device PyTorch.

It knows nothing of ranks or groups. Parallel code wraps or replaces its layers from outside, by
module name. Two hooks are plain function attributes, so wrapping them changes no parameter
name: `attention_fn` (context parallel replaces it) and `activation_fn` (selective recompute
wraps both). A block's MLP is a SwiGLU or a mixture of experts (trainer/model/moe.py, whose
router has hooks of its own).
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from trainer.checks import check_model
from trainer.config import ModelConfig
from trainer.model.documents import document_attention
from trainer.model.init import normal_rectangle
from trainer.model.moe import MoE

# q [batch, heads, seq, head_dim], k and v [batch, groups, seq, head_dim] (grouped-query
# attention: groups divides heads), documents -> [batch, heads, seq, head_dim]. documents:
# None (each sample one document), or for every position of the whole sequence where its
# document starts ([batch, seq], on the CPU; data.reset_attention_mask).
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
                       torch.Tensor]
# (gate, up) each [batch, seq, ffn] -> [batch, seq, ffn]
ActivationFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     documents: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention; with documents, within each document only
    (trainer/model/documents.py)."""
    if documents is not None:
        return document_attention(q, k, v, documents)
    # The fused kernels read each K/V group for its query heads; nothing is repeated.
    return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                          enable_gqa=k.shape[1] != q.shape[1])


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


# Llama 3's rope scaling constants (Meta's reference; Megatron fixes them too): frequencies
# whose wavelength exceeds CONTEXT / LOW are divided by the factor, those under CONTEXT / HIGH
# kept, and the ones between interpolated.
LLAMA3_ROPE_CONTEXT, LLAMA3_ROPE_LOW, LLAMA3_ROPE_HIGH = 8192, 1.0, 4.0


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


class SwiGLU(nn.Module):
    def __init__(self, h: int, f: int):
        super().__init__()
        self.gate_up = nn.Linear(h, 2 * f, bias=False)  # fused like qkv
        self.down = nn.Linear(f, h, bias=False)
        self.activation_fn: ActivationFn = swiglu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.activation_fn(gate, up))


def mlp(cfg: ModelConfig, block: int) -> nn.Module:
    """Block `block`'s MLP: a SwiGLU, or a mixture of experts (model.moe_layer_freq) with its
    shared expert, a SwiGLU too."""
    h = cfg.hidden_size
    if not cfg.is_moe_block(block):
        return SwiGLU(h, cfg.ffn_hidden_size)
    shared = cfg.moe_shared_expert_intermediate_size
    return MoE(cfg, swiglu, SwiGLU(h, shared) if shared else None)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.attn_norm, self.mlp_norm = (RMSNorm(cfg.hidden_size, cfg.norm_eps) for _ in range(2))
        self.attn, self.mlp = Attention(cfg), mlp(cfg, index)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), positions, documents)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """tokens [batch, seq] (+ positions [batch, seq], + documents: see AttentionFn) -> logits
    [batch, seq, vocab].

    A pipeline stage (parallel.pipeline.stages) sets the embedding, or the final norm and head,
    to None where another stage runs them: it then takes hidden states [batch, seq, hidden]
    instead of tokens, or returns them instead of logits."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        check_model(cfg)
        self.cfg = cfg
        # Padded vocabulary (model.make_vocab_size_divisible_by): the padding rows are never
        # looked up, and the loss excludes their logits (vocab_size tells it where they start).
        self.vocab_size = cfg.vocab_size
        self.embed = nn.Embedding(cfg.padded_vocab_size, cfg.hidden_size)
        # By index, so a pipeline stage that keeps some blocks keeps their names (layers.i).
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.num_layers)})
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.padded_vocab_size, bias=False)
        if cfg.tie_word_embeddings:  # one parameter, named embed.weight; both uses add grads
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand(
                tokens.shape[:2])
        x = tokens if self.embed is None else self.embed(tokens)
        for block in self.layers.values():
            x = block(x, positions, documents)
        return x if self.head is None else self.head(self.norm(x))

    def initial_values(self, name: str, full: tuple[int, ...], offsets: tuple[int, ...],
                       shape: tuple[int, ...], seed: int) -> torch.Tensor:
        """The rectangle `shape` at `offsets` of parameter `name`'s initial value (`full`: its
        single-device shape). The same seed gives the same full weights whatever the layout,
        and a rank asks only for its shards (trainer.model.init). Norms start at one, the
        router's expert bias (a buffer) at zero."""
        if name.endswith("expert_bias"):
            return torch.zeros(shape)
        if len(full) == 1:
            return torch.ones(shape)
        std = self.cfg.init_std
        if name.endswith(("attn.o.weight", "mlp.down.weight", "experts.down",
                          "shared.down.weight")):
            # Residual-branch outputs shrink with depth so the residual stream keeps its scale.
            std /= math.sqrt(2 * self.cfg.num_layers)
        if len(full) == 3:  # experts [E, rows, cols]: each expert's matrix drawn on its own
            return torch.stack([
                normal_rectangle(seed, f"{name}.{e}", full[2], offsets[1:], shape[1:])
                for e in range(offsets[0], offsets[0] + shape[0])]).mul_(std)
        return normal_rectangle(seed, name, full[1], offsets, shape).mul_(std)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise the whole single-device model (one process)."""
        for name, tensor in [*self.named_parameters(), *self.named_buffers()]:
            shape = tuple(tensor.shape)
            tensor.copy_(self.initial_values(name, shape, (0,) * tensor.ndim, shape, seed))
