"""gpt-oss's config.json (GptOssForCausalLM) <-> ModelConfig, and its experts as its files hold
them: fused across experts, transposed, gate and up interleaved (hf_layout.Layout each way).
What transformers would compute and we would not is refused in one line. Its HfMapping is
trainer.checkpoint.hf_families' (MAPPINGS["gpt_oss"]); the attention's names are the parts'."""
from __future__ import annotations

from typing import Any

from trainer.checkpoint.hf_fields import BOOL, INT, NUMBER, REQUIRED, TEXTS, Fields
from trainer.checkpoint.hf_layout import Layout
from trainer.config import ModelConfig
from trainer.model.mlp import QUICK_GELU_ALPHA
from trainer.parts.part import HfNames

SLIDING, FULL = "sliding_attention", "full_attention"  # layer_types' values


def names(model: ModelConfig, ours: str, theirs: str) -> HfNames:
    """A block's router and experts: one tensor each for all experts (rows: ours, viewed 2-D),
    in place of the per-expert names of the MoE part."""
    experts, f, h = model.num_moe_experts, model.expert_ffn_size, model.hidden_size
    mlp = f"{theirs}mlp."
    return {f"{ours}mlp.router.weight": [(f"{mlp}router.weight", experts)],
            f"{ours}mlp.router.bias": [(f"{mlp}router.bias", experts)],
            f"{ours}mlp.experts.gate_up": [(f"{mlp}experts.gate_up_proj", experts * 2 * f)],
            f"{ours}mlp.experts.gate_up_bias": [(f"{mlp}experts.gate_up_proj_bias",
                                                 experts * 2 * f)],
            f"{ours}mlp.experts.down": [(f"{mlp}experts.down_proj", experts * h)],
            f"{ours}mlp.experts.down_bias": [(f"{mlp}experts.down_proj_bias", experts * h)]}


def layouts(model: ModelConfig) -> dict[str, Layout]:
    """Each block's experts as transformers' GptOssExperts holds them: gate_up_proj [E, H, 2F]
    (x @ it, gate and up interleaved on the last dim: gate [..., ::2], up [..., 1::2]) and its
    bias [E, 2F] likewise, down_proj [E, F, H], down_proj_bias [E, H]; ours: gate_up
    [E, 2F, H] (gate rows, then up rows), down [E, H, F], biases [E, out, 1]."""
    e, f, h = model.num_moe_experts, model.expert_ffn_size, model.hidden_size
    # gate_up_proj viewed [E, H, F, 2] (the last dim: gate, up) is ours [E, 2, F, H] permuted;
    # each way is one copy (a 120B's is 8.5 GB in fp32)
    each = {
        "gate_up_proj": Layout(lambda t: t.view(e, h, f, 2).permute(0, 3, 2, 1).reshape(-1, h),
                               lambda r: r.view(e, 2, f, h).permute(0, 3, 2, 1).reshape(
                                   e, h, 2 * f), (e, h, 2 * f)),
        "gate_up_proj_bias": Layout(lambda t: t.view(e, f, 2).transpose(1, 2).reshape(-1, 1),
                                    lambda r: r.view(e, 2, f).transpose(1, 2).reshape(e, 2 * f),
                                    (e, 2 * f)),
        "down_proj": Layout(lambda t: t.transpose(1, 2).reshape(-1, f),
                            lambda r: r.view(e, h, f).transpose(1, 2).contiguous(), (e, f, h)),
        "down_proj_bias": Layout(lambda t: t.reshape(-1, 1), lambda r: r.view(e, h), (e, h))}
    return {f"model.layers.{i}.mlp.experts.{name}": layout
            for i in range(model.num_layers) for name, layout in each.items()}


