"""The model assembled from its parts, from the config alone: its parameters' shapes and its
parallelize plan (which of the Transformer's modules parallel code replaces and how, by module
name). parallel/ applies the plan without knowing the model; the memory plan and the search
read the shapes."""
from __future__ import annotations

import math

from parallel.layout.parallel_plan import ParallelPlan, by_suffix
from trainer.config import ModelConfig, PeftConfig
from trainer.parts import PARTS, block_parts, model_parts
from trainer.parts.lora import (
    ADAPTERS,
    block_lora_shapes,
    expert_splits,
    is_adapter,
    plan_entries,
)
from trainer.parts.mtp import EH_PROJ, MTP, depth_shapes, depths
from trainer.parts.norm import block_norms

EMBEDDING, HEAD, BLOCKS, FINAL_NORM = "embed", "head", "layers", "norm"
# Module-name suffix -> TP style, of every registered part (by slot) and the head, whose
# vocab-parallel logits feed the vocab-parallel loss.
# LoRA's adapters (trainer.parts.lora): each split factor as a linear of its own, (1,) parts.
ADAPTER_STYLES, WHOLE_ADAPTERS = plan_entries()
TP_STYLES = {**{name: style for part in PARTS for name, style in
                zip(part.prefixed(part.tp_styles), part.tp_styles.values())}, HEAD: "column",
             **{name: style for name, (style, _) in ADAPTER_STYLES.items()}}
# Weights no TP style splits: a mixture of experts' router (whole on every rank) and its experts
# (3-D; split over expert parallel instead: EXPERTS; trainer.plan.axis_costs.tensor refuses TP),
# multi-latent attention's down-projections and multi-token prediction's eh_proj (whole on
# every rank).
WHOLE = (*(name for part in PARTS for name in part.prefixed(part.whole)), EH_PROJ, *WHOLE_ADAPTERS)
# Linears whose weights optim=muon leaves to AdamW (a router), by module-name suffix.
ADAMW_LINEARS = tuple(name for part in PARTS for name in part.prefixed(part.adamw_linears))
# Buffers by name within a block, of every registered part (what a checkpoint may hold beside
# the weights: trainer.checkpoint.match tells them from a dropped weight).
BUFFER_NAMES = tuple(name for part in PARTS for name in part.prefixed(part.buffer_names))
# Parameters on a residual branch's output (their init std shrinks with depth).
RESIDUAL_OUTPUTS = tuple(name for part in PARTS for name in part.prefixed(part.residual_outputs))
# Parameters whose initial values a part gives otherwise (Part.initial), by name suffix.
INITIAL = {name: rule for part in PARTS
           for name, rule in zip(part.prefixed(part.initial), part.initial.values())}


def parallel_plan(cfg: ModelConfig) -> ParallelPlan:
    """The plan of the Transformer built from `cfg` (its fused parts depend on the shape)."""
    fused = {name: sizes for part in PARTS
             for name, sizes in zip(part.prefixed(part.fused(cfg)), part.fused(cfg).values())}
    return ParallelPlan(
        linears={name: (style, fused.get(name, (1,))) for name, style in TP_STYLES.items()},
        embedding=EMBEDDING,  # vocab-parallel: rows split over TP like the head
        head=HEAD,
        blocks=BLOCKS,  # the transformer blocks by index: one weight-gather bundle each
        mtp=MTP if depths(cfg) else None,
        final_norm=FINAL_NORM,
        hidden_size=cfg.hidden_size,
        recompute_hooks=tuple(dict.fromkeys(p.hook for p in PARTS if p.hook)),
        whole_linears=WHOLE,
        tp_shared_hooks=tuple(dict.fromkeys(p.tp_shared for p in PARTS if p.tp_shared)),
        tp_heads_hooks=tuple(dict.fromkeys(p.tp_heads for p in PARTS if p.tp_heads)),
        head_norms=tuple(n for p in PARTS for n in p.prefixed(p.head_norms)),
        experts=tuple(name for part in model_parts(cfg) for name in part.prefixed(part.experts)),
        expert_splits={**{name: split for part in PARTS for name, split in
                          part.expert_splits.items()}, **expert_splits()},
    )


def tp_style(name: str) -> str:
    """The TP style of linear module `name` (the same for every model shape), or "whole"."""
    if name.endswith(WHOLE):
        return "whole"
    return by_suffix(TP_STYLES, name)


def block_shapes(cfg: ModelConfig, block: int = 0, peft: PeftConfig | None = None
                 ) -> dict[str, tuple[int, ...]]:
    """Block `block`'s parameter shapes, by name within the block, in its order: its norms
    (two, four with sandwich_norm), then its attention's and its MLP's
    (trainer.parts.block_parts), each followed by its LoRA adapters under peft=lora."""
    parts = block_parts(cfg, block)
    shapes = {f"{norm}.{name}": shape for norm in block_norms(cfg)
              for name, shape in parts.norm.shapes(cfg).items()}
    adapters = block_lora_shapes(cfg, peft, block) if peft else {}
    for part in (parts.attention, parts.mlp):
        shapes |= _with_adapters(part.slot_shapes(cfg), {
            n: s for n, s in adapters.items() if n.startswith(f"{part.slot}.")})
    return shapes


