"""The model families model.name selects, each a short description over the registered parts:
which parts its blocks are made of, what its Hugging Face checkpoints are called, and what it
requires of the keys. Presets of each live in conf/model/.

    llama      Llama's block: grouped-query attention with rotary positions, a SwiGLU; its
               variants by key (qk_layernorm, a mixture of experts), exported as the Hugging
               Face family that holds them
    qwen3      Llama's with an RMSNorm over each head of q and k (qk_layernorm)
    mixtral    a mixture of experts in every block, a softmax over the top-k router logits
    qwen3_moe  Qwen3's attention, experts (normalised top-k), dense blocks where
               moe_layer_freq says
    deepseek_v3  multi-latent attention; experts with sigmoid or softmax routing, group-limited
               top-k, the expert bias, a shared expert and the first blocks dense (Kimi K2 and
               Moonlight are this family)
    gpt_oss    grouped-query attention with biases and learnable sinks, sliding windows where
               window_attn_skip_freq says; experts in every block, a biased router (the top-k
               logits' softmax), biased experts with the clamped SwiGLU (quick_gelu)
    gemma3     Gemma 3's text model: zero-centred sandwich norms, qk norms, GeGLU, the embedding
               scaled by sqrt(hidden), windowed layers with their own rotary base between
               global ones (5:1), a softmax scale of its own
    qwen3_next the hybrid: Gated DeltaNet blocks (trainer.parts.gdn) between gated full
               attention (three to one), partial rotary, zero-centred norms, experts with a
               gated shared expert (Qwen3-Next)
    qwen3_5    Qwen3.5's text model: Qwen3-Next's block with a dense MLP, its linear blocks'
               input projections stored by part (as Megatron's)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from trainer.config import ModelConfig

LLAMA, QWEN3 = "LlamaForCausalLM", "Qwen3ForCausalLM"
MIXTRAL, QWEN3_MOE = "MixtralForCausalLM", "Qwen3MoeForCausalLM"
DEEPSEEK_V3 = "DeepseekV3ForCausalLM"  # Kimi K2's and Moonlight's too
GPT_OSS = "GptOssForCausalLM"
GEMMA3 = "Gemma3ForCausalLM"
QWEN3_NEXT = "Qwen3NextForCausalLM"
QWEN3_5 = "Qwen3_5ForCausalLM"  # Qwen3.5's text model


def _requires(name: str, **wanted: Callable[[ModelConfig], bool]) -> Callable:
    """A family's rule: each key's test, refused in one line naming the key and the fix."""
    says = {"qk_layernorm": "model.qk_layernorm=true",
            "no_qk_layernorm": "model.qk_layernorm=false",
            "experts": "model.num_moe_experts set (a mixture of experts)",
            "dense": "model.num_moe_experts=null (a dense model)",
            "mla": "model.multi_latent_attention=true",
            "gqa": "model.multi_latent_attention=false"}

    def rule(model: ModelConfig) -> None:
        for what, ok in wanted.items():
            if not ok(model):
                key = ("qk_layernorm" if "qk_layernorm" in what else "multi_latent_attention"
                       if what in ("mla", "gqa") else "num_moe_experts")
                value = getattr(model, key)
                value = "null" if value is None else str(value).lower()
                raise ValueError(f"model.name={name} needs {says[what]}, not model.{key}="
                                 f"{value}. Fix: set model.{key}, or model.name=llama for "
                                 f"Llama's block with any of its variants.")
    return rule


def _gpt_oss_rules(model: ModelConfig) -> None:
    """gpt-oss's block: what its keys must say (conf/model/gpt_oss_20b.yaml has them all)."""
    wanted = (("multi_latent_attention", False), ("softmax_type", "learnable"),
              ("add_bias_linear", True), ("activation_func", "quick_gelu"),
              ("glu_linear_offset", 1.0), ("moe_router_score_function", "softmax"),
              ("moe_router_pre_softmax", False), ("qk_layernorm", False),
              ("moe_shared_expert_intermediate_size", None))
    for key, want in wanted:
        if getattr(model, key) != want:
            raise ValueError(f"model.name=gpt_oss needs model.{key}={want!r}, not "
                             f"{getattr(model, key)!r}. Fix: set it as conf/model/gpt_oss_20b.yaml"
                             f" does, or model.name=llama for Llama's block with its variants.")
    if model.num_moe_experts is None or not all(model.is_moe_block(i)
                                                for i in range(model.num_layers)):
        raise ValueError(f"model.name=gpt_oss needs experts in every block, not "
                         f"model.num_moe_experts={model.num_moe_experts} with "
                         f"model.moe_layer_freq={model.moe_layer_freq!r}. Fix: set "
                         f"model.num_moe_experts and model.moe_layer_freq=1.")


def _gemma3_rules(model: ModelConfig) -> None:
    """Gemma 3's block: what its keys must say (conf/model/gemma3_27b.yaml has them all)."""
    wanted = (("layernorm_zero_centered_gamma", True), ("sandwich_norm", True),
              ("scale_embedding", True), ("qk_layernorm", True), ("activation_func", "fast_gelu"),
              ("multi_latent_attention", False), ("num_moe_experts", None))
    for key, want in wanted:
        if getattr(model, key) != want:
            raise ValueError(f"model.name=gemma3 needs model.{key}={want!r}, not "
                             f"{getattr(model, key)!r}. Fix: set it as conf/model/gemma3_27b.yaml"
                             f" does, or model.name=llama for Llama's block with its variants.")


