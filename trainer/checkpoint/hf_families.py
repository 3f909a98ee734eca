"""The Hugging Face families we import and export, and how each maps onto ours: config.json <->
ModelConfig, and each of our parameters as the row-wise concatenation of theirs. Reading and
writing the tensors is trainer.checkpoint.hf's.

    LlamaForCausalLM       our dense block
    Qwen3ForCausalLM       Llama's with q_norm and k_norm (model.qk_layernorm)
    MixtralForCausalLM     a mixture of experts in every block: softmax over the top-k logits
    Qwen3MoeForCausalLM    Qwen3's attention, experts (norm_topk_prob: normalised top-k, that is
                           moe_router_pre_softmax=false) and dense blocks in mlp_only_layers
    DeepseekV3ForCausalLM  multi-latent attention, YaRN, the first first_k_dense_replace
                           blocks dense, then experts routed by sigmoid scores with the expert
                           bias (a buffer of ours), groups and a shared expert (Kimi K2's and
                           Moonlight's architecture too); its interleaved rotary rows are
                           reordered (row_orders), its multi-token prediction layers (layers
                           num_hidden_layers.. of num_nextn_predict_layers) our mtp.depths
    GptOssForCausalLM      biases, sinks, sliding windows by layer_types, YaRN with truncate;
                           experts in every block, fused, transposed, gate and up interleaved
                           (their Layouts: trainer.checkpoint.hf_gpt_oss)
    Gemma3ForCausalLM      Gemma 3's text model (trainer.checkpoint.hf_gemma3)
    Qwen3NextForCausalLM   the hybrid: Gated DeltaNet blocks by layer_types between gated
                           full attention (trainer.checkpoint.hf_qwen3_next)
    Qwen3_5ForCausalLM     Qwen3.5's text model: the same block, dense (ditto)

Which of their tensors each of our parameters is comes from the model's parts (trainer.parts:
each part names its own); the family (trainer.parts.families) gives a model.name to an imported
architecture and the names of its experts, and its HfMapping here (MAPPINGS) the config.json
fields only it reads and writes (DeepSeek-V3's, the most, in trainer.checkpoint.hf_deepseek;
config.json's typed fields in trainer.checkpoint.hf_fields), the names its files give where
they are not the parts' and the tensors they lay out otherwise than our rows (layouts).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from trainer.checkpoint import hf_deepseek, hf_gemma3, hf_gpt_oss, hf_qwen3_next
from trainer.checkpoint.hf_fields import (
    BOOL,
    INT,
    INTS,
    MAPPING,
    NUMBER,
    REQUIRED,
    TEXT,
    TEXTS,
    Fields,
)
from trainer.checkpoint.hf_layout import Layout, reordered
from trainer.checks import check_model
from trainer.config import ModelConfig
from trainer.parts import block_parts, mtp
from trainer.parts.attention import LLAMA3_ROPE_CONTEXT, LLAMA3_ROPE_HIGH, LLAMA3_ROPE_LOW
from trainer.parts.families import (
    ARCHITECTURES,
    BY_ARCHITECTURE,
    LLAMA,
    hf_family,
)
from trainer.parts.part import HfNames

REQUIRED_INTS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "intermediate_size")


def model_config(hf: dict, source: Path) -> ModelConfig:
    """Our ModelConfig of a Hugging Face config.json; what we cannot model is refused in one
    line naming the key, and so is a field of the wrong type."""
    def need(key: str, ok: bool, fix: str) -> None:
        if not ok:
            raise ValueError(f"{source}: {key}={hf.get(key)!r} is not supported. Fix: {fix}.")

    fields = Fields(hf, source)
    architecture = (fields.get("architectures", TEXTS, None) or [LLAMA])[0]  # [] too
    unbuilt_variants = hf_deepseek.UNBUILT_VARIANTS | hf_gemma3.UNBUILT_VARIANTS
    if architecture in unbuilt_variants:
        raise ValueError(f"{source}: architectures={[architecture]} needs "
                         f"{unbuilt_variants[architecture]}, which this trainer "
                         f"does not build. Fix: import a model of one of "
                         f"{', '.join(ARCHITECTURES)}.")
    need("architectures", architecture in ARCHITECTURES,
         f"import a model of one of {', '.join(ARCHITECTURES)}")
    family = BY_ARCHITECTURE[architecture]
    mapping = MAPPINGS[family.name]
    need("use_sliding_window", not fields.get("use_sliding_window", BOOL, False),
         "use a model with full attention in every layer")
    for key in REQUIRED_INTS:
        fields.get(key, INT, REQUIRED)
    need("hidden_act", mapping.own_keys or fields.get("hidden_act", TEXT, "silu") == "silu",
         "use a SwiGLU (silu) model")
    for key in ("attention_bias", "mlp_bias"):
        need(key, mapping.biases or not fields.get(key, BOOL, False),
             "use a model without biases")
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    head_dim = fields.get("head_dim", INT) or hidden // heads
    rope = fields.inner("rope_parameters")  # transformers 5; 4 spells rope_theta/rope_scaling
    scaling = fields.inner("rope_scaling") if fields.get("rope_scaling", MAPPING) else (
        rope if rope.get("rope_type", TEXT, "default") != "default" else None)
    groups = fields.get("num_key_value_heads", INT) or heads
    shared = dict(
        name=family.name, vocab_size=hf["vocab_size"], hidden_size=hidden,
        num_layers=hf["num_hidden_layers"], num_heads=heads,
        ffn_hidden_size=hf["intermediate_size"],
        rope_theta=float(rope.get("rope_theta", NUMBER,
                                  fields.get("rope_theta", NUMBER, 10000.0))),
        norm_eps=float(fields.get("rms_norm_eps", NUMBER, 1e-6)),
        init_std=float(fields.get("initializer_range", NUMBER, 0.02)),
        num_query_groups=None if groups == heads else groups,
        tie_word_embeddings=fields.get("tie_word_embeddings", BOOL, False),
        kv_channels=None if head_dim * heads == hidden else head_dim)
    rotary = {}
    if scaling is not None and mapping.rope_scaling == "yarn":
        rotary = hf_deepseek.yarn_keys(scaling, fields)
    elif scaling is not None and mapping.rope_scaling == "llama3":
        rotary = {"use_rope_scaling": True, "rope_scaling_factor": _llama3_rope_factor(scaling)}
    # the family's own fields last: they may replace shared ones (multi-latent attention's
    # num_key_value_heads and head_dim mean nothing of ours)
    model = ModelConfig(**(shared | rotary | mapping.read(fields, need)))
    try:
        check_model(model)
    except ValueError as error:
        raise ValueError(f"{source} gives a model we cannot build: {error}") from None
    return model


@dataclass(frozen=True)
class HfMapping:
    """One family's own part of config.json <-> ModelConfig (the fields every family shares are
    model_config's and hf_config's): what it reads, what it writes, and the keys of ours it
    cannot hold on export (key, value, whether it holds it)."""

    model_type: str
    read: Callable[[Fields, Callable], dict] = lambda fields, need: {}
    write: Callable[[ModelConfig], dict] = lambda model: {}
    holds: Callable[[ModelConfig], list[tuple[str, Any, bool]]] = lambda model: []
    intermediate_is_experts: bool = False  # its intermediate_size is an expert's (Mixtral)
    # the rope scaling its config.json may hold: llama3 or yarn (own: its read maps it)
    rope_scaling: str = "llama3"
    # its files hold multi-token prediction layers after the last block (DeepSeek's
    # num_nextn_predict_layers)
    mtp: bool = False
    # its files hold linear biases (gpt-oss's): its read maps attention_bias
    biases: bool = False
    # a block's names where its files differ from the parts' (ours and theirs: the block's
    # prefixes; gpt-oss's fused experts), replacing the parts' names of the same parameters
    names: Callable[[ModelConfig, str, str], HfNames] = lambda model, ours, theirs: {}
    # its tensors laid out otherwise than our rows, by their name (gpt-oss's experts)
    layouts: Callable[[ModelConfig], dict[str, Layout]] = lambda model: {}
    # its own read, write and holds map the MLP activation's keys, the linear biases, windows
    # and sinks (else a SwiGLU without biases, hidden_act silu, full attention, is all it holds)
    own_keys: bool = False
    # its own read, write and holds map Gemma's block keys (hf_gemma3.GEMMA_KEYS; else it holds
    # none of them)
    gemma_block: bool = False
    # its own read, write and holds map the hybrid's keys (hf_qwen3_next.HYBRID_KEYS, partial
    # rotary; its norms zero-centred); else it holds none of them
    hybrid: bool = False


def _read_mixtral(fields: Fields, need) -> dict:
    need("sliding_window", fields.get("sliding_window", INT) is None,
         "use a model with full attention in every layer")
    need("router_jitter_noise", not fields.get("router_jitter_noise", NUMBER),
         "use a model without router noise (it trains with none here)")
    return {"num_moe_experts": fields.get("num_local_experts", INT, REQUIRED),
            "moe_router_topk": fields.get("num_experts_per_tok", INT, REQUIRED),
            "moe_aux_loss_coeff": float(fields.get("router_aux_loss_coef", NUMBER, 0.0))}


def _read_qwen3_moe(fields: Fields, need) -> dict:
    layers = fields.values["num_hidden_layers"]
    step = fields.get("decoder_sparse_step", INT, 1)
    dense = set(fields.get("mlp_only_layers", INTS, []))
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts
    experts = fields.get("num_experts", INT) or fields.get("num_local_experts", INT, REQUIRED)
    return {"qk_layernorm": True, "num_moe_experts": experts,
            "moe_router_topk": fields.get("num_experts_per_tok", INT, REQUIRED),
            "moe_ffn_hidden_size": fields.get("moe_intermediate_size", INT),
            "moe_router_pre_softmax": not fields.get("norm_topk_prob", BOOL, True),
            "moe_layer_freq": 1 if all(pattern) else pattern,
            "moe_aux_loss_coeff": float(fields.get("router_aux_loss_coef", NUMBER, 0.0))}


def _full_attention(model: ModelConfig) -> dict:
    return {"use_sliding_window": False, "max_window_layers": model.num_layers}


def _write_mixtral(model: ModelConfig) -> dict:
    return {"num_local_experts": model.num_moe_experts,
            "num_experts_per_tok": model.moe_router_topk, "router_jitter_noise": 0.0,
            "sliding_window": None, "router_aux_loss_coef": model.moe_aux_loss_coeff}


def _write_qwen3_moe(model: ModelConfig) -> dict:
    return {"num_experts": model.num_moe_experts, "num_experts_per_tok": model.moe_router_topk,
            "moe_intermediate_size": model.expert_ffn_size,
            "norm_topk_prob": not model.moe_router_pre_softmax, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(model.num_layers) if not model.is_moe_block(i)],
            **_full_attention(model), "router_aux_loss_coef": model.moe_aux_loss_coeff}


def _softmax_router_holds(model: ModelConfig) -> list[tuple[str, Any, bool]]:
    """Mixtral's and Qwen3-MoE's router: a softmax, unscaled, with no shared expert, expert
    bias or groups."""
    return [
        ("moe_router_score_function", model.moe_router_score_function,
         model.moe_router_score_function == "softmax"),
        ("moe_router_topk_scaling_factor", model.moe_router_topk_scaling_factor,
         model.moe_router_topk_scaling_factor in (None, 1.0)),
        ("moe_shared_expert_intermediate_size", model.moe_shared_expert_intermediate_size,
         model.moe_shared_expert_intermediate_size is None),
        ("moe_router_enable_expert_bias", model.moe_router_enable_expert_bias,
         not model.moe_router_enable_expert_bias),
        ("moe_router_num_groups", model.moe_router_num_groups,
         model.moe_router_num_groups is None)]


def _mixtral_holds(model: ModelConfig) -> list[tuple[str, Any, bool]]:
    """Mixtral has no unnormalised top-k and no dense block."""
    every_block = all(model.is_moe_block(i) for i in range(model.num_layers))
    return [*_softmax_router_holds(model),
            ("moe_router_pre_softmax", model.moe_router_pre_softmax,
             not model.moe_router_pre_softmax),
            ("moe_layer_freq", model.moe_layer_freq, every_block)]


# Each family's mapping, by model.name (tests/integration/test_hf.py checks each against
# transformers; a family without one cannot be imported or exported).
MAPPINGS = {
    "llama": HfMapping("llama"),
    "qwen3": HfMapping("qwen3", read=lambda fields, need: {"qk_layernorm": True},
                       write=_full_attention),
    "mixtral": HfMapping("mixtral", read=_read_mixtral, write=_write_mixtral,
                         holds=_mixtral_holds, intermediate_is_experts=True),
    "qwen3_moe": HfMapping("qwen3_moe", read=_read_qwen3_moe, write=_write_qwen3_moe,
                           holds=_softmax_router_holds),
    "deepseek_v3": HfMapping("deepseek_v3", read=hf_deepseek.read, write=hf_deepseek.write,
                             holds=hf_deepseek.holds, rope_scaling="yarn", mtp=True),
    "gpt_oss": HfMapping("gpt_oss", read=hf_gpt_oss.read, write=hf_gpt_oss.write,
                         holds=hf_gpt_oss.holds, intermediate_is_experts=True,
                         rope_scaling="yarn", biases=True, own_keys=True,
                         names=hf_gpt_oss.names, layouts=hf_gpt_oss.layouts),
    "gemma3": HfMapping("gemma3_text", read=hf_gemma3.read, write=hf_gemma3.write,
                        holds=hf_gemma3.holds, rope_scaling="own", own_keys=True,
                        gemma_block=True),
    "qwen3_next": HfMapping("qwen3_next", read=hf_qwen3_next.read, write=hf_qwen3_next.write,
                            holds=hf_qwen3_next.holds, layouts=hf_qwen3_next.layouts,
                            hybrid=True),
    "qwen3_5": HfMapping("qwen3_5_text", read=hf_qwen3_next.read, write=hf_qwen3_next.write,
                         holds=hf_qwen3_next.holds, layouts=hf_qwen3_next.layouts, hybrid=True),
}


def _llama3_rope_factor(scaling: Fields) -> float:
    """The factor of Llama 3's rope scaling; any other scaling is refused (it would change
    every position's rotation, silently)."""
    kind = scaling.values.get("rope_type", scaling.values.get("type"))
    fixed = {"low_freq_factor": LLAMA3_ROPE_LOW, "high_freq_factor": LLAMA3_ROPE_HIGH,
             "original_max_position_embeddings": LLAMA3_ROPE_CONTEXT}
    if kind != "llama3" or any(float(scaling.get(k, NUMBER, v)) != v for k, v in fixed.items()):
        raise ValueError(f"{scaling.source}: rope scaling {scaling.values} is not supported: "
                         f"only Llama 3's (rope_type llama3 with {fixed}) is modelled. Fix: "
                         f"import a model with that rope scaling or none.")
    return float(scaling.get("factor", NUMBER, REQUIRED))


