"""A mixture of experts as the MLP of a block (the part "moe"): a router over E experts, the
experts as two 3-D weights ([E, 2F, h] and [E, h, F]) and an optional shared expert, a SwiGLU
every token passes through. Its rules are the MoE keys' (refused on a dense model, where they
would be ignored). Its layer: trainer.model.moe.
"""
from __future__ import annotations

from trainer.config import ModelConfig
from trainer.parts.mlp import swiglu_shapes
from trainer.parts.part import HfNames, Part, Shapes
from trainer.values import finite, one_of, positive_int


def shapes(cfg: ModelConfig) -> Shapes:
    E, fe, h, shared = (cfg.num_moe_experts, cfg.expert_ffn_size, cfg.hidden_size,
                        cfg.moe_shared_expert_intermediate_size)
    out = {"router.weight": (E, h), "experts.gate_up": (E, 2 * fe, h),
           "experts.down": (E, h, fe)}
    return out | (swiglu_shapes(h, shared, "shared.") if shared else {})


def hf_names(cfg: ModelConfig, ours: str, theirs: str, family) -> HfNames:
    """Theirs are per expert on disk (gate, up and down projections, named by the family), so
    expert e's gate and up are rows 2Fe.. of our first weight and its down rows he.. of the
    second, viewed 2-D."""
    E, f, h = cfg.num_moe_experts, cfg.expert_ffn_size, cfg.hidden_size
    module, (gate, up, down) = family.expert_names
    experts = f"{theirs}{module}.experts"
    return {
        f"{ours}mlp.router.weight": [(f"{theirs}{module}.gate.weight", E)],
        f"{ours}mlp.experts.gate_up": [(f"{experts}.{e}.{p}.weight", f)
                                       for e in range(E) for p in (gate, up)],
        f"{ours}mlp.experts.down": [(f"{experts}.{e}.{down}.weight", h) for e in range(E)],
    }


MOE_SCORE_FUNCTIONS = ("softmax", "sigmoid")
MOE_BALANCING = ("aux_loss", "seq_aux_loss", "none")
MOE_DISPATCHERS = ("alltoall", "allgather")  # parallel.experts


