"""Model parts as registered pieces, and the model families over them (no torch).

A block is a norm, an attention part, a norm and an MLP part (pre-norm residual). Each part is
one module of this package (part.py: what an entry is made of) that owns its shapes, its
tensor-parallel plan, the hook context parallel and recompute use, its FLOPs beyond its weights,
its initialisation, its rules and its Hugging Face names; its single-device layer is named there
and built by trainer.model. REGISTRY lists them by kind; `block_parts` is the layer pattern:
which part each block uses. A family (families.py) is a description over them.
"""
from __future__ import annotations

from typing import NamedTuple

from trainer.config import ModelConfig
from trainer.parts.attention import GQA
from trainer.parts.gdn import GATED_DELTA_NET
from trainer.parts.mla import MLA
from trainer.parts.mlp import SWIGLU
from trainer.parts.moe import MOE
from trainer.parts.norm import RMSNORM
from trainer.parts.part import Part

REGISTRY: dict[str, dict[str, Part]] = {
    "norm": {RMSNORM.name: RMSNORM},
    "attention": {GQA.name: GQA, MLA.name: MLA, GATED_DELTA_NET.name: GATED_DELTA_NET},
    "mlp": {SWIGLU.name: SWIGLU, MOE.name: MOE},
}
PARTS = tuple(part for kind in REGISTRY.values() for part in kind.values())


class BlockParts(NamedTuple):
    """What one block is made of: its norm (before its attention and before its MLP), its
    attention and its MLP."""

    norm: Part
    attention: Part
    mlp: Part


def block_parts(cfg: ModelConfig, block: int) -> BlockParts:
    """The layer pattern: block `block`'s parts; its attention Gated DeltaNet where
    model.linear_attention_freq says (a hybrid), else multi-latent where
    model.multi_latent_attention says; its MLP a mixture of experts where model.moe_layer_freq
    says."""
    attention = GATED_DELTA_NET if cfg.is_linear_block(block) else \
        MLA if cfg.multi_latent_attention else GQA
    return BlockParts(RMSNORM, attention, MOE if cfg.is_moe_block(block) else SWIGLU)


def model_parts(cfg: ModelConfig) -> list[Part]:
    """Every part the model's blocks use, each once, in registry order."""
    used = {part.name for block in range(cfg.num_layers) for part in block_parts(cfg, block)} \
        if cfg.num_layers >= 1 else set()
    return [part for part in PARTS if part.name in used]
