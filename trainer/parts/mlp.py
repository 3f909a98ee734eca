"""The dense MLP: a SwiGLU, down(silu(gate(x)) * up(x)) with gate and up fused (the part
"swiglu"; a mixture of experts' shared expert is one too). Its layer: trainer.model.mlp.
"""
from __future__ import annotations

from trainer.config import ModelConfig
from trainer.parts.part import HfNames, Part, Shapes


def swiglu_shapes(h: int, f: int, prefix: str = "") -> Shapes:
    return {f"{prefix}gate_up.weight": (2 * f, h), f"{prefix}down.weight": (h, f)}


def hf_names(cfg: ModelConfig, ours: str, theirs: str, family) -> HfNames:
    f, h = cfg.ffn_hidden_size, cfg.hidden_size
    return {f"{ours}mlp.gate_up.weight": [(f"{theirs}mlp.{p}_proj.weight", f)
                                          for p in ("gate", "up")],
            f"{ours}mlp.down.weight": [(f"{theirs}mlp.down_proj.weight", h)]}


SWIGLU = Part(
    "swiglu", "mlp", "trainer.model.mlp:dense_mlp",
    lambda cfg: swiglu_shapes(cfg.hidden_size, cfg.ffn_hidden_size),
    tp_styles={"gate_up": "column", "down": "row"},
    fused=lambda cfg: {"gate_up": (1, 1)},  # gate | up: each TP rank keeps rows of both
    residual_outputs=("down.weight",),
    hook="activation_fn",  # silu(gate) * up: recomputed rather than kept (selective)
    hf_names=hf_names)
