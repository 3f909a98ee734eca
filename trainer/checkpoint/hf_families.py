"""The Hugging Face families we import and export, and how each maps onto ours: config.json <->
ModelConfig, and each of our parameters as the row-wise concatenation of theirs. Reading and
writing the tensors is trainer.checkpoint.hf's.

    LlamaForCausalLM       our dense block
    Qwen3ForCausalLM       Llama's with q_norm and k_norm (model.qk_layernorm)
    MixtralForCausalLM     a mixture of experts in every block: softmax over the top-k logits
    Qwen3MoeForCausalLM    Qwen3's attention, experts (norm_topk_prob: normalised top-k, that is
                           moe_router_pre_softmax=false) and dense blocks in mlp_only_layers

Our experts are [E, 2F, h] and [E, h, F]; theirs are per expert on disk (gate, up and down
projections), so expert e's gate and up are rows 2Fe.. of our first weight and its down rows
he.. of the second, viewed 2-D.
"""
from __future__ import annotations

from pathlib import Path

import torch

from trainer.checks import check_model
from trainer.config import ModelConfig
from trainer.model.transformer import LLAMA3_ROPE_CONTEXT, LLAMA3_ROPE_HIGH, LLAMA3_ROPE_LOW

LLAMA, QWEN3 = "LlamaForCausalLM", "Qwen3ForCausalLM"
MIXTRAL, QWEN3_MOE = "MixtralForCausalLM", "Qwen3MoeForCausalLM"
ARCHITECTURES = (LLAMA, QWEN3, MIXTRAL, QWEN3_MOE)
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "intermediate_size")
# Each MoE family's names: the MoE module in a layer, and its experts' gate, up and down.
EXPERT_NAMES = {MIXTRAL: ("block_sparse_moe", ("w1", "w3", "w2")),
                QWEN3_MOE: ("mlp", ("gate_proj", "up_proj", "down_proj"))}


def model_config(hf: dict, source: Path) -> ModelConfig:
    """Our ModelConfig of a Hugging Face config.json; what we cannot model is refused in one
    line naming the key."""
    def need(key: str, ok: bool, fix: str) -> None:
        if not ok:
            raise ValueError(f"{source}: {key}={hf.get(key)!r} is not supported. Fix: {fix}.")

    architecture = (hf.get("architectures") or [LLAMA])[0]
    need("architectures", architecture in ARCHITECTURES,
         f"import a model of one of {', '.join(ARCHITECTURES)}")
    need("use_sliding_window", not hf.get("use_sliding_window", False),
         "use a model with full attention in every layer")
    need("sliding_window", architecture != MIXTRAL or hf.get("sliding_window") is None,
         "use a model with full attention in every layer")
    missing = [key for key in REQUIRED if not isinstance(hf.get(key), int)]
    if missing:
        raise ValueError(f"{source} has no integer {missing[0]}. Fix: use the config.json "
                         f"save_pretrained wrote for the model.")
    need("hidden_act", hf.get("hidden_act", "silu") == "silu", "use a SwiGLU (silu) model")
    for key in ("attention_bias", "mlp_bias"):
        need(key, not hf.get(key, False), "use a model without biases")
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    head_dim = hf.get("head_dim") or hidden // heads
    rope = hf.get("rope_parameters") or {}  # transformers 5; 4 spells it rope_theta/rope_scaling
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                         else None)
    factor = _llama3_rope_factor(scaling, source) if scaling else None
    groups = hf.get("num_key_value_heads") or heads
    model = ModelConfig(
        name="llama", vocab_size=hf["vocab_size"], hidden_size=hidden,
        num_layers=hf["num_hidden_layers"], num_heads=heads,
        ffn_hidden_size=hf["intermediate_size"],
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        init_std=float(hf.get("initializer_range", 0.02)),
        num_query_groups=None if groups == heads else groups,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        use_rope_scaling=factor is not None, rope_scaling_factor=factor or 8.0,
        kv_channels=None if head_dim * heads == hidden else head_dim,
        qk_layernorm=architecture in (QWEN3, QWEN3_MOE), **_experts(hf, architecture, need))
    try:
        check_model(model)
    except ValueError as error:
        raise ValueError(f"{source} gives a model we cannot build: {error}") from None
    return model


