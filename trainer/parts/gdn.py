"""Gated DeltaNet (Qwen3-Next's linear attention): the part "gated_delta_net", the attention of
the blocks model.linear_attention_freq names linear (model.experimental_attention_variant=
gated_delta_net). Its layer: trainer.model.gdn.

Projections: in_proj_qkvz (per key head: q, k, then its value heads' v and z) and in_proj_ba
(per key head: its value heads' b and a), both column-parallel: a split by rows keeps whole key
heads with their value heads, so TP splits the key heads (and with them the value heads) with
no fused parts. out_proj is row-parallel. The convolution's weight (depthwise over q|k|v's
channels), A_log and dt_bias (per value head) and the gated norm's weight (per value dim,
shared by the heads) are whole on every rank: each TP rank reads its heads' entries through
heads_fn, and their gradients are summed over TP (head_norms).

Symbols of the memory terms as trainer.plan.activations': T tokens of a rank's micro-batch
before SP's split (Tr after it), t TP, e bytes of the compute dtype; here Kq = key heads x
key_dim and V = value heads x value_dim of the whole layer, C its convolution's channels
(2Kq + V), hv its value heads, all divided by t on a rank.
"""
from __future__ import annotations

from trainer.config import CPCommType, ModelConfig, RecomputeGranularity
from trainer.parts.part import HfNames, Part, Shapes
from trainer.parts.tokens import FP32, Tokens
from trainer.values import one_of, positive_int

CHUNK = 64  # tokens of one chunk of the chunked form (flash-linear-attention's)
VARIANTS = ("gated_delta_net",)  # model.experimental_attention_variant (Megatron's)


def shapes(cfg: ModelConfig) -> Shapes:
    """In the layer's named_parameters() order: its own tensors, then its modules'."""
    h, hv = cfg.hidden_size, cfg.linear_num_value_heads
    kq, v = cfg.linear_key_size, cfg.linear_value_size
    return {"conv_weight": (2 * kq + v, cfg.linear_conv_kernel_dim), "A_log": (hv,),
            "dt_bias": (hv,), "in_proj_qkvz.weight": (2 * kq + 2 * v, h),
            "in_proj_ba.weight": (2 * hv, h), "norm.weight": (cfg.linear_value_head_dim,),
            "out_proj.weight": (h, v)}


def core_flops(cfg: ModelConfig, seq_length: int, window: int | None = None) -> float:
    """The chunked rule's products per token (forward), each value head: k_beta k^T and q k^T
    within the chunk (2 C dk each), the two triangular solves (C dv and C dk), the chunk's
    attention on its new values (2 C dv), and the state read twice and written once
    (2 dk dv each), with C = CHUNK. The convolution is a 2-D weight (2 W, as a linear's)."""
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    chunk = min(CHUNK, seq_length)
    return cfg.linear_num_value_heads * (chunk * (5 * dk + 3 * dv) + 6 * dk * dv)


def kept_bytes(m: ModelConfig, k: Tokens, e: int, recompute: RecomputeGranularity | None,
               cp_comm_type: CPCommType = CPCommType.p2p) -> int:
    """What the layer keeps for its backward (no full recompute): the projections' input
    T*h*e, the convolution's input, padded copy and output (3*T*C/t*e), z, beta and g's terms,
    and the chunked rule's tensors in fp32 (its q, k, v, the decays and per-chunk systems:
    chunk_bytes); under selective recompute only the rule's inputs."""
    T, t = k.T, k.t
    conv = m.linear_conv_kernel_dim
    C = (2 * m.linear_key_size + m.linear_value_size) // t
    hv, V = m.linear_num_value_heads // t, m.linear_value_size // t
    own = T * m.hidden_size * e + T * V * e + 3 * T * hv * FP32 + T * hv * e
    if recompute is RecomputeGranularity.selective:
        return own + T * C * e + C * conv * e
    return own + 3 * T * C * e + chunk_bytes(m, k)


