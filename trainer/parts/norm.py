"""RMSNorm, the norm of every block (before its attention and before its MLP; with
model.sandwich_norm after each too) and of the final hidden states: the part "rmsnorm", plain or
zero-centred (model.layernorm_zero_centered_gamma, Gemma's). Its layer: trainer.model.norm.
"""
from __future__ import annotations

from trainer.config import ModelConfig
from trainer.parts.part import HfNames, Part
from trainer.parts.tokens import FP32, Tokens
from trainer.values import finite

# A block's two pre-norms, by module name (the final norm is the model's: trainer.parts.assembly).
BLOCK_NORMS = ("attn_norm", "mlp_norm")
# sandwich_norm's two more: each branch's output, before its residual add.
POST_NORMS = ("post_attn_norm", "post_mlp_norm")
# Hugging Face's names of each, by ours (Llama's two; Gemma 2/3's four).
HF_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
HF_SANDWICH_NORMS = {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
                     "mlp_norm": "pre_feedforward_layernorm",
                     "post_mlp_norm": "post_feedforward_layernorm"}


def block_norms(cfg: ModelConfig) -> tuple[str, ...]:
    """A block's norms by module name, in its parameter order."""
    return BLOCK_NORMS + POST_NORMS if cfg.sandwich_norm else BLOCK_NORMS


def kept_bytes(m: ModelConfig, k: Tokens, e: int, recompute=None, cp_comm_type=None) -> int:
    """A block's norms: each its input and its normalised input, fp32 on the residual stream's
    tokens (2*Tr*h each), and its rsqrt (Tr). A post-norm's input is its branch's output, in
    the compute dtype under bf16: the plain norm would compute in it, so sandwich_norm asks
    for the zero-centred one (fp32 whatever its input, keeping the fp32 copy instead)."""
    return len(block_norms(m)) * (2 * k.Tr * m.hidden_size * FP32 + k.Tr * FP32)


def lora_kept_bytes(m: ModelConfig, k: Tokens, e: int, recompute, cp_comm_type, adapted,
                    grad_in: tuple[bool, ...], dropout: bool = False) -> int:
    """Its weight frozen (peft=lora), a norm keeps no normalised input (only the weight's
    gradient reads it): its input and rsqrt (Tr*h + Tr fp32) where its input carries a gradient
    (grad_in: a flag per norm of block_norms), nothing where not."""
    return sum(grad_in) * (k.Tr * m.hidden_size * FP32 + k.Tr * FP32)


def backward_bytes(m: ModelConfig, k: Tokens, e: int, selective: bool = False) -> int:
    """A zero-centred norm's backward, the most it forms at once beside what the block keeps:
    the gradient entering the block (Tr*h fp32), its own fp32 gradients of the scaled, the
    normalised and the widened input and of its rsqrt's chain (4*Tr*h fp32), and the gradient
    it hands on in the stream's dtype (Tr*h*e). A post-norm runs first in a block's backward,
    beside every activation of its branch; a plain norm's never outgrows the MLP's (0)."""
    if not m.layernorm_zero_centered_gamma:
        return 0
    return k.Tr * m.hidden_size * (5 * FP32 + e)


def hf_names(cfg: ModelConfig, ours: str, theirs: str, family) -> HfNames:
    names = HF_SANDWICH_NORMS if cfg.sandwich_norm else HF_NORMS
    return {f"{ours}{norm}.weight": [(f"{theirs}{hf}.weight", cfg.hidden_size)]
            for norm, hf in names.items()}


def rules(model: ModelConfig) -> None:
    finite("model.norm_eps", model.norm_eps, 0, False, fix="use e.g. 1e-5")
    if model.sandwich_norm and not model.layernorm_zero_centered_gamma:
        raise ValueError("model.sandwich_norm=true needs model.layernorm_zero_centered_gamma="
                         "true: a post-norm's input is its branch's output, in bf16 under "
                         "bf16 training, which only the zero-centred norm computes in fp32 "
                         "(Gemma's). Fix: set model.layernorm_zero_centered_gamma=true.")
    gemma = [key for key in ("layernorm_zero_centered_gamma", "sandwich_norm", "scale_embedding")
             if getattr(model, key)]
    if gemma and model.mtp_num_layers:
        raise ValueError(f"model.{gemma[0]}=true with model.mtp_num_layers="
                         f"{model.mtp_num_layers}: multi-token prediction's depths are not "
                         f"built with Gemma's norms and embedding scale. Fix: set "
                         f"model.mtp_num_layers=null, or model.{gemma[0]}=false.")
    if model.multi_latent_attention and model.layernorm_zero_centered_gamma:
        raise ValueError("model.layernorm_zero_centered_gamma=true with model."
                         "multi_latent_attention=true: multi-latent attention's latent norms "
                         "are not built zero-centred. Fix: set one of them to false.")


RMSNORM = Part(
    "rmsnorm", "norm", "trainer.model.norm:hidden_norm",
    lambda cfg: {"weight": (cfg.hidden_size,)},
    kept_bytes=kept_bytes, lora_kept_bytes=lora_kept_bytes, backward_bytes=backward_bytes,
    hf_names=hf_names, rules=rules)
