"""Multi-latent attention (DeepSeek-V2/V3's): the part "mla". Its layer:
trainer.model.mla.

Tensor parallel splits the up-projections (q_up or q, kv_up) by heads and the output
projection by its inputs, as grouped-query attention's. The down-projections stay whole on
every rank, as Megatron-Core's TE layer spec keeps them ("duplicated"): their outputs are small
latents shared by all heads, so splitting them would cost a gather of the latent for no saved
FLOP worth having. Under sequence parallel they run on the rank's own tokens and the latents
are gathered by the up-projections (as any column layer's input is); the shared rotary key is
gathered by the layer's `shared_key_fn`; their gradients, like a norm's, are summed over TP.

Its terms of the memory plan (symbols as in trainer.plan.activations; n heads, dq = qk_head_dim
+ qk_pos_emb_head_dim a query or key head, dv = v_head_dim, r the rotary part, Lq = q_lora_rank,
Lkv = kv_lora_rank; without CP):

    down          the block's normed input Tr*h*e (both projections read it)
    latents       q: its norm's input and output Tr*Lq*e each, its rsqrt, the up-projection's
                  gathered input T*Lq*e; kv: the same of Lkv, and the rotary key Tr*r*e
    up            q's and kv's up-projection outputs T*n/t*(dq + (dq - r) + dv)*e
    rotary        q's and the shared key's rotary inputs in fp32, cos/sin 8*T*r
    attention     q and k as the kernels take them 2*T*n/t*dq*e, the output T*n/t*dv*e,
                  the logsumexp 4*b*(n/t)*s
"""
from __future__ import annotations

from trainer.config import CPCommType, ModelConfig, RecomputeGranularity
from trainer.parts.attention import rope_rules
from trainer.parts.part import HfNames, Part, Shapes
from trainer.parts.tokens import FP32, Tokens
from trainer.values import positive_int


def shapes(cfg: ModelConfig) -> Shapes:
    h, n, r = cfg.hidden_size, cfg.num_heads, cfg.qk_pos_emb_head_dim
    dq = cfg.qk_head_dim + r
    q = {"q.weight": (n * dq, h)} if cfg.q_lora_rank is None else {
        "q_down.weight": (cfg.q_lora_rank, h), "q_latent_norm.weight": (cfg.q_lora_rank,),
        "q_up.weight": (n * dq, cfg.q_lora_rank)}
    return q | {"kv_down.weight": (cfg.kv_lora_rank + r, h),
                "kv_latent_norm.weight": (cfg.kv_lora_rank,),
                "kv_up.weight": (n * (cfg.qk_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
                "o.weight": (h, n * cfg.v_head_dim)}


def hf_names(cfg: ModelConfig, ours: str, theirs: str, family) -> HfNames:
    """DeepSeek-V3's names (transformers' DeepseekV3Attention), row for row: q's heads are
    [qk_head_dim | qk_pos_emb_head_dim] each, kv_down's rows the latent then the shared rotary
    key, kv_up's heads [qk_head_dim | v_head_dim] each. Their rotary rows may be interleaved
    pairs (rope_interleave): hf_families.row_orders reorders them."""
    h, n, r = cfg.hidden_size, cfg.num_heads, cfg.qk_pos_emb_head_dim
    dq, attn = cfg.qk_head_dim + r, f"{theirs}self_attn."
    q = {f"{ours}attn.q.weight": [(f"{attn}q_proj.weight", n * dq)]} \
        if cfg.q_lora_rank is None else {
        f"{ours}attn.q_down.weight": [(f"{attn}q_a_proj.weight", cfg.q_lora_rank)],
        f"{ours}attn.q_latent_norm.weight": [(f"{attn}q_a_layernorm.weight", cfg.q_lora_rank)],
        f"{ours}attn.q_up.weight": [(f"{attn}q_b_proj.weight", n * dq)]}
    return q | {
        f"{ours}attn.kv_down.weight": [(f"{attn}kv_a_proj_with_mqa.weight",
                                        cfg.kv_lora_rank + r)],
        f"{ours}attn.kv_latent_norm.weight": [(f"{attn}kv_a_layernorm.weight",
                                               cfg.kv_lora_rank)],
        f"{ours}attn.kv_up.weight": [(f"{attn}kv_b_proj.weight",
                                      n * (cfg.qk_head_dim + cfg.v_head_dim))],
        f"{ours}attn.o.weight": [(f"{attn}o_proj.weight", h)]}


def core_flops(cfg: ModelConfig, seq_length: int) -> float:
    """QK^T over heads of qk_head_dim + qk_pos_emb_head_dim and AV over v_head_dim, each
    2*S*width per token, halved: a query sees the keys before it."""
    dq = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim
    return seq_length * cfg.num_heads * (dq + cfg.v_head_dim)


def kept_bytes(m: ModelConfig, k: Tokens, e: int, recompute: RecomputeGranularity | None,
               cp_comm_type: CPCommType = CPCommType.p2p) -> int:
    """What the part keeps for its backward without full recompute (the module docstring)."""
    n, r, dv = m.num_heads // k.t, m.qk_pos_emb_head_dim, m.v_head_dim
    dq = m.qk_head_dim + r
    latents = sum(2 * k.Tr * width * e + FP32 * k.Tr + k.T * width * e
                  for width in (m.q_lora_rank, m.kv_lora_rank) if width)
    up = k.T * n * (dq + m.qk_head_dim + dv) * e
    rotary = FP32 * k.T * (n + 1) * r + 8 * k.T * r
    selective = recompute is RecomputeGranularity.selective
    lse = 0 if selective else FP32 * k.b * n * k.s
    attention = 2 * k.T * n * dq * e + k.T * n * dv * e + lse
    return k.Tr * m.hidden_size * e + latents + k.Tr * r * e + up + rotary + attention


def rules(model: ModelConfig) -> None:
    """The latent ranks and head widths, and that nothing of grouped-query attention's is
    asked of it."""
    if model.num_query_groups not in (None, model.num_heads):
        raise ValueError(
            f"model.num_query_groups={model.num_query_groups} with "
            f"model.multi_latent_attention=true: every head has its own key and value, "
            f"expanded from the shared latent. Fix: set model.num_query_groups=null.")
    if model.qk_layernorm:
        raise ValueError("model.qk_layernorm=true with model.multi_latent_attention=true: its "
                         "latents are normed instead. Fix: set model.qk_layernorm=false.")
    for key in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        positive_int(f"model.{key}", getattr(model, key),
                     "see conf/model/deepseek_v3.yaml for DeepSeek-V3's")
    if model.q_lora_rank is not None:
        positive_int("model.q_lora_rank", model.q_lora_rank,
                     "set the query's latent width, or null to project q directly")
    if model.qk_pos_emb_head_dim % 2:
        raise ValueError(
            f"model.qk_pos_emb_head_dim={model.qk_pos_emb_head_dim} is odd; rotary embeddings "
            f"turn pairs of dims. Fix: use an even width (DeepSeek-V3's is 64).")
    rope_rules(model)


MLA = Part(
    "mla", "attn", "trainer.model.mla:MultiLatentAttention", shapes,
    tp_styles={"q": "column", "q_up": "column", "kv_up": "column", "o": "row"},
    whole=("q_down", "kv_down"),
    residual_outputs=("o.weight",),
    hook="attention_fn",
    tp_shared="shared_key_fn",
    core_flops=core_flops, kept_bytes=kept_bytes, hf_names=hf_names, rules=rules)
