"""The model's parallelize plan: which of the Transformer's modules parallel code replaces and
how, by module name. With transformer.py, the only place that knows the model's module names;
parallel/ applies the plan without knowing the model, and the memory plan reads it too.
"""
from __future__ import annotations

from parallel.plan import ParallelPlan

PLAN = ParallelPlan(
    # Module-name suffix -> (TP style, fused parts). Column then row keeps one collective per
    # pair; q|k|v and gate|up are fused, so their TP split keeps each part's rows together.
    linears={
        "attn.qkv": ("column", 3), "attn.o": ("row", 1),
        "mlp.gate_up": ("column", 2), "mlp.down": ("row", 1),
        "head": ("column", 1),  # vocab-parallel logits, consumed by the vocab-parallel loss
    },
    embedding="embed",  # vocab-parallel: rows split over TP like the head
    head="head",
    blocks="layers",  # the ModuleList of transformer blocks: one weight-gather bundle each
    # Cheap to recompute, costly to keep: the softmax(QK^T)V core and silu(gate) * up.
    recompute_hooks=("attention_fn", "activation_fn"),
)


def stage_of(name: str, num_layers: int, num_stages: int) -> int:
    """The pipeline stage of parameter `name`: a contiguous, balanced split of the blocks;
    embedding first, final norm and head last."""
    prefix = f"{PLAN.blocks}."
    if name.startswith(prefix):
        return int(name[len(prefix):].split(".")[0]) * num_stages // num_layers
    return 0 if name.startswith(f"{PLAN.embedding}.") else num_stages - 1
