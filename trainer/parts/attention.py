"""Grouped-query attention with rotary positions (Llama's; Qwen3's adds qk_layernorm): the part
"gqa". q, k and v in one fused projection, causal attention within each document, the output
projection. Its layer: trainer.model.attention.
"""
from __future__ import annotations

from trainer.config import CPCommType, ModelConfig, RecomputeGranularity
from trainer.parts.part import HfNames, Part, Shapes
from trainer.parts.tokens import FP32, Tokens
from trainer.values import finite, one_of, positive_int

# Llama 3's rope scaling constants (Meta's reference; Megatron fixes them too): frequencies
# whose wavelength exceeds CONTEXT / LOW are divided by the factor, those under CONTEXT / HIGH
# kept, and the ones between interpolated.
LLAMA3_ROPE_CONTEXT, LLAMA3_ROPE_LOW, LLAMA3_ROPE_HIGH = 8192, 1.0, 4.0
# model.rope_type (Megatron's --rope-type): plain rotary (Llama 3's scaling by its own keys), YaRN
ROPE_TYPES = ("rope", "yarn")
# model.softmax_type (Megatron's): plain; a zero logit in every denominator; a logit per head
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def shapes(cfg: ModelConfig) -> Shapes:
    norms = {"q_norm.weight": (cfg.head_dim,), "k_norm.weight": (cfg.head_dim,)} \
        if cfg.qk_layernorm else {}
    sinks = {"sinks": (cfg.num_heads,)} if cfg.softmax_type == "learnable" else {}
    qkv_rows = cfg.q_proj_size + 2 * cfg.kv_size
    qkv_bias = {"qkv.bias": (qkv_rows,)} if cfg.add_bias_linear or cfg.add_qkv_bias else {}
    o_bias = {"o.bias": (cfg.hidden_size,)} if cfg.add_bias_linear else {}
    return {**sinks, "qkv.weight": (qkv_rows, cfg.hidden_size), **qkv_bias,
            "o.weight": (cfg.hidden_size, cfg.q_size), **o_bias, **norms}


def core_flops(cfg: ModelConfig, seq_length: int, window: int | None = None) -> float:
    """QK^T and AV, 2*q per key each, over the keys a query sees on average: S/2 causally,
    fewer under a sliding window."""
    return 4 * cfg.q_size * keys_seen(seq_length, window)


def keys_seen(seq_length: int, window: int | None) -> float:
    """The keys a query sees, averaged over a sequence of seq_length, less half the diagonal:
    S/2 causally (Megatron's FLOPs formula: (S + 1)/2 exactly); query i sees min(i, W) + 1
    under a window of W."""
    if window is None or window >= seq_length - 1:
        return seq_length / 2
    exact = window * (window + 1) / 2 + (seq_length - window) * (window + 1)
    return exact / seq_length - 0.5


def attention_bytes(m: ModelConfig, k: Tokens, e: int, recompute: RecomputeGranularity | None,
                    cp_comm_type: CPCommType) -> int:
    """The attention's own tensors kept for its backward, by context-parallel exchange
    (what CP does for the part: trainer.plan.activations has the counts)."""
    q = k.T * m.q_size // k.t * e  # q or the output, this rank's tokens
    kv = k.T * m.kv_size // k.t * e  # k or v
    if not k.cp or recompute is RecomputeGranularity.selective:
        return 3 * q + 3 * kv + qk_norm_bytes(m, k, e, False) + gate_bytes(m, k, e, True)
    if cp_comm_type is CPCommType.p2p:
        kept = 2 * q + 2 * kv
    elif cp_comm_type is CPCommType.all_gather:
        kept = 2 * q + 2 * k.b * k.S * m.kv_size // k.t * e
    else:
        kept = 3 * q + 2 * kv
    keeps_qkv = m.qk_layernorm and not (m.layernorm_zero_centered_gamma and e != FP32)
    return kept + qk_norm_bytes(m, k, e, True) + gate_bytes(m, k, e, keeps_qkv)


def gate_bytes(m: ModelConfig, k: Tokens, e: int, keeps_qkv: bool) -> int:
    """attention_output_gate: the gate's sigmoid and its product with the attention's output
    (o's input), and the gate's rows of the qkv output where that output is kept (keeps_qkv)."""
    if not m.attention_output_gate:
        return 0
    q = k.T * m.q_size // k.t * e
    return 2 * q + (q if keeps_qkv else 0)