def _experts(hf: dict, architecture: str, need) -> dict:
    """The MoE keys of a Mixtral or Qwen3-MoE config (none for a dense family)."""
    if architecture == MIXTRAL:
        need("router_jitter_noise", not hf.get("router_jitter_noise"),
             "use a model without router noise (it trains with none here)")
        return {"num_moe_experts": hf.get("num_local_experts"),
                "moe_router_topk": hf.get("num_experts_per_tok"),
                "moe_aux_loss_coeff": float(hf.get("router_aux_loss_coef", 0.0))}
    if architecture != QWEN3_MOE:
        return {}
    layers, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1)
    dense = set(hf.get("mlp_only_layers") or [])
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts
    return {"num_moe_experts": hf.get("num_experts", hf.get("num_local_experts")),
            "moe_router_topk": hf.get("num_experts_per_tok"),
            "moe_ffn_hidden_size": hf.get("moe_intermediate_size"),
            "moe_router_pre_softmax": not hf.get("norm_topk_prob", True),
            "moe_layer_freq": 1 if all(pattern) else pattern,
            "moe_aux_loss_coeff": float(hf.get("router_aux_loss_coef", 0.0))}


def _llama3_rope_factor(scaling: dict, source: Path) -> float:
    """The factor of Llama 3's rope scaling; any other scaling is refused (it would change
    every position's rotation, silently)."""
    kind = scaling.get("rope_type", scaling.get("type"))
    fixed = {"low_freq_factor": LLAMA3_ROPE_LOW, "high_freq_factor": LLAMA3_ROPE_HIGH,
             "original_max_position_embeddings": LLAMA3_ROPE_CONTEXT}
    if kind != "llama3" or any(float(scaling.get(k, v)) != v for k, v in fixed.items()):
        raise ValueError(f"{source}: rope scaling {scaling} is not supported: only Llama 3's "
                         f"(rope_type llama3 with {fixed}) is modelled. Fix: import a model "
                         f"with that rope scaling or none.")
    return float(scaling["factor"])


def architecture_of(model: ModelConfig) -> str:
    """The family an export writes; a router no family has is refused in one line."""
    if model.num_moe_experts is None:
        return QWEN3 if model.qk_layernorm else LLAMA
    family = QWEN3_MOE if model.qk_layernorm else MIXTRAL
    every_block = all(model.is_moe_block(i) for i in range(model.num_layers))
    unmapped = [(k, v) for k, v, ok in (
        ("moe_router_score_function", model.moe_router_score_function,
         model.moe_router_score_function == "softmax"),
        ("moe_router_topk_scaling_factor", model.moe_router_topk_scaling_factor,
         model.moe_router_topk_scaling_factor in (None, 1.0)),
        ("moe_shared_expert_intermediate_size", model.moe_shared_expert_intermediate_size,
         model.moe_shared_expert_intermediate_size is None),
        ("moe_router_enable_expert_bias", model.moe_router_enable_expert_bias,
         not model.moe_router_enable_expert_bias),
        ("moe_router_pre_softmax", model.moe_router_pre_softmax,
         family == QWEN3_MOE or not model.moe_router_pre_softmax),
        ("moe_layer_freq", model.moe_layer_freq, family == QWEN3_MOE or every_block)) if not ok]
    if unmapped:
        key, value = unmapped[0]
        raise ValueError(f"model.{key}={value!r}: {family} (the family of a mixture of experts "
                         f"{'with' if model.qk_layernorm else 'without'} qk_layernorm) has no "
                         f"such router or block. Fix: export a model that {family} can hold.")
    return family