def _with_adapters(own: dict[str, tuple[int, ...]], adapters: dict[str, tuple[int, ...]]
                   ) -> dict[str, tuple[int, ...]]:
    """A part's parameters and its adapters in the built model's order: the adapters after
    the part's own, but the routed experts' (3-D) right after the experts' weights, as
    submodules of the Experts module (before a shared expert)."""
    experts = {n: s for n, s in adapters.items() if len(s) == 3}
    rest = {n: s for n, s in adapters.items() if len(s) != 3}
    if not experts:
        return own | rest
    owner = next(iter(experts)).rpartition(ADAPTERS)[0].rpartition(".")[0] + "."
    keys = list(own)
    cut = 1 + max(i for i, k in enumerate(keys) if k.startswith(owner))
    return {**{k: own[k] for k in keys[:cut]}, **experts,
            **{k: own[k] for k in keys[cut:]}, **rest}


def buffer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The Transformer's named_buffers() shapes from the config alone: each mixture-of-experts
    router's expert bias (model.moe_router_enable_expert_bias). A checkpoint saves them beside
    the weights (trainer.checkpoint.match checks they are there)."""
    last = block_parts(cfg, cfg.num_layers - 1)
    return {**{f"{BLOCKS}.{i}.{name}": shape for i in range(cfg.num_layers)
               for part in block_parts(cfg, i) for name, shape in part.slot_buffers(cfg).items()},
            **{f"{MTP}.depths.{d}.block.{name}": shape for d in range(depths(cfg))
               for part in last for name, shape in part.slot_buffers(cfg).items()}}


def block_buffer_bytes(cfg: ModelConfig) -> list[int]:
    """Each block's buffers (fp32, whole on every rank): a router's expert bias."""
    return [sum(4 * math.prod(shape) for part in block_parts(cfg, block)
                for shape in part.buffers(cfg).values()) for block in range(cfg.num_layers)]


def block_weight_elements(cfg: ModelConfig) -> float:
    """A block's weight elements each token multiplies by (the cost model's W), averaged over
    the blocks: its linears', and of a mixture of experts the router's and moe_router_topk
    experts' (each token runs that many)."""
    if cfg.num_moe_experts is None and cfg.experimental_attention_variant is None:
        # every block alike (the search asks this often)
        return sum(math.prod(s) for s in block_shapes(cfg).values() if len(s) == 2)
    return sum(_elements_a_token_runs(cfg, block_shapes(cfg, block))
               for block in range(cfg.num_layers)) / cfg.num_layers


def _elements_a_token_runs(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> float:
    """Of these shapes, the weight elements one token multiplies by: every 2-D weight, and of
    the experts moe_router_topk of num_moe_experts."""
    total = 0.0
    for shape in shapes.values():
        if len(shape) == 2:
            total += math.prod(shape)
        elif len(shape) == 3:  # experts: a token passes through topk of them
            total += math.prod(shape) * cfg.moe_router_topk / cfg.num_moe_experts
    return total


def mtp_token_flops(cfg: ModelConfig, seq_length: int) -> float:
    """Multi-token prediction's forward FLOPs per token, all its depths: each depth's linears
    (eh_proj and its block, of the last block's kind) 2*W, its block's core FLOPs, and the
    head 2*h*V (trainer.parts.mtp)."""
    last = block_shapes(cfg, cfg.num_layers - 1)
    one = (2 * _elements_a_token_runs(cfg, depth_shapes(cfg, last))
           + sum(part.core_flops(cfg, seq_length, cfg.window_of(cfg.num_layers - 1))
                 for part in block_parts(cfg, cfg.num_layers - 1))
           + 2 * cfg.hidden_size * cfg.padded_vocab_size)
    return depths(cfg) * one


def block_core_flops(cfg: ModelConfig, seq_length: int) -> float:
    """A block's forward FLOPs per token beyond its weights' (its parts' core_flops: the
    attention's QK^T and AV, over the keys its window lets a query see), averaged over the
    blocks."""
    if cfg.num_moe_experts is None and cfg.window_size is None and \
            cfg.experimental_attention_variant is None:  # every block alike (the search)
        return sum(part.core_flops(cfg, seq_length) for part in block_parts(cfg, 0))
    return sum(part.core_flops(cfg, seq_length, cfg.window_of(block))
               for block in range(cfg.num_layers)
               for part in block_parts(cfg, block)) / cfg.num_layers


def parameter_shapes(cfg: ModelConfig, peft: PeftConfig | None = None
                     ) -> dict[str, tuple[int, ...]]:
    """The Transformer's named_parameters() shapes, in its order, from the config alone (no
    torch): the memory plan and the layout search size a rank from them at compose time
    (tests/unit/test_model.py holds them equal to the built model's). A tied head is the
    embedding's parameter, so it has no entry of its own. peft=lora: with the adapters."""
    h, vocab = cfg.hidden_size, cfg.padded_vocab_size
    shapes: dict[str, tuple[int, ...]] = {f"{EMBEDDING}.weight": (vocab, h)}
    for i in range(cfg.num_layers):
        shapes |= {f"{BLOCKS}.{i}.{name}": shape
                   for name, shape in block_shapes(cfg, i, peft).items()}
    shapes[f"{FINAL_NORM}.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes[f"{HEAD}.weight"] = (vocab, h)
    last = block_shapes(cfg, cfg.num_layers - 1)
    for d in range(depths(cfg)):  # multi-token prediction's depths (trainer.parts.mtp)
        shapes |= {f"{MTP}.depths.{d}.{name}": shape
                   for name, shape in depth_shapes(cfg, last).items()}
    return shapes


def kept_in_bf16(name: str, shape: tuple[int, ...]) -> bool:
    """peft.base_precision=bf16: whether parameter `name` is held in bf16, a frozen matrix (a
    projection, an untied head, the experts). The embedding and the norms stay fp32 (the
    residual stream is fp32), and the adapters train in fp32."""
    return len(shape) >= 2 and not is_adapter(name) and not name.startswith(f"{EMBEDDING}.")