def qk_norm_bytes(m: ModelConfig, k: Tokens, e: int, keeps_qkv: bool) -> int:
    """qk_layernorm: the normalised q and k and their rsqrt per head (in the compute dtype);
    the norms keep their input, a view of the qkv output, which context parallel's exchange
    otherwise lets go (keeps_qkv)."""
    if not m.qk_layernorm:
        return 0
    heads = m.num_heads + m.query_groups
    if m.layernorm_zero_centered_gamma and e != FP32:
        # Gemma's norms compute in fp32: they keep an fp32 copy of their input (not the qkv
        # output's view), the normalised input and the rsqrt, all fp32
        return k.T * (2 * (m.q_size + m.kv_size) + heads) // k.t * FP32
    normalised = k.T * (m.q_size + m.kv_size + heads) // k.t * e
    return normalised + (k.T * (m.q_size + 2 * m.kv_size) // k.t * e if keeps_qkv else 0)


def kept_bytes(m: ModelConfig, k: Tokens, e: int, recompute: RecomputeGranularity | None,
                cp_comm_type: CPCommType = CPCommType.p2p) -> int:
    """qkv's input T*h*e, the attention's tensors, rotary cos/sin 8*T*r (r: the rotary dims,
    model.rotary_percent of d) and (not under selective recompute) the logsumexp
    4*b*(n/t)*s."""
    selective = recompute is RecomputeGranularity.selective
    lse = 0 if selective else FP32 * k.b * m.num_heads // k.t * k.s
    return (k.T * m.hidden_size * e + attention_bytes(m, k, e, recompute, cp_comm_type)
            + 8 * k.T * m.rotary_dim + lse)


def lora_kept_bytes(m: ModelConfig, k: Tokens, e: int, recompute: RecomputeGranularity | None,
                    cp_comm_type: CPCommType, adapted: frozenset[str], grad_in: bool,
                    dropout: bool) -> int:
    """Its weights frozen (peft=lora): qkv's input only for its adapters (the rank's own
    tokens Tr*h*e, made contiguous and cast once: trainer.model.lora), the attention's tensors
    where q, k or v carries a gradient, none where none does (the first block, its input the
    frozen embedding's, q, k and v not adapted) but the core's inputs q, k and v, which
    selective recompute keeps all the same. o's input is the attention's output, which the
    attention keeps; o's adapter keeps it (T*q/t*e) where the attention does not, and its
    dropped copy where the adapter drops its input and the attention keeps the output."""
    qkv = bool(adapted & {"q_proj", "k_proj", "v_proj"})
    o_input = k.T * m.q_size // k.t * e if "o_proj" in adapted else 0
    if not (grad_in or qkv):  # selective recompute still keeps its core's inputs
        core = k.T * (m.q_size + 2 * m.kv_size) // k.t * e \
            if recompute is RecomputeGranularity.selective else 0
        return o_input + core
    own = k.Tr * m.hidden_size * e if qkv else 0
    return (own + kept_bytes(m, k, e, recompute, cp_comm_type) - k.T * m.hidden_size * e
            + o_input * dropout)


def hf_names(cfg: ModelConfig, ours: str, theirs: str, family) -> HfNames:
    """q, k and v's projections (and their biases) fused in ours; gpt-oss's sinks."""
    q, kv, h, d = cfg.q_proj_size, cfg.kv_size, cfg.hidden_size, cfg.head_dim
    qkv = (("q", q), ("k", kv), ("v", kv))
    kinds = ("weight", "bias") if cfg.add_bias_linear or cfg.add_qkv_bias else ("weight",)
    return {
        **{f"{ours}attn.qkv.{kind}": [(f"{theirs}self_attn.{p}_proj.{kind}", rows)
                                      for p, rows in qkv] for kind in kinds},
        f"{ours}attn.o.weight": [(f"{theirs}self_attn.o_proj.weight", h)],
        **({f"{ours}attn.o.bias": [(f"{theirs}self_attn.o_proj.bias", h)]}
           if cfg.add_bias_linear else {}),
        **({f"{ours}attn.sinks": [(f"{theirs}self_attn.sinks", cfg.num_heads)]}
           if cfg.softmax_type == "learnable" else {}),
        **({f"{ours}attn.{p}_norm.weight": [(f"{theirs}self_attn.{p}_norm.weight", d)]
            for p in ("q", "k")} if cfg.qk_layernorm else {}),
    }


def rules(model: ModelConfig) -> None:
    """Heads, K/V groups, the head width and the rotary frequencies."""
    if model.kv_channels is not None:
        positive_int("model.kv_channels", model.kv_channels,
                     "set it to the width of one attention head, or null for hidden_size / "
                     "num_heads")
    elif model.hidden_size % model.num_heads:
        raise ValueError(
            f"model.hidden_size={model.hidden_size} is not divisible by model.num_heads="
            f"{model.num_heads}. Fix: choose num_heads that divides hidden_size, or set "
            f"model.kv_channels (the head width).")
    groups = model.num_query_groups
    if groups is not None and (groups < 1 or model.num_heads % groups):
        raise ValueError(
            f"model.num_query_groups={groups} must divide model.num_heads={model.num_heads} "
            f"(each K/V group serves num_heads/num_query_groups query heads). Fix: choose a "
            f"divisor of {model.num_heads}, or null for multi-head attention.")
    head_dim = model.head_dim
    if head_dim % 2:
        width = (f"model.kv_channels={head_dim}" if model.kv_channels else
                 f"model.hidden_size={model.hidden_size} / model.num_heads={model.num_heads} is "
                 f"a head dim of {head_dim}, which")
        raise ValueError(
            f"{width} is odd; rotary embeddings need an even head dim. Fix: change "
            f"model.kv_channels, model.num_heads or model.hidden_size.")
    finite("model.rotary_percent", model.rotary_percent, 0, False, 1, True,
           fix="use Qwen3-Next's 0.25, or 1.0 to turn every dim")
    if model.rotary_dim % 2 or model.rotary_dim < 2:
        raise ValueError(f"model.rotary_percent={model.rotary_percent} of a head dim of "
                         f"{head_dim} turns {model.rotary_dim} dims; rotary embeddings need an "
                         f"even number, at least 2. Fix: a share that gives an even count, "
                         f"e.g. {max(2, head_dim // 4 // 2 * 2) / head_dim:g}.")
    rope_rules(model)
    local_rules(model)


def local_rules(model: ModelConfig) -> None:
    """The sliding window's keys and the softmax's sinks."""
    one_of("model.softmax_type", model.softmax_type, SOFTMAX_TYPES, "softmax")
    freq = model.window_attn_skip_freq
    if model.window_size is None:
        if freq is not None:
            raise ValueError(f"model.window_attn_skip_freq={freq!r} chooses the blocks of a "
                             f"sliding window, but model.window_size=null. Fix: set "
                             f"model.window_size, or model.window_attn_skip_freq=null.")
        return
    if isinstance(model.window_size, bool) or not isinstance(model.window_size, int):
        raise ValueError(f"model.window_size={model.window_size!r} must be an integer: how far "
                         f"back a query may look. Fix: use e.g. 127 (gpt-oss's sliding window "
                         f"of 128 keys), or null for full attention.")
    positive_int("model.window_size", model.window_size,
                 "set how far back a query may look (gpt-oss's 127, Gemma 3's 1023), or null "
                 "for full attention")
    layers = model.num_layers
    if isinstance(freq, (list, tuple)):
        if len(freq) != layers or any(v not in (0, 1) or isinstance(v, bool) for v in freq):
            raise ValueError(f"model.window_attn_skip_freq={list(freq)} must be a list of 1 "
                             f"(windowed) and 0 (global), one per block of model.num_layers="
                             f"{layers}. Fix: give {layers} entries, or an integer k (every "
                             f"k-th block global).")
    elif freq is not None and (not isinstance(freq, int) or isinstance(freq, bool) or freq < 2):
        raise ValueError(f"model.window_attn_skip_freq={freq!r} must be an integer >= 2 (every "
                         f"k-th block global, the others windowed; 1 would leave no block "
                         f"windowed), a list of 1/0 per block, or null (every block windowed). "
                         f"Fix: use gpt-oss's 2 or Gemma 3's 6, or model.window_size=null.")
    if not any(model.window_of(block) for block in range(layers)):
        raise ValueError(f"model.window_attn_skip_freq={freq!r} leaves no block windowed. Fix: "
                         f"set at least one 1, or model.window_size=null for full attention.")


def rope_rules(model: ModelConfig) -> None:
    """The rotary embedding's keys (trainer.model.rotary), of every attention part."""
    finite("model.rope_theta", model.rope_theta, 0, False, fix="use e.g. 10000.0")
    one_of("model.rope_type", model.rope_type, ROPE_TYPES, "rotary embedding")
    gemma_rules(model)
    if model.use_rope_scaling:
        finite("model.rope_scaling_factor", model.rope_scaling_factor, 1, True,
               fix="use Llama 3.1's 8.0 or Llama 3.2's 32.0")
    if model.rope_type != "yarn":
        if not model.yarn_correction_range_round_to_int:
            raise ValueError("model.yarn_correction_range_round_to_int=false is ignored by "
                             f"model.rope_type={model.rope_type}. Fix: set it to true, or "
                             "model.rope_type=yarn.")
        return
    if model.use_rope_scaling:
        raise ValueError("model.use_rope_scaling=true with model.rope_type=yarn: two rotary "
                         "scalings. Fix: set model.use_rope_scaling=false (YaRN scales by "
                         "model.rotary_scaling_factor).")
    finite("model.rotary_scaling_factor", model.rotary_scaling_factor, 1, True,
           fix="use DeepSeek-V3's 40.0")
    positive_int("model.original_max_position_embeddings",
                 model.original_max_position_embeddings, "use DeepSeek-V3's 4096")
    finite("model.beta_slow", model.beta_slow, 0, False, fix="use YaRN's 1.0")
    if model.beta_fast < model.beta_slow:  # equal: a step, no ramp (Kimi K2's 1.0 and 1.0)
        raise ValueError(f"model.beta_fast={model.beta_fast} is below model.beta_slow="
                         f"{model.beta_slow}: the ramp runs from beta_fast rotations down to "
                         f"beta_slow. Fix: use YaRN's 32.0 and 1.0.")
    for key in ("mscale", "mscale_all_dim"):
        finite(f"model.{key}", getattr(model, key), 0, True,
               fix="use DeepSeek-V3's 1.0 (0: no correction)")


def gemma_rules(model: ModelConfig) -> None:
    """Gemma 3's attention keys: the windowed blocks' rotary base, linear rope scaling and the
    softmax scale (trainer.model.rotary, trainer.model.attention)."""
    mla = model.multi_latent_attention
    if model.rotary_base_local is not None:
        finite("model.rotary_base_local", model.rotary_base_local, 0, False,
               fix="use Gemma 3's 10000.0, or null for rope_theta in every block")
        if model.window_size is None or mla:
            but = "model.multi_latent_attention=true" if mla else "model.window_size=null"
            raise ValueError(f"model.rotary_base_local={model.rotary_base_local} is the base of "
                             f"grouped-query attention's windowed blocks, but {but}. Fix: set "
                             f"model.rotary_base_local=null, or give model.window_size.")
    factor = model.seq_len_interpolation_factor
    if factor is not None:
        finite("model.seq_len_interpolation_factor", factor, 1, True,
               fix="use Gemma 3's 8.0, or null for no linear scaling")
        other = ("model.use_rope_scaling=true" if model.use_rope_scaling else
                 "model.rope_type=yarn" if model.rope_type == "yarn" else None)
        if other:
            raise ValueError(f"model.seq_len_interpolation_factor={factor} with {other}: two "
                             f"rotary scalings. Fix: set model.seq_len_interpolation_factor=null, "
                             f"or drop the other.")
    if model.softmax_scale is not None:
        finite("model.softmax_scale", model.softmax_scale, 0, False,
               fix="use Gemma 3's query_pre_attn_scalar ** -0.5 (0.0625 for 256), or null for "
                   "head_dim ** -0.5")
        if mla:
            raise ValueError(f"model.softmax_scale={model.softmax_scale} with model."
                             f"multi_latent_attention=true: its scale is its own (YaRN's "
                             f"mscale_all_dim). Fix: set model.softmax_scale=null.")


GQA = Part(
    "gqa", "attn", "trainer.model.attention:Attention", shapes,
    # Column then row; q|k|v split by heads (heads, groups, groups) so each keeps its rows.
    tp_styles={"qkv": "column", "o": "row"},
    lora_targets={"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",)},
    fused=lambda cfg: {"qkv": cfg.qkv_heads},
    residual_outputs=("o.weight",),
    # Cheap to recompute, costly to keep: softmax(QK^T)V. Context parallel replaces it with
    # its ring, gather or all-to-all attention over the whole sequence (parallel.context).
    hook="attention_fn",
    # Attention sinks (softmax_type=learnable): a logit per head, whole on every rank, each TP
    # rank's heads read through heads_fn.
    tp_heads="heads_fn",
    head_norms=("q_norm", "k_norm", "sinks"),
    core_flops=core_flops, kept_bytes=kept_bytes, lora_kept_bytes=lora_kept_bytes,
    hf_names=hf_names, rules=rules, exchanged_widths=lambda cfg: (cfg.q_size, cfg.kv_size))
