"""The model's parallelize plan: which of the Transformer's modules parallel code replaces and
how, by module name. With transformer.py, the only place that knows the model's module names;
parallel/ applies the plan without knowing the model, and the memory plan reads it too.
"""
from __future__ import annotations

from parallel.plan import ParallelPlan, by_suffix
from trainer.config import ModelConfig

EMBEDDING, HEAD, BLOCKS, FINAL_NORM = "embed", "head", "layers", "norm"
# Module-name suffix -> TP style. Column then row keeps one collective per pair; the head's
# vocab-parallel logits feed the vocab-parallel loss.
TP_STYLES = {"attn.qkv": "column", "attn.o": "row", "mlp.gate_up": "column", "mlp.down": "row",
             HEAD: "column"}


def parallel_plan(cfg: ModelConfig) -> ParallelPlan:
    """The plan of the Transformer built from `cfg` (its fused parts depend on the shape)."""
    # Fused parts by relative size: q|k|v (heads, groups, groups) and gate|up, so their TP
    # split keeps each part's rows together.
    fused = {"attn.qkv": cfg.qkv_heads, "mlp.gate_up": (1, 1)}
    return ParallelPlan(
        linears={name: (style, fused.get(name, (1,))) for name, style in TP_STYLES.items()},
        embedding=EMBEDDING,  # vocab-parallel: rows split over TP like the head
        head=HEAD,
        blocks=BLOCKS,  # the transformer blocks by index: one weight-gather bundle each
        final_norm=FINAL_NORM,
        hidden_size=cfg.hidden_size,
        # Cheap to recompute, costly to keep: the softmax(QK^T)V core and silu(gate) * up.
        recompute_hooks=("attention_fn", "activation_fn"),
    )


def tp_style(name: str) -> str:
    """The TP style of linear module `name` (the same for every model shape)."""
    return by_suffix(TP_STYLES, name)
