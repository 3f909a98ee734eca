"""Gemma 3's text model's config.json (Gemma3ForCausalLM, model_type gemma3_text) <->
ModelConfig: zero-centred and sandwich norms, GeGLU, the scaled embedding, the windowed layers'
own rotary base and the global ones' linear scaling, query_pre_attn_scalar as the softmax scale.
What transformers would compute and we would not (a vision tower, soft-capping) is refused in
one line. Its HfMapping is trainer.checkpoint.hf_families' (MAPPINGS["gemma3"]); its tensors'
names are the parts' (trainer.parts.norm's four norms, attention's q_norm and k_norm).
"""
from __future__ import annotations

from typing import Any

from trainer.checkpoint.hf_fields import BOOL, INT, MAPPING, NUMBER, REQUIRED, TEXT, TEXTS, Fields
from trainer.config import ModelConfig

# Architectures of the family we do not build, with what they need.
UNBUILT_VARIANTS = {"Gemma3ForConditionalGeneration": "Gemma 3's vision tower (SigLIP) and its "
                                                      "multimodal projector"}
SLIDING, FULL = "sliding_attention", "full_attention"
# Gemma3TextConfig's defaults, for the fields a config.json may leave out.
DEFAULT_PATTERN, GLOBAL_THETA, LOCAL_THETA = 6, 1_000_000.0, 10_000.0
GELU_TANH = "gelu_pytorch_tanh"  # transformers' name of fast_gelu (the tanh-approximate GELU)
# The keys only this family's config.json holds (architecture_of refuses them elsewhere).
GEMMA_KEYS = ("layernorm_zero_centered_gamma", "sandwich_norm", "scale_embedding",
              "rotary_base_local", "seq_len_interpolation_factor", "softmax_scale")


def read(fields: Fields, need) -> dict:
    """Gemma 3's block; its layer pattern from layer_types (or transformers 4's
    sliding_window_pattern), its two rotary bases from rope_parameters by layer type (or 4's
    rope_theta, rope_local_base_freq and rope_scaling)."""
    values = fields.values
    need("vision_config", "vision_config" not in values and "text_config" not in values,
         f"import the text model alone (Gemma3ForCausalLM): this trainer does not build "
         f"{UNBUILT_VARIANTS['Gemma3ForConditionalGeneration']}")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        need(key, fields.get(key, NUMBER) is None,
             "import a model without soft-capping (Gemma 3 has none; Gemma 2's is not built)")
    need("use_bidirectional_attention", not fields.get("use_bidirectional_attention", BOOL),
         "import a causal model (EmbeddingGemma's bidirectional attention is not built)")
    for key in ("hidden_activation", "hidden_act"):
        need(key, fields.get(key, TEXT, GELU_TANH) == GELU_TANH,
             f"import a model whose MLP is GeGLU with {GELU_TANH}, Gemma 3's")
    layers = values["num_hidden_layers"]
    window = fields.get("sliding_window", INT, REQUIRED)
    return {"layernorm_zero_centered_gamma": True, "sandwich_norm": True,
            "scale_embedding": True, "qk_layernorm": True, "activation_func": "fast_gelu",
            "tie_word_embeddings": fields.get("tie_word_embeddings", BOOL, True),
            "softmax_scale": float(fields.get("query_pre_attn_scalar", NUMBER, 256)) ** -0.5,
            "window_size": window - 1,  # theirs counts the query itself
            **_pattern(fields, need, layers), **_rotary(fields, need)}


def _pattern(fields: Fields, need, layers: int) -> dict:
    """window_attn_skip_freq: every k-th layer global as an int (Gemma 3's 6), else a list."""
    types = fields.get("layer_types", TEXTS)
    if types is None:
        every = fields.get("sliding_window_pattern", INT) or \
            fields.get("_sliding_window_pattern", INT, DEFAULT_PATTERN)
        types = [SLIDING if (i + 1) % every else FULL for i in range(layers)]
    need("layer_types", len(types) == layers and set(types) <= {SLIDING, FULL},
         f"give one of {SLIDING!r} or {FULL!r} per layer, {layers} in all")
    if FULL not in types:
        return {"window_attn_skip_freq": None}
    every = types.index(FULL) + 1
    regular = every >= 2 and all((t == FULL) == ((i + 1) % every == 0)
                                 for i, t in enumerate(types))
    return {"window_attn_skip_freq": every if regular else [int(t == SLIDING) for t in types]}


