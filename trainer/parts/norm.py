"""RMSNorm, the norm of every block (before its attention and before its MLP) and of the final
hidden states: the part "rmsnorm". Its layer: trainer.model.norm.
"""
from __future__ import annotations

from trainer.config import ModelConfig
from trainer.parts.part import HfNames, Part
from trainer.parts.tokens import FP32, Tokens
from trainer.values import finite

# A block's two pre-norms, by module name (the final norm is the model's: trainer.parts.assembly).
BLOCK_NORMS = ("attn_norm", "mlp_norm")


def kept_bytes(m: ModelConfig, k: Tokens, e: int, recompute=None, cp_comm_type=None) -> int:
    """A block's two norms: each its input and its normalised input, fp32 on the residual
    stream's tokens (2*Tr*h each), and its rsqrt (Tr)."""
    return len(BLOCK_NORMS) * (2 * k.Tr * m.hidden_size * FP32 + k.Tr * FP32)


def hf_names(cfg: ModelConfig, ours: str, theirs: str, family) -> HfNames:
    h = cfg.hidden_size
    return {f"{ours}attn_norm.weight": [(f"{theirs}input_layernorm.weight", h)],
            f"{ours}mlp_norm.weight": [(f"{theirs}post_attention_layernorm.weight", h)]}


def rules(model: ModelConfig) -> None:
    finite("model.norm_eps", model.norm_eps, 0, False, fix="use e.g. 1e-5")


RMSNORM = Part(
    "rmsnorm", "norm", "trainer.model.norm:hidden_norm",
    lambda cfg: {"weight": (cfg.hidden_size,)},
    kept_bytes=kept_bytes, hf_names=hf_names, rules=rules)
