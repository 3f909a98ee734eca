"""Tensor parallel's cost entry: the shapes TP splits, the collectives of a block's (and the
head's) activations over TP, and the search's TP and SP. (Its memory terms are the splits by t in
trainer.plan.activations' symbols.)"""
from __future__ import annotations

from parallel.layout import Layout
from parallel.layout.axes.tensor import TENSOR
from trainer.config import ModelConfig
from trainer.plan.axis_costs.entry import AxisCosts, Micro, Offer, divisors
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
    if any(model.is_linear_block(i) for i in range(model.num_layers)):  # whole key heads
        shapes["linear_num_key_heads"] = model.linear_num_key_heads  # with their value heads
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


def block_s(k: Micro, recompute, fwd: float, bwd: float) -> float:
    return tp_seconds(k.layout, k.hw, k.T * k.model.hidden_size * k.e)[0]


def head_s(k: Micro) -> float:
    return tp_seconds(k.layout, k.hw, k.T * k.model.hidden_size * k.e)[1]


def floor_block_s(k: Micro) -> float:
    return block_s(k, None, 0.0, 0.0)  # no option hides TP's messages: the floor takes them


TP_KEY, SP_KEY = "parallel.tensor_model_parallel_size", "parallel.sequence_parallel"


def degrees(offer: Offer):
    """Each TP that divides the world; with TP > 1, SP on."""
    for tp in offer.choices(TP_KEY, divisors(offer.problem.world_size)):
        if tp > 1 and SP_KEY not in offer.fixed:
            # SP off moves the same bytes (an all-reduce is a reduce-scatter and an
            # all-gather) and keeps TP x more activations: never better, not enumerated.
            offer.dropped["sequence_parallel=false with TP > 1 (more memory, same traffic)"] += 1
        for sp in offer.choices(SP_KEY, [tp > 1]):
            yield {TP_KEY: tp, SP_KEY: sp}


def refuses(offer: Offer) -> str | None:
    """TP that the model cannot split, or that leaves the NVLink domain."""
    p, tp = offer.problem, offer.chosen[TP_KEY]
    m = p.model
    if any(n % tp for n in (m.num_heads, m.query_groups, m.ffn_hidden_size, m.padded_vocab_size)):
        return "TP does not divide the model's heads, K/V groups, FFN or padded vocabulary"
    if tp > p.hardware.gpus_per_nvlink_domain:
        return "TP spans more than one NVLink domain"
    if (m.num_moe_experts is not None and m.expert_ffn_size % tp
            and dict(p.given).get("parallel.expert_tensor_parallel_size") is None):
        return ("TP (= ETP, parallel.expert_tensor_parallel_size=null) does not divide the "
                "expert FFN")
    return None


COSTS = AxisCosts(
    TENSOR.name, check_model, kind="tensor parallel", block_s=block_s, head_s=head_s,
    floor_block_s=floor_block_s, floor_head_s=head_s,
    degrees=degrees, refuses=refuses,
    labels=lambda lay, values: ((0, f"TP={lay.tp_size}" + (
        " SP" if lay.sequence_parallel and lay.tp_size > 1 else "")),),
    inputs=lambda lay: (f"TP={lay.tensor_model_parallel_size} "
                        f"SP={'on' if lay.sequence_parallel else 'off'}"))
