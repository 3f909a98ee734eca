"""The model: a decoder-only transformer as plain single-device PyTorch, built from its parts.

It knows nothing of ranks or groups. Parallel code wraps or replaces its layers from outside, by
module name. A block is a pre-norm residual pair: a norm and its attention part, a norm and its
MLP part, each part's layer built from its description (trainer.parts: which part each block
uses, and the module that builds it). The parts' hooks (`attention_fn`, `activation_fn`; a
router's of trainer/model/moe.py) are plain function attributes, so wrapping them changes no
parameter name.
"""
from __future__ import annotations

import importlib
import math

import torch
from torch import nn

from trainer.checks import check_model
from trainer.config import ModelConfig
from trainer.model.init import normal_rectangle, special_values
from trainer.model.lora import adapter_std
from trainer.model.mtp import MultiTokenPrediction
from trainer.parts import block_parts
from trainer.parts.assembly import INITIAL, RESIDUAL_OUTPUTS
from trainer.parts.part import Part


def build_layer(part: Part, cfg: ModelConfig, block: int = 0) -> nn.Module:
    """A part's single-device layer: its "module:factory" called with the config and the
    block's index (what varies by block: its sliding window)."""
    module, factory = part.layer.split(":")
    return getattr(importlib.import_module(module), factory)(cfg, block)


def embedding_scale(cfg: ModelConfig, dtype: torch.dtype) -> torch.Tensor:
    """model.scale_embedding's factor: sqrt(hidden_size) rounded to fp32, then to the compute
    dtype `dtype` (transformers' Gemma3TextScaledWordEmbedding keeps it as an fp32 tensor cast
    to its weight's dtype, so bf16 gives 55.5 for sqrt(3072), not 55.43)."""
    return torch.tensor(cfg.hidden_size ** 0.5, dtype=torch.float32).to(dtype)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the model computes in: autocast's where it is on (bf16 training keeps the
    residual stream in fp32), else x's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        parts = block_parts(cfg, index)
        self.attn_norm = build_layer(parts.norm, cfg, index)
        self.mlp_norm = build_layer(parts.norm, cfg, index)
        # sandwich_norm (Gemma 2/3's): each branch's output normed too, before its residual add
        self.post_attn_norm = build_layer(parts.norm, cfg, index) if cfg.sandwich_norm else None
        self.post_mlp_norm = build_layer(parts.norm, cfg, index) if cfg.sandwich_norm else None
        self.attn = build_layer(parts.attention, cfg, index)
        self.mlp = build_layer(parts.mlp, cfg, index)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        # No name holds a branch's output past its add: under full recompute the rebuilt
        # forward would keep the attention's output alive through the MLP's.
        x = x + _normed(self.post_attn_norm, self.attn(self.attn_norm(x), positions, documents))
        return x + _normed(self.post_mlp_norm, self.mlp(self.mlp_norm(x)))


def _normed(norm: nn.Module | None, out: torch.Tensor) -> torch.Tensor:
    """A branch's output, normed where the block has a sandwich norm."""
    return out if norm is None else norm(out)


class Transformer(nn.Module):
    """tokens [batch, seq] (+ positions [batch, seq], + documents: see trainer.model.attention's
    AttentionFn) -> logits [batch, seq, vocab] (with multi-token prediction's ids ahead: and
    each depth's logits).

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
        self.norm = build_layer(block_parts(cfg, 0).norm, cfg)  # the blocks' norm kind
        self.head = nn.Linear(cfg.hidden_size, cfg.padded_vocab_size, bias=False)
        if cfg.tie_word_embeddings:  # one parameter, named embed.weight; both uses add grads
            self.head.weight = self.embed.weight
        # Multi-token prediction's depths (model.mtp_num_layers), each with a block of the last
        # block's kind; None without.
        self.mtp = MultiTokenPrediction(cfg, lambda: Block(cfg, cfg.num_layers - 1)) \
            if cfg.mtp_num_layers else None
        for d, depth in enumerate(self.mtp.depths.values() if self.mtp else ()):
            for module in depth.modules():  # a router reports as block num_layers + d
                if hasattr(module, "expert_bias"):
                    module.block = cfg.num_layers + d

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                documents: torch.Tensor | None = None, ahead: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """ahead [D, batch, seq]: multi-token prediction's token ids (trainer.model.mtp); with
        them the last stage returns (logits, each depth's logits)."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand(
                tokens.shape[:2])
        # Token ids are embedded; a later pipeline stage is given hidden states (floats). The
        # last stage may hold the embedding for multi-token prediction, not for its input.
        x = tokens if tokens.is_floating_point() else self.embed(tokens)
        if self.cfg.scale_embedding and not tokens.is_floating_point():
            x = x * embedding_scale(self.cfg, compute_dtype(x)).to(x.dtype)
        for block in self.layers.values():
            x = block(x, positions, documents)
        if self.head is None:
            return x
        hidden = self.norm(x)
        logits = self.head(hidden)
        if self.mtp is None or ahead is None:
            return logits
        return logits, *self.mtp(hidden, ahead, self.embed, self.head, positions, documents)

    def initial_values(self, name: str, full: tuple[int, ...], offsets: tuple[int, ...],
                       shape: tuple[int, ...], seed: int) -> torch.Tensor:
        """The rectangle `shape` at `offsets` of parameter `name`'s initial value (`full`: its
        single-device shape). The same seed gives the same full weights whatever the layout,
        and a rank asks only for its shards (trainer.model.init). Norms start at one, every
        bias (the router's expert bias, a buffer, too) and attention sinks at zero, and so do
        zero-centred norms (model.layernorm_zero_centered_gamma: applied as 1 + weight)."""
        rule = next((r for suffix, r in INITIAL.items() if name.endswith(f".{suffix}")), None)
        if rule is not None:  # a part's own (Gated DeltaNet's decay, its gated norm)
            return special_values(rule, seed, name, full[0], offsets[0], shape[0])
        if name.endswith(("bias", "sinks")):  # the sinks start as off-by-one's
            return torch.zeros(shape)
        if len(full) == 1:
            return torch.zeros(shape) if self.cfg.layernorm_zero_centered_gamma \
                else torch.ones(shape)
        std = self.cfg.init_std
        adapter = adapter_std(name, full[-1])
        if adapter == 0:  # peft=lora's B (trainer.model.lora)
            return torch.zeros(shape)
        if adapter is not None:  # its A, drawn as a weight (a routed expert's: per expert)
            std = adapter
        elif name.endswith(RESIDUAL_OUTPUTS):
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
