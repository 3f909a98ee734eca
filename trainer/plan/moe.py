"""A mixture-of-experts block's terms of the plan (trainer/model/moe.py): what its MLP keeps for
the backward, tensor by tensor as measured with torch.autograd.graph.saved_tensors_hooks, and
what its backward forms beside that. Symbols as in trainer.plan.activations, and E experts,
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
                  its inverse 2*Tk int64 (the expected case: as many rows arrive as leave)
    shared        as a dense MLP of fs: 4*T*fs*e (selective 3), and under bf16 its input T*h*e
"""
from __future__ import annotations

from trainer.config import ModelConfig, RecomputeGranularity
from trainer.plan.tokens import FP32, Tokens

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


def moe_mlp_bytes(m: ModelConfig, k: Tokens, e: int,
                  recompute: RecomputeGranularity | None) -> int:
    """What a mixture of experts' MLP keeps for its backward (no full recompute)."""
    T, h, F, E = k.Tr, m.hidden_size, m.expert_ffn_size, m.num_moe_experts
    Tk = T * m.moe_router_topk
    selective = recompute is RecomputeGranularity.selective
    experts = Tk * (3 * h + 2 * F + (1 if selective else 2) * F + 1) * e + 2 * Tk * INDEX
    if k.ep > 1:  # parallel.experts: the permutations that regroup what arrived, and back
        experts += 2 * Tk * INDEX
    copies = 3 * E // k.ep * F * h * e if e != FP32 else 0
    shared = 0
    if m.moe_shared_expert_intermediate_size:
        fs = m.moe_shared_expert_intermediate_size
        # TP-split as a dense MLP; its input is a new tensor when gathered over TP or cast
        shared = (3 if selective else 4) * k.T * fs // k.t * e + (
            k.T * h * e if e != FP32 or k.sp else 0)
    return router_bytes(m, T) + experts + copies + shared


def moe_backward_bytes(m: ModelConfig, k: Tokens, e: int, selective: bool) -> int:
    """The most a mixture of experts' backward forms beside what its block keeps, counted by
    the allocator: the gradient entering the block (fp32) and the larger of two moments of the
    experts' backward: the weighted output's gradient and the down projection's output's
    (2*Tk*h*e), or the latter beside the gradient of the down projection's input (Tk*(h+F)*e),
    with the pairs' order (Tk int64)."""
    T, h, F = k.Tr, m.hidden_size, m.expert_ffn_size
    Tk = T * m.moe_router_topk
    return T * h * FP32 + Tk * max(2 * h, h + F) * e + Tk * INDEX
