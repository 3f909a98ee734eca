"""The Hugging Face families we import and export, and how each maps onto ours: config.json <->
ModelConfig, and each of our parameters as the row-wise concatenation of theirs. Reading and
writing the tensors is trainer.checkpoint.hf's.

    LlamaForCausalLM       our dense block
    Qwen3ForCausalLM       Llama's with q_norm and k_norm (model.qk_layernorm)
    MixtralForCausalLM     a mixture of experts in every block: softmax over the top-k logits
    Qwen3MoeForCausalLM    Qwen3's attention, experts (norm_topk_prob: normalised top-k, that is
                           moe_router_pre_softmax=false) and dense blocks in mlp_only_layers

Which of their tensors each of our parameters is comes from the model's parts (trainer.parts:
each part names its own); the family (trainer.parts.families) gives a model.name to an imported
architecture and the names of its experts, and its HfMapping here (MAPPINGS) the config.json
fields only it reads and writes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from trainer.checks import check_model
from trainer.config import ModelConfig
from trainer.parts import block_parts
from trainer.parts.attention import LLAMA3_ROPE_CONTEXT, LLAMA3_ROPE_HIGH, LLAMA3_ROPE_LOW
from trainer.parts.families import (
    ARCHITECTURES,
    BY_ARCHITECTURE,
    LLAMA,
    hf_family,
)

REQUIRED_INTS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "intermediate_size")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# What a config.json field must hold: a name for the message, and the test.
INT = ("an integer", _is_int)
NUMBER = ("a number", lambda v: _is_int(v) or isinstance(v, float))
BOOL = ("true or false", lambda v: isinstance(v, bool))
TEXT = ("a string", lambda v: isinstance(v, str))
MAPPING = ("a mapping", lambda v: isinstance(v, dict))
INTS = ("a list of integers", lambda v: isinstance(v, list) and all(map(_is_int, v)))
TEXTS = ("a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str)
                                                                       for x in v))
REQUIRED = object()  # a field get() must find


class Fields:
    """A config.json's fields, each read as the type it must hold: a string where a number
    belongs ("8") is one line naming the file, the field, the value and the fix."""

    def __init__(self, values: dict, source: Path, within: str = ""):
        self.values, self.source, self.within = values, source, within

    def get(self, key: str, kind: tuple[str, Any], default: Any = None) -> Any:
        """The field's value; absent or null: `default` (REQUIRED: refused)."""
        value = self.values.get(key)
        if value is None:
            if default is REQUIRED:
                what = kind[0].split(" ", 1)[1]  # "an integer": "has no integer vocab_size"
                raise ValueError(f"{self.source} has no {what} {self.within}{key}. Fix: use the "
                                 f"config.json save_pretrained wrote for the model.")
            return default
        if not kind[1](value):
            raise ValueError(f"{self.source}: {self.within}{key}={json.dumps(value)} is not "
                             f"{kind[0]}. "
                             f"Fix: write it as {kind[0]}{_as_number(value, kind)}, as "
                             f"save_pretrained does.")
        return value

    def inner(self, key: str) -> Fields:
        """A mapping field's own fields (rope_parameters)."""
        return Fields(self.get(key, MAPPING, {}), self.source, f"{self.within}{key}.")


def _as_number(value: Any, kind: tuple[str, Any]) -> str:
    """' (8)' for the string "8" where a number belongs."""
    try:
        number = (int if kind is INT else float)(value) if isinstance(value, str) else None
    except ValueError:
        return ""
    return f" ({number})" if number is not None and kind in (INT, NUMBER) else ""