def _swiglu_holds(model: ModelConfig) -> list[tuple[str, Any, bool]]:
    """hidden_act silu: a plain SwiGLU, no offset, no clamp; no biases; full attention without
    sinks (their config.json has no window or sinks that transformers would apply)."""
    return [("add_bias_linear", model.add_bias_linear, not model.add_bias_linear),
            ("add_qkv_bias", model.add_qkv_bias, not model.add_qkv_bias),
            ("activation_func", model.activation_func, model.activation_func == "silu"),
            ("glu_linear_offset", model.glu_linear_offset, not model.glu_linear_offset),
            ("activation_func_clamp_value", model.activation_func_clamp_value,
             model.activation_func_clamp_value is None),
            ("window_size", model.window_size, model.window_size is None),
            ("softmax_type", model.softmax_type, model.softmax_type == "vanilla")]


def architecture_of(model: ModelConfig) -> str:
    """The family an export writes; what it cannot hold (a router, a rope scaling, a block) is
    refused in one line."""
    family = hf_family(model)
    architecture, mapping = family.architecture or LLAMA, MAPPINGS[family.name]
    unmapped = [(k, v) for k, v, ok in (
        ("rope_type", model.rope_type, model.rope_type == "rope"
         or mapping.rope_scaling == "yarn"),
        ("mtp_num_layers", model.mtp_num_layers, model.mtp_num_layers is None or mapping.mtp),
        *([] if mapping.own_keys else _swiglu_holds(model)),
        *([] if mapping.gemma_block else [
            held for held in hf_gemma3.not_held(model)  # Qwen3-Next's norms are zero-centred
            if not (mapping.hybrid and held[0] == "layernorm_zero_centered_gamma")]),
        *([] if mapping.hybrid else hf_qwen3_next.not_held(model)),
        *mapping.holds(model)) if not ok]
    if unmapped:
        key, value = unmapped[0]
        raise ValueError(f"model.{key}={value!r}: {architecture} (the Hugging Face family "
                         f"this model exports as) has no such setting. Fix: export a model that "
                         f"{architecture} can hold.")
    return architecture


