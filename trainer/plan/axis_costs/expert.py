"""Expert parallel's cost entry: its rules for the model and its terms of the plan, and the
search's EP (parallel.experts): experts
split over EP and each over ETP (their weights and optimizer state: trainer.plan.memory's
EXPERTS buffer), and the time of the exchanges that carry each MoE layer's rows to their
experts (and their ETP peers) and back.

The rows a rank receives depend on the router: dropless, a rank may receive every row its EP
group sends (EP x T x top-k), or none. The plan counts the expected case, the router balanced:
each rank receives as many rows as it sends (T x top-k), which is what the measured dry run's
fake all-to-all delivers too (its memory tests hold the plan to it).
"""
from __future__ import annotations

from parallel.layout import Layout
from parallel.layout.axes.expert import EXPERT, EXPERTS
from parallel.layout.axes.pipeline import PIPELINE
from trainer.config import ModelConfig, RecomputeGranularity
from trainer.plan.axis_costs.entry import AxisCosts, Offer, divisors
from trainer.plan.hardware import Hardware
from trainer.plan.options import EngineOptions

EP_KEY, ETP_KEY = "parallel.expert_model_parallel_size", "parallel.expert_tensor_parallel_size"


def check_model(model: ModelConfig, layout: Layout, options: EngineOptions) -> None:
    """EP splits the experts evenly and needs experts; ETP splits each expert's FFN evenly
    (under TP each rank routes its own part of the sequence: sequence parallel,
    trainer.plan.axis_costs.tensor)."""
    ep, experts = layout.ep_size, model.num_moe_experts
    if ep > 1 and experts is None:
        raise ValueError(
            f"{EP_KEY}={ep} splits a mixture of experts' experts, but the model is dense "
            f"(model.num_moe_experts=null). Fix: set {EP_KEY}=1, or model.num_moe_experts.")
    if experts is None and layout.expert_tensor_parallel_size is not None:
        raise ValueError(
            f"{ETP_KEY}={layout.expert_tensor_parallel_size} splits a mixture of experts' "
            f"experts, but the model is dense (model.num_moe_experts=null): nothing would read "
            f"it. Fix: set {ETP_KEY}=null, or model.num_moe_experts.")
    if experts is not None and experts % ep:
        divisors = [d for d in range(1, experts + 1) if experts % d == 0]
        raise ValueError(
            f"{EP_KEY}={ep} does not divide model.num_moe_experts={experts}: every EP rank "
            f"holds as many experts. Fix: set {EP_KEY} to one of {divisors}.")
    ffn = model.expert_ffn_size if experts is not None else 0
    if ffn % layout.etp_size:
        divisors = [d for d in range(1, min(ffn, 64) + 1) if ffn % d == 0]
        raise ValueError(
            f"{ETP_KEY}={layout.expert_tensor_parallel_size} (null = TP = {layout.tp_size}) "
            f"splits each expert's FFN of {ffn} (model.moe_ffn_hidden_size, null = "
            f"model.ffn_hidden_size), which it does not divide. Fix: set {ETP_KEY} to one of "
            f"{divisors}.")


def dispatch_seconds(m: ModelConfig, layout: Layout, hw: Hardware, T: int, e: int,
                     recompute: RecomputeGranularity | None) -> float:
    """An average block's exchanges of rows in one micro-batch, not hidden: the rows (T / SP x
    top-k of h x e bytes) to their experts' EP ranks ((EP-1)/EP of them leave the rank) and to
    every ETP peer (ETP-1 copies), out and back in forward, their gradients both ways in
    backward, the forward's again under full recompute; a dense block has none."""
    ep, etp = layout.ep_size, layout.etp_size
    if (ep == 1 and etp == 1) or m.num_moe_experts is None:
        return 0.0
    rows = T // layout.sp_degree * m.moe_router_topk  # each TP rank routes its part (SP)
    one = 0.0
    if ep > 1:
        one += hw.link(layout, "expert_model_parallel").all_to_all(ep, rows * m.hidden_size * e)
    if etp > 1:  # each peer's copy of the rows that arrived (as many as left, expected)
        one += hw.link(layout, "expert_tensor_parallel").all_to_all(
            etp, etp * rows * m.hidden_size * e)
    moe_blocks = sum(m.is_moe_block(i) for i in range(m.num_layers)) / m.num_layers
    return (6 if recompute is RecomputeGranularity.full else 4) * one * moe_blocks


def variants(offer: Offer):
    """EP degrees: for a mixture of experts each that divides its experts and a stage's ranks
    (the Layout checks ETP's share); 1 for a dense model."""
    p, key = offer.problem, EXPERTS.config_key
    experts, pp = p.model.num_moe_experts, offer.chosen["parallel.pipeline_model_parallel_size"]
    if key in offer.fixed:
        eps = [offer.fixed[key]]
    elif experts is None:
        eps = [1]
    else:
        eps = [d for d in divisors(experts) if (p.world_size // pp) % d == 0]
    return [{key: ep} for ep in eps]


COSTS = AxisCosts(
    EXPERT.name, check_model, kind="expert dispatch",
    block_s=lambda k, recompute, fwd, bwd: dispatch_seconds(k.model, k.layout, k.hw, k.T, k.e,
                                                            recompute),
    variants=variants, chosen_after=PIPELINE.name,
    labels=lambda lay, values: ((6, f"EP={lay.ep_size}"),) if lay.ep_size > 1 else (),
    inputs=lambda lay: f"EP={lay.ep_size} ETP={lay.etp_size}")
