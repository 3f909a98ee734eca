"""Qwen3-Next's config.json (Qwen3NextForCausalLM, model_type qwen3_next) and Qwen3.5's text
model's (Qwen3_5ForCausalLM, model_type qwen3_5_text: the same block, dense, its linear blocks'
projections stored by part) <-> ModelConfig: the hybrid's layer pattern (layer_types, or
full_attention_interval) and its Gated DeltaNet's widths, gated attention with partial rotary,
zero-centred norms, and experts with a gated shared expert (or a dense MLP where num_experts is
0). Their HfMappings are trainer.checkpoint.hf_families' (MAPPINGS["qwen3_next"], ["qwen3_5"]);
their tensors' names are the parts' (trainer.parts.gdn's, attention's, moe's with the family's
shared_expert), their conv1d weights 3-D on disk and Qwen3-Next's input projections grouped by
key head (layouts).
"""
from __future__ import annotations

from typing import Any

from trainer.checkpoint.hf_fields import BOOL, INT, INTS, NUMBER, REQUIRED, TEXTS, Fields
from trainer.checkpoint.hf_layout import Layout, reordered
from trainer.config import ModelConfig
from trainer.parts.families import FAMILIES

LINEAR, FULL = "linear_attention", "full_attention"
DEFAULT_INTERVAL = 4  # Qwen3NextConfig's full_attention_interval
# Our key <- their field, the linear blocks' widths (Megatron's names are theirs plus model.)
WIDTHS = {"linear_conv_kernel_dim": "linear_conv_kernel_dim",
          "linear_key_head_dim": "linear_key_head_dim",
          "linear_value_head_dim": "linear_value_head_dim",
          "linear_num_key_heads": "linear_num_key_heads",
          "linear_num_value_heads": "linear_num_value_heads"}
# The keys only this family's config.json holds (architecture_of refuses them elsewhere).
HYBRID_KEYS = ("experimental_attention_variant", "attention_output_gate",
               "moe_shared_expert_gate")


def read(fields: Fields, need) -> dict:
    values = fields.values
    layers = values["num_hidden_layers"]
    types = fields.get("layer_types", TEXTS)
    if types is None:
        every = fields.get("full_attention_interval", INT, DEFAULT_INTERVAL)
        types = [LINEAR if (i + 1) % every else FULL for i in range(layers)]
    need("layer_types", len(types) == layers and set(types) <= {LINEAR, FULL},
         f"give one of {LINEAR!r} or {FULL!r} per layer, {layers} in all")
    pattern = [int(t == LINEAR) for t in types]
    every = types.index(FULL) + 1 if FULL in types else 0
    regular = every >= 2 and all(bool(p) == bool((i + 1) % every) for i, p in enumerate(pattern))
    rope = fields.inner("rope_parameters")
    partial = rope.get("partial_rotary_factor", NUMBER) or \
        fields.get("partial_rotary_factor", NUMBER, 0.25)
    experts = fields.get("num_experts", INT, 0)
    need("attention_bias", not fields.get("attention_bias", BOOL, False),
         "import a model without attention biases")
    out = {"qk_layernorm": True, "attention_output_gate": True,
           "layernorm_zero_centered_gamma": True,
           "experimental_attention_variant": "gated_delta_net",
           "linear_attention_freq": every if regular else pattern,
           "rotary_percent": float(partial),
           **{ours: fields.get(theirs, INT, REQUIRED) for ours, theirs in WIDTHS.items()}}
    if not experts:
        return out
    step = fields.get("decoder_sparse_step", INT, 1)
    dense = set(fields.get("mlp_only_layers", INTS, []))
    moe = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    return out | {
        "num_moe_experts": experts,
        "moe_router_topk": fields.get("num_experts_per_tok", INT, REQUIRED),
        "moe_ffn_hidden_size": fields.get("moe_intermediate_size", INT, REQUIRED),
        "moe_shared_expert_intermediate_size": fields.get("shared_expert_intermediate_size",
                                                          INT, REQUIRED),
        "moe_shared_expert_gate": True,
        "moe_router_pre_softmax": not fields.get("norm_topk_prob", BOOL, True),
        "moe_layer_freq": 1 if all(moe) else moe,
        "moe_aux_loss_coeff": float(fields.get("router_aux_loss_coef", NUMBER, 0.0))}


