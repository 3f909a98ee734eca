"""DeepSeek-V3's config.json (DeepseekV3ForCausalLM; Kimi K2's and Moonlight's too) <->
ModelConfig: multi-latent attention, YaRN, DeepSeek's router and multi-token prediction's
depths; what transformers would compute and we would not is refused in one line. Its HfMapping
is trainer.checkpoint.hf_families' (MAPPINGS["deepseek_v3"]); its tensors' names are the
parts' (trainer.parts.mla, moe, mtp)."""
from __future__ import annotations

from typing import Any

from trainer.checkpoint.hf_fields import BOOL, INT, NUMBER, REQUIRED, TEXT, Fields
from trainer.config import ModelConfig
from trainer.parts import mtp

# DeepSeek-V3's multi-latent attention fields: a config.json of the architecture lacking them
# is another model's relabelled.
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim")
# Architectures we know and do not build, with what they need.
UNBUILT_VARIANTS = {"DeepseekV32ForCausalLM": "DeepSeek-V3.2's sparse attention (its "
                                              "lightning indexer)"}
INDEXER_FIELDS = ("index_topk", "index_n_heads", "index_head_dim")  # DeepSeek-V3.2's


def read(fields: Fields, need) -> dict:
    """Multi-latent attention, and experts after the first first_k_dense_replace blocks (none:
    a dense model)."""
    values = fields.values
    need("architectures", all(key in values for key in MLA_FIELDS),
         f"a DeepseekV3ForCausalLM config.json names its multi-latent attention's "
         f"{', '.join(MLA_FIELDS)}; use the config.json save_pretrained wrote for the model")
    for key in INDEXER_FIELDS:
        need(key, key not in values, f"import a model without "
             f"{UNBUILT_VARIANTS['DeepseekV32ForCausalLM']}, which this trainer does not build")
    fields.get("rope_interleave", BOOL)  # its type; row_orders reads it
    # Every head has its own key and value, expanded from the latent, whatever
    # num_key_value_heads says (transformers' SDPA path reads the heads from the tensors);
    # head_dim is the rotary part's.
    mla = {"multi_latent_attention": True, "num_query_groups": None, "kv_channels": None,
           "q_lora_rank": fields.get("q_lora_rank", INT),
           "kv_lora_rank": fields.get("kv_lora_rank", INT, REQUIRED),
           "qk_head_dim": fields.get("qk_nope_head_dim", INT, REQUIRED),
           "qk_pos_emb_head_dim": fields.get("qk_rope_head_dim", INT, REQUIRED),
           "v_head_dim": fields.get("v_head_dim", INT, REQUIRED),
           # multi-token prediction's depths, layers num_hidden_layers.. of the files (an
           # import whose files hold none of them drops it: trainer.checkpoint.hf)
           "mtp_num_layers": fields.get("num_nextn_predict_layers", INT, 0) or None}
    dense = fields.get("first_k_dense_replace", INT, REQUIRED)
    if dense >= values["num_hidden_layers"]:
        return mla
    return mla | _read_experts(fields, need, dense)