def model_config(hf: dict, source: Path) -> ModelConfig:
    """Our ModelConfig of a Hugging Face config.json; what we cannot model is refused in one
    line naming the key, and so is a field of the wrong type."""
    def need(key: str, ok: bool, fix: str) -> None:
        if not ok:
            raise ValueError(f"{source}: {key}={hf.get(key)!r} is not supported. Fix: {fix}.")

    fields = Fields(hf, source)
    architecture = (fields.get("architectures", TEXTS, None) or [LLAMA])[0]  # [] too
    need("architectures", architecture in ARCHITECTURES,
         f"import a model of one of {', '.join(ARCHITECTURES)}")
    family = BY_ARCHITECTURE[architecture]
    need("use_sliding_window", not fields.get("use_sliding_window", BOOL, False),
         "use a model with full attention in every layer")
    for key in REQUIRED_INTS:
        fields.get(key, INT, REQUIRED)
    need("hidden_act", fields.get("hidden_act", TEXT, "silu") == "silu",
         "use a SwiGLU (silu) model")
    for key in ("attention_bias", "mlp_bias"):
        need(key, not fields.get(key, BOOL, False), "use a model without biases")
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    head_dim = fields.get("head_dim", INT) or hidden // heads
    rope = fields.inner("rope_parameters")  # transformers 5; 4 spells rope_theta/rope_scaling
    scaling = fields.inner("rope_scaling") if fields.get("rope_scaling", MAPPING) else (
        rope if rope.get("rope_type", TEXT, "default") != "default" else None)
    factor = _llama3_rope_factor(scaling) if scaling else None
    groups = fields.get("num_key_value_heads", INT) or heads
    model = ModelConfig(
        name=family.name, vocab_size=hf["vocab_size"], hidden_size=hidden,
        num_layers=hf["num_hidden_layers"], num_heads=heads,
        ffn_hidden_size=hf["intermediate_size"],
        rope_theta=float(rope.get("rope_theta", NUMBER,
                                  fields.get("rope_theta", NUMBER, 10000.0))),
        norm_eps=float(fields.get("rms_norm_eps", NUMBER, 1e-6)),
        init_std=float(fields.get("initializer_range", NUMBER, 0.02)),
        num_query_groups=None if groups == heads else groups,
        tie_word_embeddings=fields.get("tie_word_embeddings", BOOL, False),
        use_rope_scaling=factor is not None, rope_scaling_factor=factor or 8.0,
        kv_channels=None if head_dim * heads == hidden else head_dim,
        **MAPPINGS[family.name].read(fields, need))
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


def _mixtral_holds(model: ModelConfig) -> list[tuple[str, Any, bool]]:
    """Mixtral has no unnormalised top-k and no dense block."""
    every_block = all(model.is_moe_block(i) for i in range(model.num_layers))
    return [("moe_router_pre_softmax", model.moe_router_pre_softmax,
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
    "qwen3_moe": HfMapping("qwen3_moe", read=_read_qwen3_moe, write=_write_qwen3_moe),
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


def architecture_of(model: ModelConfig) -> str:
    """The family an export writes; a router no family has is refused in one line."""
    family = hf_family(model)
    architecture = family.architecture or LLAMA
    if model.num_moe_experts is None:
        return architecture
    unmapped = [(k, v) for k, v, ok in (
        ("moe_router_score_function", model.moe_router_score_function,
         model.moe_router_score_function == "softmax"),
        ("moe_router_topk_scaling_factor", model.moe_router_topk_scaling_factor,
         model.moe_router_topk_scaling_factor in (None, 1.0)),
        ("moe_shared_expert_intermediate_size", model.moe_shared_expert_intermediate_size,
         model.moe_shared_expert_intermediate_size is None),
        ("moe_router_enable_expert_bias", model.moe_router_enable_expert_bias,
         not model.moe_router_enable_expert_bias),
        ("moe_router_num_groups", model.moe_router_num_groups,
         model.moe_router_num_groups is None),
        *MAPPINGS[family.name].holds(model)) if not ok]
    if unmapped:
        key, value = unmapped[0]
        raise ValueError(f"model.{key}={value!r}: {architecture} (the family of a mixture of "
                         f"experts {'with' if model.qk_layernorm else 'without'} qk_layernorm) "
                         f"has no such router or block. Fix: export a model that "
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
        rope = {**scaling, "rope_theta": model.rope_theta}
    mapping = MAPPINGS[hf_family(model).name]
    dense_ffn = model.expert_ffn_size if mapping.intermediate_is_experts else model.ffn_hidden_size
    family = {"model_type": mapping.model_type, **mapping.write(model)}
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
    the parameter viewed 2-D: [rows, its last dim]), with their rows: each block's parts name
    theirs (trainer.parts). The vocabulary rows are the unpadded ones."""
    h, vocab, family = model.hidden_size, model.vocab_size, hf_family(model)
    out = {"embed.weight": [("model.embed_tokens.weight", vocab)]}
    for i in range(model.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        for part in block_parts(model, i):
            out |= part.hf_names(model, ours, theirs, family)
    out["norm.weight"] = [("model.norm.weight", h)]
    if not model.tie_word_embeddings:
        out["head.weight"] = [("lm_head.weight", vocab)]
    return out
