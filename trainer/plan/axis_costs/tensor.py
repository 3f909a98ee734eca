"""Tensor parallel's rules for the model and its terms of time: the shapes TP splits, and the
collectives of a block's (and the head's) activations over TP. (Its memory terms are the splits
by t in trainer.plan.activations' symbols.)"""
from __future__ import annotations

from parallel.layout import Layout
from trainer.config import ModelConfig
from trainer.plan.hardware import Hardware
from trainer.plan.options import EngineOptions


def check_model(model: ModelConfig, layout: Layout, options: EngineOptions) -> None:
    """Shapes tensor parallel must split evenly (GTP_remat pads rows, so it needs nothing)."""
    tp = layout.tp_size
    if model.num_moe_experts is not None and tp > 1 and layout.sp_degree == 1:
        raise ValueError(
            f"model.num_moe_experts={model.num_moe_experts} with parallel."
            f"tensor_model_parallel_size={tp} needs parallel.sequence_parallel=true: each TP "
            f"rank routes its own part of the sequence (as Megatron-Core requires). Fix: set "
            f"parallel.sequence_parallel=true, or parallel.tensor_model_parallel_size=1.")
    shapes = {"num_heads": model.num_heads, "num_query_groups": model.query_groups,
              "ffn_hidden_size": model.ffn_hidden_size}
    for key, value in shapes.items():
        if value % tp:
            raise ValueError(
                f"model.{key}={value} is not divisible by parallel.tensor_model_parallel_size="
                f"{tp}. Fix: choose a TP degree that divides it, or change the model.")
    if model.padded_vocab_size % tp:
        raise ValueError(
            f"model.vocab_size={model.vocab_size} padded to a multiple of "
            f"model.make_vocab_size_divisible_by={model.make_vocab_size_divisible_by} is "
            f"{model.padded_vocab_size}, which parallel.tensor_model_parallel_size={tp} does "
            f"not divide. Fix: set model.make_vocab_size_divisible_by to a multiple of {tp}.")


def tp_seconds(layout: Layout, hw: Hardware, activation_bytes: float) -> tuple[float, float]:
    """(a block's, the head's) TP messages, forward and backward, not hidden: a block runs two
    all-gathers and two reduce-scatters of `activation_bytes` (T*h*e) each way with SP (two
    all-reduces without: the same bytes); the head one each way."""
    t = layout.tp_size
    if t == 1:
        return 0.0, 0.0
    one = hw.link(layout, "tp").ring(t, activation_bytes)
    return 8 * one, 2 * one