def hf_config(model: ModelConfig, dtype: torch.dtype) -> dict:
    """config.json for transformers (both rope spellings, 4 and 5)."""
    architecture = architecture_of(model)
    rope = {"rope_type": "default", "rope_theta": model.rope_theta}
    scaling = None
    if model.use_rope_scaling:
        scaling = {"rope_type": "llama3", "factor": model.rope_scaling_factor,
                   "low_freq_factor": LLAMA3_ROPE_LOW, "high_freq_factor": LLAMA3_ROPE_HIGH,
                   "original_max_position_embeddings": LLAMA3_ROPE_CONTEXT}
    elif model.rope_type == "yarn":
        scaling = {"rope_type": "yarn", "factor": model.rotary_scaling_factor,
                   "original_max_position_embeddings": model.original_max_position_embeddings,
                   "beta_fast": model.beta_fast, "beta_slow": model.beta_slow}
        if model.mscale_all_dim:  # else transformers' default scale, our mscale 1 (holds)
            scaling |= {"mscale": model.mscale, "mscale_all_dim": model.mscale_all_dim}
        if not model.yarn_correction_range_round_to_int:  # the ramp unrounded (gpt-oss's)
            scaling["truncate"] = False
    if scaling:
        rope = {**scaling, "rope_theta": model.rope_theta}
    mapping = MAPPINGS[hf_family(model).name]
    dense_ffn = model.expert_ffn_size if mapping.intermediate_is_experts else model.ffn_hidden_size
    return {
        "architectures": [architecture], "model_type": mapping.model_type,
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size, "intermediate_size": dense_ffn,
        "num_hidden_layers": model.num_layers, "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.query_groups, "head_dim": model.head_dim,
        "hidden_act": "silu", "rms_norm_eps": model.norm_eps, "rope_theta": model.rope_theta,
        "rope_parameters": rope, "rope_scaling": scaling,
        "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": model.tie_word_embeddings, "initializer_range": model.init_std,
        "dtype": str(dtype).removeprefix("torch."),
        **mapping.write(model),  # last: a family's own spelling of a shared field wins
    }