def _rotary(fields: Fields, need) -> dict:
    """rope_theta (the global layers'), rotary_base_local and the global layers' linear
    scaling."""
    rope = fields.inner("rope_parameters")
    if rope.values and not ({SLIDING, FULL} & set(rope.values)):
        rope = Fields({FULL: rope.values}, fields.source, "")  # one set for every layer type
    full, local = rope.inner(FULL), rope.inner(SLIDING)
    scaling = fields.inner("rope_scaling") if fields.get("rope_scaling", MAPPING) else full
    kind = scaling.get("rope_type", TEXT) or scaling.get("type", TEXT) or "default"
    need("rope_scaling", kind in ("default", "linear"),
         "import a model whose global layers' rope is plain or linearly scaled, Gemma 3's")
    need("rope_parameters", local.get("rope_type", TEXT, "default") == "default",
         "import a model whose sliding layers' rope is plain, Gemma 3's")
    factor = float(scaling.get("factor", NUMBER, REQUIRED)) if kind == "linear" else None
    return {"rope_theta": float(full.get("rope_theta", NUMBER) or
                                fields.get("rope_theta", NUMBER, GLOBAL_THETA)),
            "rotary_base_local": float(local.get("rope_theta", NUMBER) or
                                       fields.get("rope_local_base_freq", NUMBER, LOCAL_THETA)),
            "seq_len_interpolation_factor": None if factor == 1.0 else factor}


def write(model: ModelConfig) -> dict:
    """Gemma3TextConfig's fields (both rope spellings, transformers 5's and 4's)."""
    types = [SLIDING if model.window_of(i) is not None else FULL
             for i in range(model.num_layers)]
    full = {"rope_type": "default", "rope_theta": model.rope_theta}
    if model.seq_len_interpolation_factor is not None:
        full = {"rope_type": "linear", "factor": model.seq_len_interpolation_factor,
                "rope_theta": model.rope_theta}
    local = model.rotary_base_local if model.rotary_base_local is not None else model.rope_theta
    scalar = model.softmax_scale ** -2 if model.softmax_scale else model.head_dim
    return {"hidden_activation": GELU_TANH, "hidden_act": GELU_TANH,
            "query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar)) < 1e-6
            else scalar,
            "sliding_window": model.window_size + 1, "layer_types": types,
            "rope_parameters": {FULL: full, SLIDING: {"rope_type": "default",
                                                     "rope_theta": local}},
            "rope_scaling": {k: v for k, v in full.items() if k != "rope_theta"}
            if model.seq_len_interpolation_factor is not None else None,
            "rope_local_base_freq": local, "final_logit_softcapping": None,
            "attn_logit_softcapping": None, "use_bidirectional_attention": False}


def holds(model: ModelConfig) -> list[tuple[str, Any, bool]]:
    """Gemma 3 is its block, every key of it (the family's rules ask the same), with a window
    on some layer and a plain rope on the windowed ones."""
    return [("window_size", model.window_size, model.window_size is not None),
            ("glu_linear_offset", model.glu_linear_offset, not model.glu_linear_offset),
            ("activation_func_clamp_value", model.activation_func_clamp_value,
             model.activation_func_clamp_value is None),
            ("add_bias_linear", model.add_bias_linear, not model.add_bias_linear),
            ("add_qkv_bias", model.add_qkv_bias, not model.add_qkv_bias),
            ("softmax_type", model.softmax_type, model.softmax_type == "vanilla"),
            ("use_rope_scaling", model.use_rope_scaling, not model.use_rope_scaling)]


def not_held(model: ModelConfig) -> list[tuple[str, Any, bool]]:
    """Gemma's keys, which another family's config.json cannot hold."""
    return [(key, getattr(model, key), not getattr(model, key)) for key in GEMMA_KEYS]