def _qwen3_5_rules(model: ModelConfig) -> None:
    """Qwen3.5's text block: Qwen3-Next's, its MLP dense."""
    _qwen3_next_rules(model, "qwen3_5")
    if model.num_moe_experts is not None:
        raise ValueError(f"model.name=qwen3_5 is Qwen3.5's dense text model, not "
                         f"model.num_moe_experts={model.num_moe_experts}. Fix: model."
                         f"num_moe_experts=null, or model.name=qwen3_next for experts.")


def _qwen3_next_rules(model: ModelConfig, name: str = "qwen3_next") -> None:
    """Qwen3-Next's block: what its keys must say (conf/model/qwen3_next_80b_a3b.yaml has them
    all); its MLP dense, or experts with a gated shared expert."""
    wanted = (("experimental_attention_variant", "gated_delta_net"),
              ("attention_output_gate", True), ("qk_layernorm", True),
              ("layernorm_zero_centered_gamma", True), ("activation_func", "silu"),
              ("add_bias_linear", False), ("sandwich_norm", False))
    if model.num_moe_experts is not None:
        wanted += (("moe_shared_expert_gate", True), ("moe_router_score_function", "softmax"))
    for key, want in wanted:
        if getattr(model, key) != want:
            raise ValueError(f"model.name={name} needs model.{key}={want!r}, not "
                             f"{getattr(model, key)!r}. Fix: set it as conf/model/"
                             f"qwen3_next_80b_a3b.yaml does, or model.name=llama for Llama's "
                             f"block with its variants.")
    if model.num_moe_experts is not None and not model.moe_shared_expert_intermediate_size:
        raise ValueError(f"model.name={name} needs a shared expert beside its experts, not "
                         "model.moe_shared_expert_intermediate_size=null. Fix: set it (Qwen3-"
                         "Next's 512), or model.num_moe_experts=null for a dense model.")


@dataclass(frozen=True)
class Family:
    name: str  # model.name
    # The Hugging Face architecture it is exported as; None: chosen from the keys (llama's).
    architecture: Optional[str]
    rules: Callable[[ModelConfig], None]
    # A mixture of experts' Hugging Face names: the MoE module in a layer, its experts' gate,
    # up and down projections.
    expert_names: tuple[str, tuple[str, str, str]] = ("mlp", ("gate_proj", "up_proj",
                                                              "down_proj"))
    # its shared expert's module within the MoE module (its gate: this + "_gate")
    shared: str = "shared_experts"
    # its linear blocks' input projections on disk (trainer.parts.gdn): Qwen3-Next's two,
    # grouped by key head; Qwen3.5's four, as our in_proj's parts
    linear_in: tuple[str, ...] = ("in_proj_qkvz", "in_proj_ba")


FAMILIES = {f.name: f for f in (
    Family("llama", None, lambda model: None),
    Family("qwen3", QWEN3, _requires("qwen3", qk_layernorm=lambda m: m.qk_layernorm,
                                     dense=lambda m: m.num_moe_experts is None)),
    Family("mixtral", MIXTRAL, _requires(
        "mixtral", no_qk_layernorm=lambda m: not m.qk_layernorm,
        gqa=lambda m: not m.multi_latent_attention,
        experts=lambda m: m.num_moe_experts is not None),
        expert_names=("block_sparse_moe", ("w1", "w3", "w2"))),
    Family("qwen3_moe", QWEN3_MOE, _requires(
        "qwen3_moe", qk_layernorm=lambda m: m.qk_layernorm,
        experts=lambda m: m.num_moe_experts is not None)),
    Family("deepseek_v3", DEEPSEEK_V3, _requires("deepseek_v3",
                                                 mla=lambda m: m.multi_latent_attention)),
    Family("gpt_oss", GPT_OSS, _gpt_oss_rules),
    Family("gemma3", GEMMA3, _gemma3_rules),
    Family("qwen3_next", QWEN3_NEXT, _qwen3_next_rules, shared="shared_expert"),
    Family("qwen3_5", QWEN3_5, _qwen3_5_rules,
           linear_in=("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")),
)}
# The family an imported checkpoint's architecture becomes (llama's is chosen from the keys on
# export, and its own on import).
BY_ARCHITECTURE = {LLAMA: FAMILIES["llama"], **{f.architecture: f for f in FAMILIES.values()
                                                if f.architecture}}
ARCHITECTURES = tuple(BY_ARCHITECTURE)


def hf_family(model: ModelConfig) -> Family:
    """The family whose Hugging Face names a model's weights take: its own, or for llama the
    one its keys make (multi-latent attention: DeepSeek-V3's; qk_layernorm: Qwen3's; experts:
    Mixtral's or Qwen3-MoE's)."""
    family = FAMILIES[model.name]
    if family.architecture is not None:
        return family
    if model.multi_latent_attention:
        return FAMILIES["deepseek_v3"]
    if model.num_moe_experts is None:
        return FAMILIES["qwen3"] if model.qk_layernorm else family
    return FAMILIES["qwen3_moe"] if model.qk_layernorm else FAMILIES["mixtral"]