def check_moe(model: ModelConfig) -> None:
    """A mixture of experts' keys (trainer.model.moe); set on a dense model they would be
    ignored, so they are refused."""
    experts = model.num_moe_experts
    if experts is None:
        ignored = [f"{k}={v}" for k, v in (
            ("moe_ffn_hidden_size", model.moe_ffn_hidden_size),
            ("moe_shared_expert_intermediate_size", model.moe_shared_expert_intermediate_size),
            ("moe_aux_loss_coeff", model.moe_aux_loss_coeff or None),
            ("moe_z_loss_coeff", model.moe_z_loss_coeff),
            ("moe_router_enable_expert_bias", model.moe_router_enable_expert_bias or None),
            ("moe_token_dispatcher_type", None if model.moe_token_dispatcher_type == "alltoall"
             else model.moe_token_dispatcher_type),
            ("moe_expert_capacity_factor", model.moe_expert_capacity_factor),
            ("moe_router_bias_update_rate", None if model.moe_router_bias_update_rate
             == ModelConfig.moe_router_bias_update_rate else model.moe_router_bias_update_rate))
            if v is not None]
        if ignored:
            raise ValueError(f"model.{ignored[0]} is ignored by a dense model "
                             f"(model.num_moe_experts=null). Fix: set model.num_moe_experts, or "
                             f"remove the override.")
        return
    positive_int("model.num_moe_experts", experts, "set it to the experts of each MoE block, "
                  "or null for a dense model")
    if not 1 <= model.moe_router_topk <= experts:
        raise ValueError(f"model.moe_router_topk={model.moe_router_topk} must be in [1, "
                         f"model.num_moe_experts={experts}]. Fix: route each token to that many "
                         f"experts at most.")
    for key in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        if getattr(model, key) is not None:
            positive_int(f"model.{key}", getattr(model, key), "or null")
    freq, layers = model.moe_layer_freq, model.num_layers
    if isinstance(freq, (list, tuple)):
        if len(freq) != layers or any(v not in (0, 1) or isinstance(v, bool) for v in freq):
            raise ValueError(f"model.moe_layer_freq={list(freq)} must be a list of 0 (dense) and "
                             f"1 (MoE), one per block of model.num_layers={layers}. Fix: give "
                             f"{layers} entries, or an integer k (every k-th block).")
    elif not isinstance(freq, int) or isinstance(freq, bool) or freq < 1:
        raise ValueError(f"model.moe_layer_freq={freq!r} must be an integer >= 1 (every k-th "
                         f"block is MoE) or a list of 0/1 per block. Fix: use 1 for every block.")
    if not any(model.is_moe_block(i) for i in range(layers)):
        raise ValueError(f"model.moe_layer_freq={freq!r} makes no block MoE. Fix: set at least "
                         f"one 1, or model.num_moe_experts=null for a dense model.")
    one_of("model.moe_router_score_function", model.moe_router_score_function,
            MOE_SCORE_FUNCTIONS, "router score function")
    if model.moe_router_pre_softmax and model.moe_router_score_function != "softmax":
        raise ValueError("model.moe_router_pre_softmax=true is ignored by "
                         f"model.moe_router_score_function={model.moe_router_score_function}. "
                         "Fix: set model.moe_router_pre_softmax=false.")
    if model.moe_router_enable_expert_bias and not (
            model.moe_router_score_function == "sigmoid" or model.moe_router_pre_softmax):
        raise ValueError("model.moe_router_enable_expert_bias=true adds the bias to scores in "
                         "[0, 1], which the top-k logits' softmax has not. Fix: set "
                         "model.moe_router_score_function=sigmoid (DeepSeek-V3's), or "
                         "model.moe_router_pre_softmax=true.")
    if model.moe_router_topk_scaling_factor is not None:
        finite("model.moe_router_topk_scaling_factor", model.moe_router_topk_scaling_factor, 0,
                False, fix="use e.g. 2.5, or null for 1")
    balancing = model.moe_router_load_balancing_type
    one_of("model.moe_router_load_balancing_type", balancing, MOE_BALANCING,
            "load-balancing loss")
    one_of("model.moe_token_dispatcher_type", model.moe_token_dispatcher_type,
            MOE_DISPATCHERS, "token dispatcher")
    finite("model.moe_aux_loss_coeff", model.moe_aux_loss_coeff, 0, True, fix="use e.g. 1e-2")
    if balancing == "none" and model.moe_aux_loss_coeff:
        raise ValueError(f"model.moe_aux_loss_coeff={model.moe_aux_loss_coeff} is ignored with "
                         f"model.moe_router_load_balancing_type=none. Fix: choose aux_loss or "
                         f"seq_aux_loss, or set the coefficient to 0.")
    if model.moe_z_loss_coeff is not None:
        finite("model.moe_z_loss_coeff", model.moe_z_loss_coeff, 0, True,
                fix="use e.g. 1e-3, or null for no z-loss")
    finite("model.moe_router_bias_update_rate", model.moe_router_bias_update_rate, 0, False,
            fix="use e.g. 1e-3")
    rate = model.moe_router_bias_update_rate
    if not model.moe_router_enable_expert_bias and rate != ModelConfig.moe_router_bias_update_rate:
        raise ValueError(f"model.moe_router_bias_update_rate={rate} is set but "
                         "model.moe_router_enable_expert_bias=false: there is no expert bias to "
                         "move, so nothing would read it. Fix: set "
                         "model.moe_router_enable_expert_bias=true, or leave the rate out.")
    if model.moe_expert_capacity_factor is not None:
        finite("model.moe_expert_capacity_factor", model.moe_expert_capacity_factor, 0, False,
                fix="use e.g. 1.25 (each expert runs at most 1.25 x its even share), or null "
                    "for dropless")


MOE = Part(
    "moe", "mlp", "trainer.model.moe:moe_mlp", shapes,
    tp_styles={"shared.gate_up": "column", "shared.down": "row"},
    fused=lambda cfg: {"shared.gate_up": (1, 1)},
    # The router is whole on every rank; the experts are split over expert parallel instead
    # (parallel.experts; trainer.plan.axis_costs.tensor refuses TP without SP for them).
    whole=("router", "experts"),
    residual_outputs=("experts.down", "shared.down.weight"),
    hook="activation_fn",  # the experts' silu(gate) * up, as the dense MLP's
    hf_names=hf_names, rules=check_moe)
