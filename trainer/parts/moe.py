"""A mixture of experts as the MLP of a block (the part "moe"): a router over E experts, the
experts as two 3-D weights ([E, 2F, h] and [E, h, F]) and an optional shared expert, a SwiGLU
every token passes through. Its rules are the MoE keys' (refused on a dense model, where they
would be ignored). Its layer: trainer.model.moe.

Its terms of the memory plan (tensor by tensor as measured with
torch.autograd.graph.saved_tensors_hooks). Symbols as in trainer.plan.activations, and E experts,
K = moe_router_topk, F the expert FFN size, Tk = T*K (token, expert) pairs, fs the shared
expert's size; the router runs in fp32 (4 bytes), int64 indices take 8:

    router        its input T*h fp32; the chosen experts T*K int64; the weights: the top-k
                  softmax T*K (softmax), the scores T*E, the chosen T*K and their sum T
                  (sigmoid), the scores T*E (pre_softmax); the balance losses' scores T*E
                  (aux_loss, seq_aux_loss), the z-loss's logits T*E and logsumexp T
    experts       the pairs' inputs, the down projection's output and the weighted output
                  3*Tk*h*e; gate_up's output 2*Tk*F*e, silu(gate) and the product 2*Tk*F*e
                  (selective: the product only); the pairs' weights Tk*e; their order and
                  tokens 2*Tk int64; under bf16 a bf16 copy of the weights of every expert on
                  the rank 3*(E/EP)*F*h*e; under EP the arrived rows' regrouping by expert and
                  its inverse 2*Tk int64 (the expected case: as many rows arrive as leave);
                  under ETP every peer's rows as the GEMM's input, (ETP-1)*Tk*h*e more, and
                  their regrouping and its inverse 2*ETP*Tk int64 (each expert's F is F/ETP)
    shared        as a dense MLP of fs: 4*T*fs*e (selective 3), and under bf16 its input T*h*e
"""
from __future__ import annotations

from trainer.config import ModelConfig, RecomputeGranularity
from trainer.parts.mlp import activation_rules, activation_units, swiglu_shapes
from trainer.parts.part import HfNames, Part, Shapes
from trainer.parts.tokens import FP32, Tokens
from trainer.values import finite, one_of, positive_int


def shapes(cfg: ModelConfig) -> Shapes:
    E, fe, h, shared = (cfg.num_moe_experts, cfg.expert_ffn_size, cfg.hidden_size,
                        cfg.moe_shared_expert_intermediate_size)
    out = {"router.weight": (E, h), "experts.gate_up": (E, 2 * fe, h),
           "experts.down": (E, h, fe)}
    if cfg.add_bias_linear:  # in the layers' named_parameters() order
        out = {"router.weight": (E, h), "router.bias": (E,), "experts.gate_up": (E, 2 * fe, h),
               "experts.down": (E, h, fe), "experts.gate_up_bias": (E, 2 * fe, 1),
               "experts.down_bias": (E, h, 1)}
    gate = {"shared_gate.weight": (1, h)} if shared and cfg.moe_shared_expert_gate else {}
    return out | (swiglu_shapes(h, shared, "shared.", cfg.add_bias_linear) if shared else {}) \
        | gate


