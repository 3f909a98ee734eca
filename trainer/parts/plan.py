"""The model's parallelize plan: which of the Transformer's modules parallel code replaces and
how, by module name. With transformer.py, the only place that knows the model's module names;
parallel/ applies the plan without knowing the model, and the memory plan reads it too.
"""
from __future__ import annotations

import math

from parallel.layout.parallel_plan import ParallelPlan, by_suffix
from trainer.config import ModelConfig

EMBEDDING, HEAD, BLOCKS, FINAL_NORM = "embed", "head", "layers", "norm"
# Module-name suffix -> TP style. Column then row keeps one collective per pair; the head's
# vocab-parallel logits feed the vocab-parallel loss.
TP_STYLES = {"attn.qkv": "column", "attn.o": "row", "mlp.gate_up": "column", "mlp.down": "row",
             "shared.gate_up": "column", "shared.down": "row", HEAD: "column"}
# Weights no TP style splits: a mixture of experts' router (whole on every rank) and its experts
# (3-D; split over expert parallel instead: EXPERTS; trainer.plan.axis_costs.tensor refuses TP).
EXPERTS = "mlp.experts"
WHOLE = ("mlp.router", EXPERTS)
EXPERT_BIAS = "mlp.router.expert_bias"  # a buffer: DeepSeek-V3's auxiliary-loss-free bias


def parallel_plan(cfg: ModelConfig) -> ParallelPlan:
    """The plan of the Transformer built from `cfg` (its fused parts depend on the shape)."""
    # Fused parts by relative size: q|k|v (heads, groups, groups) and gate|up, so their TP
    # split keeps each part's rows together.
    fused = {"attn.qkv": cfg.qkv_heads, "mlp.gate_up": (1, 1), "shared.gate_up": (1, 1)}
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
        experts=(EXPERTS,) if cfg.num_moe_experts is not None else (),
        # [E, 2F, h]: each expert's gate|up rows split alike; [E, h, F]: its inputs split
        expert_splits={"gate_up": (1, (1, 1)), "down": (2, (1,))},
    )


def tp_style(name: str) -> str:
    """The TP style of linear module `name` (the same for every model shape), or "whole"."""
    if name.endswith(WHOLE):
        return "whole"
    return by_suffix(TP_STYLES, name)


def block_shapes(cfg: ModelConfig, block: int = 0) -> dict[str, tuple[int, ...]]:
    """Block `block`'s parameter shapes, by name within the block (a dense block or a mixture
    of experts, model.moe_layer_freq)."""
    h, f, q = cfg.hidden_size, cfg.ffn_hidden_size, cfg.q_size
    norms = {"attn.q_norm.weight": (cfg.head_dim,), "attn.k_norm.weight": (cfg.head_dim,)} \
        if cfg.qk_layernorm else {}
    shapes = {"attn_norm.weight": (h,), "mlp_norm.weight": (h,),
              "attn.qkv.weight": (q + 2 * cfg.kv_size, h), "attn.o.weight": (h, q), **norms}
    if not cfg.is_moe_block(block):
        return shapes | {"mlp.gate_up.weight": (2 * f, h), "mlp.down.weight": (h, f)}
    E, fe, shared = cfg.num_moe_experts, cfg.expert_ffn_size, \
        cfg.moe_shared_expert_intermediate_size
    shapes |= {"mlp.router.weight": (E, h), "mlp.experts.gate_up": (E, 2 * fe, h),
               "mlp.experts.down": (E, h, fe)}
    if shared:
        shapes |= {"mlp.shared.gate_up.weight": (2 * shared, h),
                   "mlp.shared.down.weight": (h, shared)}
    return shapes


def buffer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The Transformer's named_buffers() shapes from the config alone: each mixture-of-experts
    router's expert bias (model.moe_router_enable_expert_bias). A checkpoint saves them beside
    the weights (trainer.checkpoint.match checks they are there)."""
    if not cfg.moe_router_enable_expert_bias:
        return {}
    return {f"{BLOCKS}.{i}.{EXPERT_BIAS}": (cfg.num_moe_experts,) for i in range(cfg.num_layers)
            if cfg.is_moe_block(i)}


def block_buffer_bytes(cfg: ModelConfig) -> list[int]:
    """Each block's buffers (fp32, whole on every rank): a router's expert bias."""
    return [4 * cfg.num_moe_experts if cfg.is_moe_block(block)
            and cfg.moe_router_enable_expert_bias else 0 for block in range(cfg.num_layers)]


def block_weight_elements(cfg: ModelConfig) -> float:
    """A block's weight elements each token multiplies by (the cost model's W), averaged over
    the blocks: its linears', and of a mixture of experts the router's and moe_router_topk
    experts' (each token runs that many)."""
    if cfg.num_moe_experts is None:  # every block alike (the search asks this often)
        return sum(math.prod(s) for s in block_shapes(cfg).values() if len(s) == 2)
    total = 0.0
    for block in range(cfg.num_layers):
        for shape in block_shapes(cfg, block).values():
            if len(shape) == 2:
                total += math.prod(shape)
            elif len(shape) == 3:  # experts: a token passes through topk of them
                total += math.prod(shape) * cfg.moe_router_topk / cfg.num_moe_experts
    return total / cfg.num_layers


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The Transformer's named_parameters() shapes, in its order, from the config alone (no
    torch): the memory plan and the layout search size a rank from them at compose time
    (tests/unit/test_model.py holds them equal to the built model's). A tied head is the
    embedding's parameter, so it has no entry of its own."""
    h, vocab = cfg.hidden_size, cfg.padded_vocab_size
    shapes: dict[str, tuple[int, ...]] = {f"{EMBEDDING}.weight": (vocab, h)}
    for i in range(cfg.num_layers):
        shapes |= {f"{BLOCKS}.{i}.{name}": shape for name, shape in block_shapes(cfg, i).items()}
    shapes[f"{FINAL_NORM}.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes[f"{HEAD}.weight"] = (vocab, h)
    return shapes
