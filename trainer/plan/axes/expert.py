"""Expert parallel's rules for the model and its terms of the plan (parallel.experts): experts
split over EP (their weights and optimizer state: trainer.plan.memory's EXPERTS buffer).
"""
from __future__ import annotations

from parallel.layout import Layout
from trainer.config import ModelConfig
from trainer.plan.options import EngineOptions

EP_KEY, ETP_KEY = "parallel.expert_model_parallel_size", "parallel.expert_tensor_parallel_size"


def check_model(model: ModelConfig, layout: Layout, options: EngineOptions) -> None:
    """EP splits the experts evenly; it needs experts; ETP is not built (each expert whole)."""
    ep, experts = layout.ep_size, model.num_moe_experts
    if ep > 1 and experts is None:
        raise ValueError(
            f"{EP_KEY}={ep} splits a mixture of experts' experts, but the model is dense "
            f"(model.num_moe_experts=null). Fix: set {EP_KEY}=1, or model.num_moe_experts.")
    if experts is not None and experts % ep:
        divisors = [d for d in range(1, experts + 1) if experts % d == 0]
        raise ValueError(
            f"{EP_KEY}={ep} does not divide model.num_moe_experts={experts}: every EP rank "
            f"holds as many experts. Fix: set {EP_KEY} to one of {divisors}.")
    if layout.etp_size != 1 and experts is not None:
        raise ValueError(
            f"{ETP_KEY}={layout.expert_tensor_parallel_size} (null = TP = {layout.tp_size}) "
            f"splits each expert, which is not built yet: experts are whole on their EP rank. "
            f"Fix: set {ETP_KEY}=1 and parallel.tensor_model_parallel_size=1.")