def hf_config(model: ModelConfig, dtype: torch.dtype) -> dict:
    """config.json for transformers (both rope spellings, 4 and 5)."""
    architecture = architecture_of(model)
    rope = {"rope_type": "default", "rope_theta": model.rope_theta}
    scaling = None
    if model.use_rope_scaling:
        scaling = {"rope_type": "llama3", "factor": model.rope_scaling_factor,
                   "low_freq_factor": LLAMA3_ROPE_LOW, "high_freq_factor": LLAMA3_ROPE_HIGH,
                   "original_max_position_embeddings": LLAMA3_ROPE_CONTEXT}
        rope = {**scaling, "rope_theta": model.rope_theta}
    family = {LLAMA: {"model_type": "llama"},
              QWEN3: {"model_type": "qwen3"},
              MIXTRAL: {"model_type": "mixtral", "num_local_experts": model.num_moe_experts,
                        "num_experts_per_tok": model.moe_router_topk, "router_jitter_noise": 0.0,
                        "sliding_window": None},
              QWEN3_MOE: {"model_type": "qwen3_moe", "num_experts": model.num_moe_experts,
                          "num_experts_per_tok": model.moe_router_topk,
                          "moe_intermediate_size": model.expert_ffn_size,
                          "norm_topk_prob": not model.moe_router_pre_softmax,
                          "decoder_sparse_step": 1, "mlp_only_layers": [
                              i for i in range(model.num_layers) if not model.is_moe_block(i)]},
              }[architecture]
    if architecture in (QWEN3, QWEN3_MOE):
        family |= {"use_sliding_window": False, "max_window_layers": model.num_layers}
    if model.num_moe_experts is not None:
        family["router_aux_loss_coef"] = model.moe_aux_loss_coeff
    dense_ffn = model.expert_ffn_size if architecture == MIXTRAL else model.ffn_hidden_size
    return {
        "architectures": [architecture], **family, "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size, "intermediate_size": dense_ffn,
        "num_hidden_layers": model.num_layers, "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.query_groups, "head_dim": model.head_dim,
        "hidden_act": "silu", "rms_norm_eps": model.norm_eps, "rope_theta": model.rope_theta,
        "rope_parameters": rope, "rope_scaling": scaling,
        "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": model.tie_word_embeddings, "initializer_range": model.init_std,
        "dtype": str(dtype).removeprefix("torch."),
    }


def hf_parts(model: ModelConfig) -> dict[str, list[tuple[str, int]]]:
    """Our parameter name -> the Hugging Face tensors it is the row-wise concatenation of (of
    the parameter viewed 2-D: [rows, its last dim]), with their rows. The vocabulary rows are
    the unpadded ones."""
    h, kv, f, vocab = model.hidden_size, model.kv_size, model.ffn_hidden_size, model.vocab_size
    q, d = model.q_size, model.head_dim
    out = {"embed.weight": [("model.embed_tokens.weight", vocab)]}
    for i in range(model.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        out |= {
            f"{ours}attn_norm.weight": [(f"{theirs}input_layernorm.weight", h)],
            f"{ours}attn.qkv.weight": [(f"{theirs}self_attn.{p}_proj.weight", rows)
                                       for p, rows in (("q", q), ("k", kv), ("v", kv))],
            f"{ours}attn.o.weight": [(f"{theirs}self_attn.o_proj.weight", h)],
            **({f"{ours}attn.{p}_norm.weight": [(f"{theirs}self_attn.{p}_norm.weight", d)]
                for p in ("q", "k")} if model.qk_layernorm else {}),
            f"{ours}mlp_norm.weight": [(f"{theirs}post_attention_layernorm.weight", h)],
        }
        if model.is_moe_block(i):
            out |= _expert_parts(model, ours, theirs)
        else:
            out |= {f"{ours}mlp.gate_up.weight": [(f"{theirs}mlp.{p}_proj.weight", f)
                                                  for p in ("gate", "up")],
                    f"{ours}mlp.down.weight": [(f"{theirs}mlp.down_proj.weight", h)]}
    out["norm.weight"] = [("model.norm.weight", h)]
    if not model.tie_word_embeddings:
        out["head.weight"] = [("lm_head.weight", vocab)]
    return out


def _expert_parts(model: ModelConfig, ours: str, theirs: str) -> dict:
    E, f, h = model.num_moe_experts, model.expert_ffn_size, model.hidden_size
    module, (gate, up, down) = EXPERT_NAMES[QWEN3_MOE if model.qk_layernorm else MIXTRAL]
    experts = f"{theirs}{module}.experts"
    return {
        f"{ours}mlp.router.weight": [(f"{theirs}{module}.gate.weight", E)],
        f"{ours}mlp.experts.gate_up": [(f"{experts}.{e}.{p}.weight", f)
                                       for e in range(E) for p in (gate, up)],
        f"{ours}mlp.experts.down": [(f"{experts}.{e}.{down}.weight", h) for e in range(E)],
    }