def chunk_bytes(m: ModelConfig, k: Tokens) -> int:
    """The chunked rule's saved tensors (fp32), per value head: q and k (normalised and
    repeated), v, the pairwise decays and the chunk's two systems (3 C^2 a chunk), the solved
    values and key reads, the read and write weights, and each chunk's state (dk*dv), with
    the output."""
    T, t = k.T, k.t
    dk, dv = m.linear_key_head_dim, m.linear_value_head_dim
    hv = m.linear_num_value_heads // t
    chunks = -(-k.s // CHUNK) * k.b
    padded = chunks * CHUNK
    per_head = padded * (6 * dk + 4 * dv + 3 * CHUNK) + chunks * dk * dv
    return hv * per_head * FP32 + T * hv * dv * FP32


def hf_names(cfg: ModelConfig, ours: str, theirs: str, family) -> HfNames:
    """Qwen3-Next's linear_attn: the same projections in the same grouped orders; its conv1d
    weight is [channels, 1, width] on disk (hf_families' layouts)."""
    h, hv = cfg.hidden_size, cfg.linear_num_value_heads
    kq, v = cfg.linear_key_size, cfg.linear_value_size
    la = f"{theirs}linear_attn."
    return {f"{ours}attn.conv_weight": [(f"{la}conv1d.weight", 2 * kq + v)],
            f"{ours}attn.A_log": [(f"{la}A_log", hv)],
            f"{ours}attn.dt_bias": [(f"{la}dt_bias", hv)],
            f"{ours}attn.in_proj_qkvz.weight": [(f"{la}in_proj_qkvz.weight", 2 * kq + 2 * v)],
            f"{ours}attn.in_proj_ba.weight": [(f"{la}in_proj_ba.weight", 2 * hv)],
            f"{ours}attn.norm.weight": [(f"{la}norm.weight", cfg.linear_value_head_dim)],
            f"{ours}attn.out_proj.weight": [(f"{la}out_proj.weight", h)]}


def check_hybrid(model: ModelConfig) -> None:
    """The hybrid's keys: refused where they would be ignored (no variant), checked where a
    block runs linear attention; the pattern must leave a block of each kind."""
    variant, freq, layers = (model.experimental_attention_variant,
                             model.linear_attention_freq, model.num_layers)
    if variant is None:
        if freq is not None:
            raise ValueError(f"model.linear_attention_freq={freq!r} chooses the linear blocks, "
                             f"but model.experimental_attention_variant=null. Fix: set "
                             f"model.experimental_attention_variant=gated_delta_net, or "
                             f"model.linear_attention_freq=null.")
        return
    one_of("model.experimental_attention_variant", variant, VARIANTS, "attention variant")
    if model.multi_latent_attention:
        raise ValueError("model.experimental_attention_variant=gated_delta_net with model."
                         "multi_latent_attention=true: the full-attention blocks of a hybrid "
                         "are grouped-query attention here. Fix: set model."
                         "multi_latent_attention=false.")
    if isinstance(freq, (list, tuple)):
        if len(freq) != layers or any(v not in (0, 1) or isinstance(v, bool) for v in freq):
            raise ValueError(f"model.linear_attention_freq={list(freq)} must be a list of 1 "
                             f"(linear) and 0 (full attention), one per block of "
                             f"model.num_layers={layers}. Fix: give {layers} entries, or an "
                             f"integer N (every N-th block full attention).")
    elif isinstance(freq, bool) or not isinstance(freq, int) or freq < 2:
        raise ValueError(f"model.linear_attention_freq={freq!r} must be an integer >= 2 (every "
                         f"N-th block full attention, the others linear: Qwen3-Next's 4) or a "
                         f"list of 1/0 per block. Fix: use 4.")
    kinds = {model.is_linear_block(i) for i in range(layers)}
    if kinds != {True, False}:
        kind = "linear" if True not in kinds else "full-attention"
        raise ValueError(f"model.linear_attention_freq={freq!r} over model.num_layers={layers} "
                         f"leaves no {kind} block: a hybrid has both. Fix: a pattern with both "
                         f"(e.g. {min(4, layers)} over {layers} blocks), or model."
                         f"experimental_attention_variant=null for full attention only.")
    for key in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                "linear_num_key_heads", "linear_num_value_heads"):
        positive_int(f"model.{key}", getattr(model, key), "use Qwen3-Next's (conf/model/"
                     "qwen3_next_80b_a3b.yaml)")
    keys, values = model.linear_num_key_heads, model.linear_num_value_heads
    if values % keys:
        raise ValueError(f"model.linear_num_value_heads={values} must be a multiple of model."
                         f"linear_num_key_heads={keys} (value heads share key heads). Fix: "
                         f"use a multiple, e.g. {2 * keys}.")


GATED_DELTA_NET = Part(
    "gated_delta_net", "attn", "trainer.model.gdn:GatedDeltaNet", shapes,
    tp_styles={"in_proj_qkvz": "column", "in_proj_ba": "column", "out_proj": "row"},
    # not a linear, kept whole on every rank (each TP rank reads its channels); not Muon's
    whole=("conv_weight",),
    residual_outputs=("out_proj.weight",),
    initial={"A_log": ("log_uniform", 1.0, 16.0), "dt_bias": ("ones",),
             "norm.weight": ("ones",)},  # Megatron's A range, its dt_bias; the norm at one
    # Cheap to recompute, costly to keep: the convolution and the chunked rule. Context
    # parallel would replace it (not built for these blocks: trainer.plan.axis_costs.context).
    hook="linear_attention_fn",
    tp_heads="heads_fn",
    head_norms=("conv_weight", "A_log", "dt_bias", "norm"),
    core_flops=core_flops, kept_bytes=kept_bytes, hf_names=hf_names, rules=check_hybrid)