def _read_experts(fields: Fields, need, dense: int) -> dict:
    """DeepSeek-V3's router as transformers computes it: sigmoid scores, the expert bias
    (e_score_correction_bias) choosing, the top-k normalised and scaled, groups ranked by their
    2 best scores; the sequence-wise balance loss of DeepSeek's own config.json."""
    # DeepSeek's own config.json fields, which transformers ignores: it would build
    # DeepSeek-V3's routing and blocks whatever they say
    for key, kind, want in (("scoring_func", TEXT, "sigmoid"), ("topk_method", TEXT, "noaux_tc"),
                            ("moe_layer_freq", INT, 1)):
        need(key, fields.get(key, kind, want) == want,
             f"import a model that routes as DeepSeek-V3 ({key} {want}), the one "
             f"transformers' DeepseekV3ForCausalLM builds")
    k = fields.get("num_experts_per_tok", INT, REQUIRED)
    need("norm_topk_prob", fields.get("norm_topk_prob", BOOL, REQUIRED) == (k > 1),
         "import a model whose top-k weights are normalised: a sigmoid router here normalises "
         "them" if k > 1 else "with num_experts_per_tok=1 a normalised weight is 1 and ours "
         "the expert's score: import a model with norm_topk_prob false")
    groups, chosen = fields.get("n_group", INT, REQUIRED), fields.get("topk_group", INT, REQUIRED)
    limited = chosen < groups
    need("topk_group", not limited or k // chosen == 2,
         f"transformers ranks each of the n_group={groups} groups by its 2 best scores, this "
         f"trainer (as Megatron) by num_experts_per_tok / topk_group = {k // chosen}: import a "
         f"model whose num_experts_per_tok is twice its topk_group (DeepSeek-V3's 8 and 4), or "
         f"whose topk_group is its n_group")
    shared, ffn = (fields.get("n_shared_experts", INT, REQUIRED),
                   fields.get("moe_intermediate_size", INT, REQUIRED))
    need("n_shared_experts", shared >= 1, "import a model with a shared expert, as DeepSeek-V3")
    layers = fields.values["num_hidden_layers"]
    return {"num_moe_experts": fields.get("n_routed_experts", INT, REQUIRED),
            "moe_router_topk": k, "moe_ffn_hidden_size": ffn,
            "moe_shared_expert_intermediate_size": shared * ffn,
            "moe_layer_freq": [int(i >= dense) for i in range(layers)] if dense else 1,
            "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
            "moe_router_topk_scaling_factor": float(fields.get("routed_scaling_factor", NUMBER,
                                                               REQUIRED)),
            "moe_router_num_groups": groups if limited else None,
            "moe_router_group_topk": chosen if limited else None,
            "moe_router_load_balancing_type": "seq_aux_loss" if fields.get("seq_aux", BOOL, True)
            else "aux_loss",
            "moe_aux_loss_coeff": float(fields.get("aux_loss_alpha", NUMBER, 0.0))}


def _leading_dense(model: ModelConfig) -> int:
    """The blocks before the first mixture of experts (DeepSeek's first_k_dense_replace)."""
    return next((i for i in range(model.num_layers) if model.is_moe_block(i)), model.num_layers)


def write(model: ModelConfig) -> dict:
    """What transformers needs to build the same model (a dense one: every block before
    first_k_dense_replace), in interleaved rotary rows (row_orders), with the multi-token
    prediction layers (transformers builds none: it skips their weights); DeepSeek's own router
    fields too, for its reference code."""
    r = model.qk_pos_emb_head_dim
    out = {"q_lora_rank": model.q_lora_rank, "kv_lora_rank": model.kv_lora_rank,
           "qk_nope_head_dim": model.qk_head_dim, "qk_rope_head_dim": r,
           "v_head_dim": model.v_head_dim, "head_dim": r, "rope_interleave": True,
           "num_nextn_predict_layers": mtp.depths(model),
           "first_k_dense_replace": _leading_dense(model)}
    if model.rope_type == "yarn":  # the context YaRN stretches to (transformers checks it)
        out["max_position_embeddings"] = round(model.original_max_position_embeddings
                                               * model.rotary_scaling_factor)
    if model.num_moe_experts is None:
        return out
    ffn, groups = model.expert_ffn_size, model.moe_router_num_groups
    return out | {
        "n_routed_experts": model.num_moe_experts, "num_experts_per_tok": model.moe_router_topk,
        "moe_intermediate_size": ffn,
        "n_shared_experts": model.moe_shared_expert_intermediate_size // ffn,
        "routed_scaling_factor": model.moe_router_topk_scaling_factor or 1.0,
        "n_group": groups or 1, "topk_group": model.moe_router_group_topk if groups else 1,
        "norm_topk_prob": model.moe_router_topk > 1, "scoring_func": "sigmoid",
        "topk_method": "noaux_tc", "moe_layer_freq": 1,
        "aux_loss_alpha": model.moe_aux_loss_coeff,
        "seq_aux": model.moe_router_load_balancing_type == "seq_aux_loss"}