def hf_names(cfg: ModelConfig, ours: str, theirs: str, family) -> HfNames:
    """Theirs are per expert on disk (gate, up and down projections, named by the family), so
    expert e's gate and up are rows 2Fe.. of our first weight and its down rows he.. of the
    second, viewed 2-D. The shared expert and the expert bias (a buffer of ours) take
    the family's names (DeepSeek-V3's shared_experts, Qwen3-Next's shared_expert and its
    shared_expert_gate)."""
    E, f, h = cfg.num_moe_experts, cfg.expert_ffn_size, cfg.hidden_size
    module, (gate, up, down) = family.expert_names
    experts = f"{theirs}{module}.experts"
    names = {
        f"{ours}mlp.router.weight": [(f"{theirs}{module}.gate.weight", E)],
        f"{ours}mlp.experts.gate_up": [(f"{experts}.{e}.{p}.weight", f)
                                       for e in range(E) for p in (gate, up)],
        f"{ours}mlp.experts.down": [(f"{experts}.{e}.{down}.weight", h) for e in range(E)],
    }
    if cfg.moe_router_enable_expert_bias:
        names[f"{ours}mlp.{EXPERT_BIAS}"] = [(f"{theirs}{module}.gate.e_score_correction_bias",
                                              E)]
    shared, one = cfg.moe_shared_expert_intermediate_size, f"{theirs}{module}.{family.shared}"
    if shared:
        names |= {
            f"{ours}mlp.shared.gate_up.weight": [(f"{one}.{p}.weight", shared)
                                                 for p in (gate, up)],
            f"{ours}mlp.shared.down.weight": [(f"{one}.{down}.weight", h)]}
    if shared and cfg.moe_shared_expert_gate:
        names[f"{ours}mlp.shared_gate.weight"] = [(f"{one}_gate.weight", 1)]
    return names


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
            ("moe_shared_expert_gate", model.moe_shared_expert_gate or None),
            ("moe_aux_loss_coeff", model.moe_aux_loss_coeff or None),
            ("moe_z_loss_coeff", model.moe_z_loss_coeff),
            ("moe_router_enable_expert_bias", model.moe_router_enable_expert_bias or None),
            ("moe_token_dispatcher_type", None if model.moe_token_dispatcher_type == "alltoall"
             else model.moe_token_dispatcher_type),
            ("moe_expert_capacity_factor", model.moe_expert_capacity_factor),
            ("moe_router_num_groups", model.moe_router_num_groups),
            ("moe_router_group_topk", model.moe_router_group_topk),
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
    if model.moe_shared_expert_gate and not model.moe_shared_expert_intermediate_size:
        raise ValueError("model.moe_shared_expert_gate=true gates the shared expert, but "
                         "model.moe_shared_expert_intermediate_size=null: there is none. Fix: "
                         "set the shared expert's width, or model.moe_shared_expert_gate=false.")
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
    check_groups(model)
    activation_rules(model)  # the experts' activation is the dense MLP's
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


INDEX = 8  # int64


def router_bytes(m: ModelConfig, T: int) -> int:
    E, K = m.num_moe_experts, m.moe_router_topk
    kept = T * m.hidden_size * FP32 + T * K * INDEX
    if m.moe_router_score_function == "sigmoid":
        kept += (T * E + T * K + (T if K > 1 else 0)) * FP32
    elif m.moe_router_pre_softmax:
        kept += T * E * FP32
    else:
        kept += T * K * FP32
    if m.moe_router_load_balancing_type != "none" and m.moe_aux_loss_coeff:
        kept += T * E * FP32
    if m.moe_z_loss_coeff:
        kept += (T * E + T) * FP32
    return kept


def moe_mlp_bytes(m: ModelConfig, k: Tokens, e: int, recompute: RecomputeGranularity | None,
                  cp_comm_type=None) -> int:
    """What a mixture of experts' MLP keeps for its backward (no full recompute)."""
    T, h, F, E = k.Tr, m.hidden_size, m.expert_ffn_size, m.num_moe_experts
    Tk = T * m.moe_router_topk
    selective = recompute is RecomputeGranularity.selective
    act = 1 if selective else 2 + activation_units(m)  # act(gate) and the product
    experts = Tk * (3 * h + 2 * F + act * F + 1) * e + 2 * Tk * INDEX
    if k.ep > 1:  # parallel.experts: the permutations that regroup what arrived, and back
        experts += 2 * Tk * INDEX
    if k.etp > 1:  # every ETP peer's rows, regrouped, are the grouped GEMM's input here
        experts += (k.etp - 1) * Tk * h * e + 2 * k.etp * Tk * INDEX
    copies = 3 * E // k.ep * F // k.etp * h * e if e != FP32 else 0
    shared = 0
    if m.moe_shared_expert_intermediate_size:
        fs = m.moe_shared_expert_intermediate_size
        # TP-split as a dense MLP; its input is a new tensor when gathered over TP or cast
        shared = (3 if selective else 4 + activation_units(m)) * k.T * fs // k.t * e + (
            k.T * h * e if e != FP32 or k.sp else 0)
        if m.moe_shared_expert_gate:  # its output and the gate's sigmoid, for the product,
            # and the gate's own copy of its input (its cast under bf16; under SP a contiguous
            # copy, the input being a strided view of the sequence's scatter)
            shared += T * (h + 1) * e + (T * h * e if e != FP32 or k.sp else 0)
    return router_bytes(m, T) + experts + copies + shared