def hf_parts(model: ModelConfig) -> dict[str, list[tuple[str, int]]]:
    """Our parameter name -> the Hugging Face tensors it is the row-wise concatenation of (of
    the parameter viewed 2-D: [rows, its last dim]), with their rows: each block's parts name
    theirs (trainer.parts). The vocabulary rows are the unpadded ones."""
    h, vocab, family = model.hidden_size, model.vocab_size, hf_family(model)
    mapping = MAPPINGS[family.name]
    out = {"embed.weight": [("model.embed_tokens.weight", vocab)]}
    for i in range(model.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        for part in block_parts(model, i):
            out |= part.hf_names(model, ours, theirs, family)
        out |= mapping.names(model, ours, theirs)
    out["norm.weight"] = [("model.norm.weight", h)]
    if not model.tie_word_embeddings:
        out["head.weight"] = [("lm_head.weight", vocab)]
    for d in range(mtp.depths(model)):  # layers after the last block, of the last block's kind
        ours, theirs = f"mtp.depths.{d}.", f"model.layers.{model.num_layers + d}."
        out |= mtp.hf_names(model, ours, theirs)
        for part in block_parts(model, model.num_layers - 1):
            out |= part.hf_names(model, f"{ours}block.", theirs, family)
        out |= mapping.names(model, f"{ours}block.", theirs)
    return out


def hf_copies(model: ModelConfig) -> dict[str, str]:
    """What DeepSeek's files repeat in each multi-token prediction layer: the model's embedding
    and head (vLLM and SGLang read the model's own instead), name -> the tensor it copies. An
    import checks them equal and keeps one; an export writes them."""
    head = "model.embed_tokens.weight" if model.tie_word_embeddings else "lm_head.weight"
    return {name: source for d in range(mtp.depths(model))
            for name, source in ((f"model.layers.{model.num_layers + d}.embed_tokens.weight",
                                  "model.embed_tokens.weight"),
                                 (f"model.layers.{model.num_layers + d}.shared_head.head.weight",
                                  head))}


def row_orders(model: ModelConfig, config: dict) -> dict[str, list[int]]:
    """Hugging Face tensor name -> the order its rows take as ours (ours = theirs[order]), for
    the tensors whose rows the two lay out differently (`config`: their config.json). DeepSeek's
    rotary dims are interleaved pairs (rope_interleave, transformers' default) where our rotary
    turns halves (trainer.model.rotary): each q head's rotary rows and kv_down's are
    de-interleaved on import and interleaved back on export, a permutation, bit for bit."""
    if not model.multi_latent_attention or config.get("rope_interleave") is False:
        return {}
    nope, r, latent = model.qk_head_dim, model.qk_pos_emb_head_dim, model.kv_lora_rank
    halves = [*range(0, r, 2), *range(1, r, 2)]  # pair j's two dims: ours j and r/2 + j
    q = [head * (nope + r) + d for head in range(model.num_heads)
         for d in (*range(nope), *(nope + j for j in halves))]
    kv = [*range(latent), *(latent + j for j in halves)]
    parts, orders = hf_parts(model), {}
    for attn in (*(f"layers.{i}.attn." for i in range(model.num_layers)),
                 *(f"mtp.depths.{d}.block.attn." for d in range(mtp.depths(model)))):
        (q_name, _), = parts.get(f"{attn}q_up.weight") or parts[f"{attn}q.weight"]
        (kv_name, _), = parts[f"{attn}kv_down.weight"]
        orders |= {q_name: q, kv_name: kv}
    return orders


def layouts(model: ModelConfig, config: dict) -> dict[str, Layout]:
    """Hugging Face tensor name -> how its files lay it out, for the tensors they do not hold
    as our rows (`config`: their config.json): the family's own (gpt-oss's fused experts) and
    DeepSeek's rotary rows (row_orders). trainer.checkpoint.hf applies them both ways."""
    return ({name: reordered(order) for name, order in row_orders(model, config).items()}
            | MAPPINGS[hf_family(model).name].layouts(model))


def layers_from(names: set[str], first: int) -> list[str]:
    """The tensors of layers numbered `first` and up (model.layers.<i>.), sorted."""
    return sorted(n for n in names if (m := re.match(r"model\.layers\.(\d+)\.", n))
                  and int(m[1]) >= first)


def unbuilt(model: ModelConfig, names: set[str]) -> str | None:
    """What tensors beyond the model's are, where known: a DeepSeek layer past its blocks and
    multi-token prediction layers (num_hidden_layers + num_nextn_predict_layers); None
    otherwise."""
    first = model.num_layers + mtp.depths(model)
    past = layers_from(names, first)
    if not past or not MAPPINGS[hf_family(model).name].mtp:
        return None
    return (f"{len(past)} tensors of layers from {first} on (e.g. {past[0]!r}), past the "
            f"num_hidden_layers + num_nextn_predict_layers = {model.num_layers} + "
            f"{mtp.depths(model)} layers its config.json names")