def write(model: ModelConfig) -> dict:
    types = [LINEAR if model.is_linear_block(i) else FULL for i in range(model.num_layers)]
    rope = {"rope_type": "default", "rope_theta": model.rope_theta,
            "partial_rotary_factor": model.rotary_percent}
    out = {"layer_types": types, "rope_parameters": rope,
           "partial_rotary_factor": model.rotary_percent,
           **{theirs: getattr(model, ours) for ours, theirs in WIDTHS.items()}}
    if model.name == "qwen3_5":  # its config has no experts' fields
        return out
    if model.num_moe_experts is None:
        return out | {"num_experts": 0, "mlp_only_layers": [],
                      "decoder_sparse_step": 1}
    return out | {
        "num_experts": model.num_moe_experts, "num_experts_per_tok": model.moe_router_topk,
        "moe_intermediate_size": model.expert_ffn_size,
        "shared_expert_intermediate_size": model.moe_shared_expert_intermediate_size,
        "norm_topk_prob": not model.moe_router_pre_softmax, "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(model.num_layers) if not model.is_moe_block(i)],
        "router_aux_loss_coef": model.moe_aux_loss_coeff}


def holds(model: ModelConfig) -> list[tuple[str, Any, bool]]:
    """Qwen3-Next is its block, every key of it (the family's rules ask the same); its router a
    softmax, unscaled, with no expert bias or groups."""
    experts = model.num_moe_experts is not None
    return [("moe_router_score_function", model.moe_router_score_function,
             model.moe_router_score_function == "softmax"),
            ("moe_router_topk_scaling_factor", model.moe_router_topk_scaling_factor,
             model.moe_router_topk_scaling_factor in (None, 1.0)),
            ("moe_router_enable_expert_bias", model.moe_router_enable_expert_bias,
             not model.moe_router_enable_expert_bias),
            ("moe_router_num_groups", model.moe_router_num_groups,
             model.moe_router_num_groups is None),
            ("moe_shared_expert_gate", model.moe_shared_expert_gate,
             model.moe_shared_expert_gate or not experts)]


def layouts(model: ModelConfig) -> dict[str, Layout]:
    """Each linear block's conv1d weight: [channels, 1, width] on disk, our [channels, width];
    its in_proj_qkvz and in_proj_ba grouped by key head (each key head's q, k, then its value
    heads' v and z; its value heads' b then a), ours by part (all q, all k, all v, all z;
    all b, all a: Megatron's in_proj order)."""
    channels = 2 * model.linear_key_size + model.linear_value_size
    width = model.linear_conv_kernel_dim
    conv = Layout(lambda t: t.reshape(channels, width),
                  lambda rows: rows.reshape(channels, 1, width), (channels, 1, width))
    grouped = len(FAMILIES[model.name].linear_in) == 2  # Qwen3.5's are by part already
    qkvz, ba = (reordered(order) for order in grouped_orders(model)) if grouped else (None, None)
    out = {}
    for i in range(model.num_layers):
        if model.is_linear_block(i):
            la = f"model.layers.{i}.linear_attn."
            out[f"{la}conv1d.weight"] = conv
            if grouped:
                out |= {f"{la}in_proj_qkvz.weight": qkvz, f"{la}in_proj_ba.weight": ba}
    return out


def grouped_orders(model: ModelConfig) -> tuple[list[int], list[int]]:
    """Our rows as theirs (ours = theirs[order]) of in_proj_qkvz and of in_proj_ba."""
    keys, dk, dv = model.linear_num_key_heads, model.linear_key_head_dim, \
        model.linear_value_head_dim
    share = model.linear_num_value_heads // keys
    group = 2 * dk + 2 * share * dv  # one key head's rows of in_proj_qkvz
    parts = ((0, dk), (dk, dk), (2 * dk, share * dv), (2 * dk + share * dv, share * dv))
    qkvz = [g * group + start + i for start, rows in parts for g in range(keys)
            for i in range(rows)]
    ba = [g * 2 * share + start + i for start in (0, share) for g in range(keys)
          for i in range(share)]
    return qkvz, ba


def not_held(model: ModelConfig) -> list[tuple[str, Any, bool]]:
    """The hybrid's keys and partial rotary, which another family's config.json cannot hold."""
    return [*((key, getattr(model, key), not getattr(model, key)) for key in HYBRID_KEYS),
            ("rotary_percent", model.rotary_percent, model.rotary_percent == 1.0)]