def moe_lora_kept_bytes(m: ModelConfig, k: Tokens, e: int,
                        recompute: RecomputeGranularity | None, cp_comm_type,
                        adapted: frozenset[str], grad_in: bool, dropout: bool) -> int:
    """Its weights frozen (peft=lora; adapters on the routed experts only): the router keeps no
    input (T*h fp32: its logits' gradient needs its weight alone), the pairs' inputs are kept
    only for gate_up's adapters and the product only for down's, and the shared expert keeps
    neither its input nor its product. Where its input carries no gradient (a first block
    whose attention has no adapters) it counts as trained: an upper bound."""
    kept = moe_mlp_bytes(m, k, e, recompute, cp_comm_type)
    if not grad_in:
        return kept
    Tk = k.Tr * m.moe_router_topk * k.etp  # the rows a rank's experts run (every ETP peer's)
    kept -= k.Tr * m.hidden_size * FP32
    if not adapted & {"gate_proj", "up_proj"}:
        kept -= Tk * m.hidden_size * e
    if "down_proj" not in adapted:
        kept -= Tk * m.expert_ffn_size // k.etp * e
    if m.moe_shared_expert_intermediate_size:
        kept -= k.T * m.moe_shared_expert_intermediate_size // k.t * e + (
            k.T * m.hidden_size * e if e != FP32 or k.sp else 0)
    return kept


def moe_backward_bytes(m: ModelConfig, k: Tokens, e: int, selective: bool) -> int:
    """The most a mixture of experts' backward forms beside what its block keeps, counted by
    the allocator: the gradient entering the block (fp32) and the larger of two moments of the
    experts' backward: the weighted output's gradient and the down projection's output's
    (2*Tk*h*e), or the latter beside the gradient of the down projection's input (Tk*(h+F)*e;
    under EP or ETP below), with the pairs' order (Tk int64)."""
    T, h, F = k.Tr, m.hidden_size, m.expert_ffn_size
    Tk = T * m.moe_router_topk
    # Under EP or ETP what the combine keeps arrived by an exchange, a tensor of its own, freed
    # by the combine's backward before the down projection's: that moment is its input's
    # gradient beside its output's, every ETP peer's rows (Tk*(F + (ETP-1)*h)).
    down = F + (k.etp - 1) * h if k.ep > 1 or k.etp > 1 else h + F
    return T * h * FP32 + Tk * max(2 * h, down) * e + Tk * INDEX


def moe_rebuild_bytes(m: ModelConfig, k: Tokens, e: int) -> int:
    """A fully recomputed MoE block's forward runs inside the backward. Under EP or ETP, at
    the exchange back it holds, beside the gradient entering the block, the rows it sends and
    those it receives (every ETP peer's: 2*ETP*Tk*h*e) and its own rows' input (Tk*h*e, the
    dispatch's argument), while the two of what the block keeps that the combine makes after
    it (the summed output and the weighted one, 2*Tk*h*e) are not there yet: (2*ETP - 1)*Tk*h*e
    more than what it keeps. Without an exchange, nothing beyond its backward's moments."""
    if k.ep == 1 and k.etp == 1:
        return 0
    Tk = k.Tr * m.moe_router_topk
    return k.Tr * m.hidden_size * FP32 + (2 * k.etp - 1) * Tk * m.hidden_size * e