def holds(model: ModelConfig) -> list[tuple[str, Any, bool]]:
    """transformers' YaRN scales cos and sin by mscale / mscale_all_dim only with both set
    (else YaRN's default, our mscale 1); its router is DeepSeek-V3's (_read_experts),
    with the first blocks dense and every later one MoE."""
    all_dim, yarn = model.mscale_all_dim, model.rope_type == "yarn"
    out = [("use_rope_scaling", model.use_rope_scaling, not model.use_rope_scaling),
           ("mscale", model.mscale, not yarn or (model.mscale != 0 if all_dim
                                                 else model.mscale == 1.0))]
    if model.num_moe_experts is None:
        return out
    dense, shared = _leading_dense(model), model.moe_shared_expert_intermediate_size
    groups, chosen = model.moe_router_num_groups, model.moe_router_group_topk
    return out + [
        ("moe_router_score_function", model.moe_router_score_function,
         model.moe_router_score_function == "sigmoid"),
        ("moe_router_enable_expert_bias", model.moe_router_enable_expert_bias,
         model.moe_router_enable_expert_bias),
        ("moe_shared_expert_intermediate_size", shared,
         bool(shared) and shared % model.expert_ffn_size == 0),
        ("moe_layer_freq", model.moe_layer_freq,
         all(model.is_moe_block(i) == (i >= dense) for i in range(model.num_layers))),
        ("moe_router_group_topk", chosen,
         groups is None or chosen >= groups or model.moe_router_topk // chosen == 2)]


def yarn_keys(scaling: Fields, fields: Fields) -> dict:
    """Our YaRN keys of a rope scaling as transformers reads it (beta_fast 32 and beta_slow 1
    where unset, the original context max_position_embeddings where unset, the ramp's ends
    rounded unless truncate is false); what it would compute that ours cannot is refused in one
    line. DeepSeek-V3's and gpt-oss's alike."""
    values = scaling.values

    def refuse(why: str) -> None:
        raise ValueError(f"{scaling.source}: rope scaling {values} is not supported: {why}. "
                         f"Fix: import a model with YaRN's rope scaling as DeepSeek-V3 or "
                         f"gpt-oss write it, or none.")
    if values.get("rope_type", values.get("type")) != "yarn":
        refuse("only YaRN (rope_type yarn) is modelled for this architecture")
    if "attention_factor" in values:
        refuse("an attention_factor of its own (ours follows from mscale and mscale_all_dim)")
    mscale, all_dim = (float(scaling.get(key, NUMBER, 0.0)) for key in ("mscale",
                                                                         "mscale_all_dim"))
    if all_dim and not mscale:
        refuse("mscale_all_dim without mscale (cos and sin then take YaRN's default scale "
               "while the softmax takes mscale_all_dim's)")
    return {"rope_type": "yarn", "rotary_scaling_factor": float(scaling.get("factor", NUMBER,
                                                                            REQUIRED)),
            "original_max_position_embeddings": scaling.get("original_max_position_embeddings",
                                                            INT)
            or fields.get("max_position_embeddings", INT, 4096),
            "beta_fast": float(scaling.get("beta_fast", NUMBER) or 32.0),
            "beta_slow": float(scaling.get("beta_slow", NUMBER) or 1.0),
            # without mscale_all_dim, transformers scales cos and sin by YaRN's default
            # 0.1 ln(factor) + 1 whatever mscale says: our mscale 1
            "mscale": mscale if all_dim else 1.0, "mscale_all_dim": all_dim,
            "yarn_correction_range_round_to_int": scaling.get("truncate", BOOL, True)}
