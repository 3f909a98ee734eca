"""The model's parallelize plan: which of the Transformer's modules parallel code replaces and
how, by module name. With transformer.py, the only place that knows the model's module names;
parallel/ applies the plan without knowing the model, and the memory plan reads it too.
"""
from __future__ import annotations

import math

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
        head_norms=("attn.q_norm", "attn.k_norm"),
    )


def tp_style(name: str) -> str:
    """The TP style of linear module `name` (the same for every model shape)."""
    return by_suffix(TP_STYLES, name)


def block_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """One transformer block's parameter shapes, by name within the block (every block is
    alike)."""
    h, f, q = cfg.hidden_size, cfg.ffn_hidden_size, cfg.q_size
    norms = {"attn.q_norm.weight": (cfg.head_dim,), "attn.k_norm.weight": (cfg.head_dim,)} \
        if cfg.qk_layernorm else {}
    return {"attn_norm.weight": (h,), "mlp_norm.weight": (h,),
            "attn.qkv.weight": (q + 2 * cfg.kv_size, h), "attn.o.weight": (h, q), **norms,
            "mlp.gate_up.weight": (2 * f, h), "mlp.down.weight": (h, f)}


def block_weight_elements(cfg: ModelConfig) -> int:
    """A block's 2-D weight elements (what its linears multiply by; the cost model's W)."""
    return sum(math.prod(shape) for shape in block_shapes(cfg).values() if len(shape) == 2)


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The Transformer's named_parameters() shapes, in its order, from the config alone (no
    torch): the memory plan and the layout search size a rank from them at compose time
    (tests/unit/test_model.py holds them equal to the built model's). A tied head is the
    embedding's parameter, so it has no entry of its own."""
    h, vocab = cfg.hidden_size, cfg.padded_vocab_size
    shapes: dict[str, tuple[int, ...]] = {f"{EMBEDDING}.weight": (vocab, h)}
    block = block_shapes(cfg)
    for i in range(cfg.num_layers):
        shapes |= {f"{BLOCKS}.{i}.{name}": shape for name, shape in block.items()}
    shapes[f"{FINAL_NORM}.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes[f"{HEAD}.weight"] = (vocab, h)
    return shapes