def dispatch_rows(m: ModelConfig, k: Tokens, e: int, recompute: RecomputeGranularity | None,
                  micro_batch_tokens: int) -> dict[str, int]:
    """Under EP or ETP, one MoE layer's rows on a rank in one micro-batch: the rows it sends
    (its tokens' (token, expert) pairs), the rows its experts run in the expected case (the
    router balanced: as many arrive from each EP source as leave; every ETP peer's too), which
    the memory plan's peak counts, and at most (dropless: every row of its EP group to its
    experts), with what its experts keep per row that runs there (their input, gate_up's
    output, silu(gate) and the product, the regrouping and its inverse): the worst case's
    bytes beyond the plan. With an expert capacity (model.moe_expert_capacity_factor) each of
    its experts runs at most its capacity over the micro-batch's `micro_batch_tokens` tokens
    (exact ties aside), which bounds the most. Empty for a dense model or without EP and
    ETP."""
    if m.num_moe_experts is None or (k.ep == 1 and k.etp == 1):
        return {}
    sent = k.Tr * m.moe_router_topk
    selective = recompute is RecomputeGranularity.selective
    per_row = (m.hidden_size + (3 if selective else 4 + activation_units(m))
               * m.expert_ffn_size // k.etp) * e \
        + 2 * INDEX
    expected, most = sent * k.etp, sent * k.ep * k.etp
    if m.moe_expert_capacity_factor is not None:  # (a factor under 1 bounds both)
        most = min(most, m.num_moe_experts // k.ep * m.expert_capacity(micro_batch_tokens))
        expected = min(expected, most)
    return {"rows_sent": sent, "rows_expected": expected, "rows_most": most,
            "kept_bytes_per_row": per_row, "worst_case_extra_bytes": (most - expected) * per_row}


EXPERT_BIAS = "router.expert_bias"  # DeepSeek-V3's auxiliary-loss-free bias, a buffer


def buffers(cfg: ModelConfig) -> Shapes:
    """The router's expert bias (model.moe_router_enable_expert_bias)."""
    return {EXPERT_BIAS: (cfg.num_moe_experts,)} if cfg.moe_router_enable_expert_bias else {}


def check_groups(model: ModelConfig) -> None:
    """Group-limited routing: groups of equal size, at least one of the token's experts from
    each chosen group (Megatron ranks a group by its topk / group_topk best scores), and
    enough experts in the chosen groups."""
    groups, chosen, experts, k = (model.moe_router_num_groups, model.moe_router_group_topk,
                                  model.num_moe_experts, model.moe_router_topk)
    if (groups is None) != (chosen is None):
        unset = "moe_router_group_topk" if chosen is None else "moe_router_num_groups"
        written = {None: "null"}
        raise ValueError(f"model.moe_router_num_groups={written.get(groups, groups)} and "
                         f"model.moe_router_group_topk={written.get(chosen, chosen)}: "
                         f"group-limited routing needs both. Fix: set model.{unset}, or both "
                         f"to null.")
    if groups is None:
        return
    positive_int("model.moe_router_num_groups", groups, "or null for no groups")
    if experts % groups:
        raise ValueError(f"model.moe_router_num_groups={groups} does not divide "
                         f"model.num_moe_experts={experts}. Fix: use a divisor of {experts}.")
    if not 1 <= chosen <= groups:
        raise ValueError(f"model.moe_router_group_topk={chosen} must be in [1, "
                         f"model.moe_router_num_groups={groups}]. Fix: choose that many groups "
                         f"at most.")
    if not chosen <= k <= chosen * (experts // groups):
        raise ValueError(f"model.moe_router_topk={k} with model.moe_router_group_topk={chosen} "
                         f"groups of {experts // groups} experts: each chosen group gives "
                         f"topk / group_topk >= 1 of the token's experts, and they hold "
                         f"{chosen * (experts // groups)}. Fix: a topk in [{chosen}, "
                         f"{chosen * (experts // groups)}].")


MOE = Part(
    "moe", "mlp", "trainer.model.moe:moe_mlp", shapes,
    tp_styles={"shared.gate_up": "column", "shared.down": "row"},
    fused=lambda cfg: {"shared.gate_up": (1, 1), "experts.gate_up": (1, 1)},
    # LoRA: one adapter per routed expert, as PEFT reads these names on a mixture of experts
    # (trainer.parts.lora); the shared expert takes none there, so none here.
    lora_targets={"experts.gate_up": ("gate_proj", "up_proj"), "experts.down": ("down_proj",)},
    # The router is whole on every rank; the experts are split over expert parallel instead
    # (parallel.experts; trainer.plan.axis_costs.tensor refuses TP without SP for them).
    whole=("router", "experts", "shared_gate"),
    # a router classifies tokens over experts, the shared gate weighs one expert: no hidden
    # maps for Muon
    adamw_linears=("router", "shared_gate"),
    experts=("experts",),
    # [E, 2F, h]: each expert's gate|up rows split alike; [E, h, F]: its inputs split
    expert_splits={"gate_up": (1, (1, 1)), "down": (2, (1,)),
                   # [E, out, 1] biases: split with their weights' rows (down_bias: each ETP
                   # rank adds its slice at its columns, trainer.model.moe.Experts.row_bias_fn)
                   "gate_up_bias": (1, (1, 1)), "down_bias": (1, (1,))},
    buffer_names=(EXPERT_BIAS,), buffers=buffers,
    residual_outputs=("experts.down", "shared.down.weight"),
    hook="activation_fn",  # the experts' act(gate) * up, as the dense MLP's
    kept_bytes=moe_mlp_bytes, lora_kept_bytes=moe_lora_kept_bytes,
    backward_bytes=moe_backward_bytes, rebuild_bytes=moe_rebuild_bytes,
    hf_names=hf_names, rules=check_moe)
