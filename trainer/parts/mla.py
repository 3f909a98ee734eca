"""Multi-latent attention (DeepSeek-V2/V3's): the part "mla". Its layer:
trainer.model.mla.

Tensor parallel splits the up-projections (q_up or q, kv_up) by heads and the output
projection by its inputs, as grouped-query attention's. The down-projections stay whole on
every rank, as Megatron-Core's TE layer spec keeps them ("duplicated"): their outputs are small
latents shared by all heads, so splitting them would cost a gather of the latent for no saved
FLOP worth having. Under sequence parallel they run on the rank's own tokens and the latents
are gathered by the up-projections (as any column layer's input is); the shared rotary key is
gathered by the layer's `shared_key_fn`; their gradients, like a norm's, are summed over TP.

Its terms of the memory plan (kept_bytes), each a tensor autograd keeps, as
tests/multirank/test_step_memory.py measures them; symbols as in trainer.plan.activations, and
n = num_heads / t a rank's heads, a = qk_head_dim + qk_pos_emb_head_dim the width of a query or
key head, dn = qk_head_dim, r = qk_pos_emb_head_dim, dv = v_head_dim, L = q_lora_rank or
kv_lora_rank:

    down        the normed input as the q and kv down-projections read it: once (T*h*e) in
                fp32 without SP; else a copy each, as autocast casts it per linear and SP's
                sequence-major input is copied by each: 2*Tr*h*e (T*h*e + Tr*h*e where q is
                projected directly, q_lora_rank null: one column layer, its input gathered);
                in bf16 also autocast's copies of their whole weights (q_down's, kv_down's)
    latents     of each latent norm its input Tr*L*e (kv's: the whole down-projection output
                Tr*(L + r)*e, the latent a view of it), rsqrt Tr*e and normalised latent Tr*L*e
                (in the compute dtype: autocast runs the norm in it), the up-projection's input
                T*L*e (gathered under SP)
    rotary      cos and sin of q's rotation and of the shared key's, fp32: 8*T*r
    attention   in units of A = T*n*a*e (q, k or v padded to a: the fused kernels take one
                width; trainer.model.attention.causal_attention and, under CP,
                parallel.context.NarrowValues) and O = T*n*dv*e (the output cut back to
                dv, copied as o's input): q, k, padded v and output 4A + O without CP and with
                p2p (the stacked K/V 2A) or a2a (head-split q, k, v 3A); all_gather: q, the
                output, the gathered K and padded V, 2A + O + 2*b*S*n*a*e; the logsumexp
                4*b*n*s
    selective   keeps of the attention q and k 2A, v's base, kv_up's output T*n*(dn + dv)*e,
                and O, with CP of any type or without
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


def core_flops(cfg: ModelConfig, seq_length: int, window: int | None = None) -> float:
    """QK^T over heads of qk_head_dim + qk_pos_emb_head_dim and AV over v_head_dim, each
    2*S*width per token, halved: a query sees the keys before it."""
    dq = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim
    return seq_length * cfg.num_heads * (dq + cfg.v_head_dim)


def exchanged_widths(cfg: ModelConfig) -> tuple[int, int]:
    """(q's width, k's or v's) as context parallel's exchanges move them (its cost,
    trainer.plan.axis_costs.context): every head's, v padded to q's (parallel.context's
    NarrowValues); the output returns as wide."""
    width = cfg.num_heads * (cfg.qk_head_dim + cfg.qk_pos_emb_head_dim)
    return width, width


def kept_bytes(m: ModelConfig, k: Tokens, e: int, recompute: RecomputeGranularity | None,
               cp_comm_type: CPCommType = CPCommType.p2p) -> int:
    """What the part keeps for its backward without full recompute (the module docstring)."""
    return (down_bytes(m, k, e) + latent_bytes(m, k, e) + 8 * k.T * m.qk_pos_emb_head_dim
            + attention_bytes(m, k, e, recompute, cp_comm_type))


def down_bytes(m: ModelConfig, k: Tokens, e: int) -> int:
    """The normed input as q's and kv's projections keep it (one storage or a copy each), and
    autocast's copies of the whole down-projections' weights (the plan's autocast term counts
    the split ones)."""
    h = m.hidden_size
    q_input = (k.T if m.q_lora_rank is None else k.Tr) * h * e
    shared = e == FP32 and not k.sp
    whole = (m.q_lora_rank or 0) + m.kv_lora_rank + m.qk_pos_emb_head_dim
    return q_input + (0 if shared else k.Tr * h * e) + (0 if e == FP32 else whole * h * e)


def latent_bytes(m: ModelConfig, k: Tokens, e: int) -> int:
    """Each latent norm's input, rsqrt and output, and its up-projection's input."""
    kept = 0
    for width, rotary in ((m.q_lora_rank, 0), (m.kv_lora_rank, m.qk_pos_emb_head_dim)):
        if width:
            kept += k.Tr * (width + rotary) * e + k.Tr * e + k.Tr * width * e + k.T * width * e
    return kept


def attention_bytes(m: ModelConfig, k: Tokens, e: int, recompute: RecomputeGranularity | None,
                    cp_comm_type: CPCommType) -> int:
    """q, k, v (padded to q's width) and the output as the kernels keep them, by
    context-parallel exchange, and o's input."""
    n = m.num_heads // k.t
    a = m.qk_head_dim + m.qk_pos_emb_head_dim
    # the docstring's units A (q, k, padded v or output) and O (o's input)
    a_bytes, o_bytes = k.T * n * a * e, k.T * n * m.v_head_dim * e
    if recompute is RecomputeGranularity.selective:
        return 2 * a_bytes + k.T * n * (m.qk_head_dim + m.v_head_dim) * e + o_bytes
    lse = FP32 * k.b * n * k.s
    if k.cp and cp_comm_type is CPCommType.all_gather:
        return 2 * a_bytes + 2 * k.b * k.S * n * a * e + o_bytes + lse
    return 4 * a_bytes + o_bytes + lse


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
    for key, plain in (("rotary_percent", 1.0), ("attention_output_gate", False)):
        if getattr(model, key) != plain:
            raise ValueError(f"model.{key}={getattr(model, key)!r} with model."
                             f"multi_latent_attention=true: grouped-query attention's only "
                             f"(multi-latent attention's rotary part is qk_pos_emb_head_dim). "
                             f"Fix: set model.{key}={plain!r}.")
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
    if model.window_size is not None or model.softmax_type != "vanilla":
        key = "window_size" if model.window_size is not None else "softmax_type"
        raise ValueError(f"model.{key}={getattr(model, key)} with "
                         f"model.multi_latent_attention=true: multi-latent attention has no "
                         f"sliding window or sinks here. Fix: set model.{key} to "
                         f"{'null' if key == 'window_size' else 'vanilla'}.")
    for key in ("add_bias_linear", "add_qkv_bias"):
        if getattr(model, key):
            raise ValueError(f"model.{key}=true with model.multi_latent_attention=true: "
                             f"multi-latent attention's projections have no biases here. Fix: "
                             f"set model.{key}=false.")


MLA = Part(
    "mla", "attn", "trainer.model.mla:MultiLatentAttention", shapes,
    tp_styles={"q": "column", "q_up": "column", "kv_up": "column", "o": "row"},
    whole=("q_down", "kv_down"),
    residual_outputs=("o.weight",),
    hook="attention_fn",
    tp_shared="shared_key_fn",
    core_flops=core_flops, kept_bytes=kept_bytes, hf_names=hf_names, rules=rules,
    exchanged_widths=exchanged_widths)