def read(fields: Fields, need) -> dict:
    """gpt-oss's block: biases everywhere, sinks, the clamped SwiGLU, the windowed layers, and
    experts in every block routed by the softmax of the top-k logits."""
    if "quantization_config" in fields.values:
        raise ValueError(f"{fields.source}: quantization_config is not supported (openai's files "
                         f"hold the experts in MXFP4). Fix: import an unquantized copy: load it "
                         f"with transformers' Mxfp4Config(dequantize=True) and save_pretrained.")
    need("attention_bias", fields.get("attention_bias", BOOL, True),
         "import a model with attention_bias true: model.add_bias_linear gives the attention "
         "its biases with the router's and the experts', which gpt-oss always has")
    need("swiglu_alpha", fields.get("swiglu_alpha", NUMBER, QUICK_GELU_ALPHA) == QUICK_GELU_ALPHA,
         f"import a model with gpt-oss's swiglu_alpha {QUICK_GELU_ALPHA} (the slope of "
         f"model.activation_func=quick_gelu)")
    need("attention_dropout", not fields.get("attention_dropout", NUMBER, 0.0),
         "import a model with attention_dropout 0 (this trainer has none)")
    # transformers adds router_aux_loss_coef x the balance loss only with output_router_logits
    # (false in openai's config.json, whose 0.9 is then unused)
    weight = float(fields.get("router_aux_loss_coef", NUMBER, 0.0))
    intermediate = fields.values["intermediate_size"]
    return {"softmax_type": "learnable", "add_bias_linear": True,
            "activation_func": "quick_gelu", "glu_linear_offset": 1.0,
            "activation_func_clamp_value": float(fields.get("swiglu_limit", NUMBER, 7.0)),
            "num_moe_experts": fields.get("num_local_experts", INT, REQUIRED),
            "moe_router_topk": fields.get("num_experts_per_tok", INT, REQUIRED),
            "moe_ffn_hidden_size": intermediate, "moe_router_pre_softmax": False,
            "moe_aux_loss_coeff": weight if fields.get("output_router_logits", BOOL, False)
            else 0.0,
            **_windows(fields, need)}


def _windows(fields: Fields, need) -> dict:
    """layer_types (transformers' default: sliding, full, sliding, ...) and sliding_window
    (keys a query sees, itself included: our window_size + 1) as model.window_size and
    model.window_attn_skip_freq (an int k where every k-th layer is full, else a list)."""
    layers = fields.values["num_hidden_layers"]
    types = fields.get("layer_types", TEXTS) or [SLIDING if (i + 1) % 2 else FULL
                                                  for i in range(layers)]
    need("layer_types", len(types) == layers and set(types) <= {SLIDING, FULL},
         f"give one of {SLIDING!r} and {FULL!r} per layer ({layers})")
    windowed = [int(t == SLIDING) for t in types]
    if not any(windowed):
        return {}
    keys = fields.get("sliding_window", INT)
    need("sliding_window", keys is not None and keys >= 2,
         "give the keys a sliding_attention layer sees (gpt-oss's 128), at least 2")
    every = next((k for k in range(2, layers + 1)
                  if windowed == [int((i + 1) % k != 0) for i in range(layers)]), None)
    return {"window_size": keys - 1,
            "window_attn_skip_freq": None if all(windowed) else every or windowed}


def write(model: ModelConfig) -> dict:
    """What transformers needs to build the same model (hidden_act is hf_config's silu, as
    openai writes it: transformers' experts take swiglu_alpha and swiglu_limit instead)."""
    out = {"num_local_experts": model.num_moe_experts,
           "num_experts_per_tok": model.moe_router_topk, "attention_bias": True,
           "attention_dropout": 0.0,
           "swiglu_alpha": QUICK_GELU_ALPHA, "swiglu_limit": model.activation_func_clamp_value,
           "layer_types": [SLIDING if model.window_of(i) is not None else FULL
                           for i in range(model.num_layers)],
           "sliding_window": None if model.window_size is None else model.window_size + 1,
           "router_aux_loss_coef": model.moe_aux_loss_coeff,
           "output_router_logits": model.moe_aux_loss_coeff > 0}
    if model.rope_type == "yarn":  # the context YaRN stretches to (transformers checks it)
        out["max_position_embeddings"] = round(model.original_max_position_embeddings
                                               * model.rotary_scaling_factor)
    return out


def holds(model: ModelConfig) -> list[tuple[str, Any, bool]]:
    """What the family's rules leave open and GptOssForCausalLM cannot say: its SwiGLU is
    always clamped, its router a plain softmax of the top-k logits; its YaRN is transformers'
    default scale of cos and sin (mscale 1 without mscale_all_dim)."""
    return [("activation_func_clamp_value", model.activation_func_clamp_value,
             model.activation_func_clamp_value is not None),
            ("use_rope_scaling", model.use_rope_scaling, not model.use_rope_scaling),
            ("mscale", model.mscale, model.rope_type != "yarn" or (
                model.mscale != 0 if model.mscale_all_dim else model.mscale == 1.0)),
            ("moe_router_topk_scaling_factor", model.moe_router_topk_scaling_factor,
             model.moe_router_topk_scaling_factor in (None, 1.0)),
            ("moe_router_enable_expert_bias", model.moe_router_enable_expert_bias,
             not model.moe_router_enable_expert_bias),
            ("moe_router_num_groups", model.moe_router_num_groups,
             model.moe_router_num_groups is None)]
