"""Gated DeltaNet (Qwen3-Next's linear attention): the part "gated_delta_net", the attention of
the blocks model.linear_attention_freq names linear (model.experimental_attention_variant=
gated_delta_net). Its layer: trainer.model.gdn.

Projections: in_proj, column-parallel, of six fused parts as Megatron's (and Qwen3.5's
in_proj_qkv, _z, _b and _a): q, k, v, z, b, a, each of all heads in order; TP splits each part
by heads, which keeps a key head's value heads with it. out_proj is row-parallel. Qwen3-Next's
files group in_proj_qkvz and in_proj_ba by key head instead: their rows are reordered on
import and export (trainer.checkpoint.hf_qwen3_next). The convolution's weight (depthwise over
q|k|v's channels), A_log and dt_bias (per value head) and the gated norm's weight (per value dim,
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
            "dt_bias": (hv,), "in_proj.weight": (2 * kq + 2 * v + 2 * hv, h),
            "norm.weight": (cfg.linear_value_head_dim,), "out_proj.weight": (h, v)}


def core_flops(cfg: ModelConfig, seq_length: int, window: int | None = None) -> float:
    """The chunked rule's products per token (forward), each value head: k_beta k^T and q k^T
    within the chunk (2 C dk each), the two triangular solves (C dv and C dk), the chunk's
    attention on its new values (2 C dv), and the state read twice and written once
    (2 dk dv each), with C = CHUNK. The convolution is a 2-D weight (2 W, as a linear's)."""
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    chunk = min(CHUNK, seq_length)
    return cfg.linear_num_value_heads * (chunk * (5 * dk + 3 * dv) + 6 * dk * dv)


def _core_tokens(m: ModelConfig, k: Tokens, cp_comm_type: CPCommType
                 ) -> tuple[int, int, int, int]:
    """(samples, tokens, key heads, value heads) the core runs on at once on this rank: its
    own tokens without context parallel; under it, one of its two zigzag chunks at a time
    (p2p), the whole sequence for 1/C of its heads (a2a) or for all of them (all_gather)."""
    t, b, s = k.t, k.b, k.s
    hv, hk = m.linear_num_value_heads // t, m.linear_num_key_heads // t
    if not k.cp:
        return b, s, hk, hv
    c = k.S // s
    return {CPCommType.p2p: (b, s // 2, hk, hv), CPCommType.a2a: (b, k.S, hk // c, hv // c),
            CPCommType.all_gather: (b, k.S, hk, hv)}[cp_comm_type]


def kept_bytes(m: ModelConfig, k: Tokens, e: int, recompute: RecomputeGranularity | None,
               cp_comm_type: CPCommType = CPCommType.p2p) -> int:
    """What the layer keeps for its backward (no full recompute), its rank's tokens T (all of
    them after SP's gather) and heads (1/t): in_proj's input T*h*e, beta T*hv*e, the
    decay's softplus input and output (fp32), z (T*V*e) and out_proj's input (T*V*e), the
    gated norm's input (the rule's output: fp32, padded to whole chunks on one process; its
    bf16 cast under bf16), and its core's (core_bytes) as each cp_comm_type runs it: on its
    own tokens (none), the whole sequence for 1/C of the heads (a2a) or all of them
    (all_gather); p2p keeps the core's inputs and the states and convolution inputs it
    received, and rebuilds each chunk in backward. Selective recompute keeps the core's
    inputs alone (q|k|v before the convolution, g)."""
    T, t, b = k.T, k.t, k.b
    hv, hk = m.linear_num_value_heads // t, m.linear_num_key_heads // t
    dk, dv, width = m.linear_key_head_dim, m.linear_value_head_dim, m.linear_conv_kernel_dim
    channels, values = 2 * hk * dk + hv * dv, hv * dv
    own = T * m.hidden_size * e + T * hv * e + 2 * T * hv * FP32 + 2 * T * values * e
    normed = _normed_bytes(m, k, e)
    inputs = T * channels * e + T * hv * FP32  # q|k|v before the convolution, and g
    if recompute is RecomputeGranularity.selective:
        return own + normed + inputs
    if k.cp and cp_comm_type is CPCommType.p2p:  # what it received: two chunks' states and
        core = inputs + 2 * b * (hv * dk * dv * FP32 + (width - 1) * channels * e)  # inputs
    else:  # a2a's share of the heads is a copy of the convolution's channels
        narrowed = t > 1 or (k.cp and cp_comm_type is CPCommType.a2a)
        core = core_bytes(m, *_core_tokens(m, k, cp_comm_type), e, narrowed)
    return own + normed + core


def backward_bytes(m: ModelConfig, k: Tokens, e: int, selective: bool,
                   cp_comm_type: CPCommType = CPCommType.p2p) -> int:
    """The most the layer's backward forms beside what its block keeps (the gradient entering
    the block, Tr*h fp32, included), the larger of two moments. The gated norm's: its
    backward's fp32 working set, four tensors of its output's size (4*T*V*4). The rule's: its
    output's gradient and its inputs' gradients, padded to whole chunks (fp32), and one
    chunk's step rebuilt (rule_backward_bytes), out_proj's input, z and the gated norm's input
    let go by then (z's gradient in their place). Under selective
    recompute the core is rebuilt first (core_bytes); under context parallel the core runs on
    other tokens and heads: p2p rebuilds one of the rank's two chunks at a time (its core and
    the rule's backward on it), a2a runs the whole sequence for 1/C of the heads, all_gather
    all of it."""
    t, b, s = k.t, k.b, k.s
    hv, hk = m.linear_num_value_heads // t, m.linear_num_key_heads // t
    values = hv * m.linear_value_head_dim
    tokens, rebuilt = _core_tokens(m, k, cp_comm_type), 0
    if k.cp:
        if cp_comm_type is CPCommType.p2p:  # and the gradients of the rank's core inputs,
            # the rebuilt chunk's output (padded) and its other chunk's output gradient; three
            # states (the rebuilt final one, the gradient received for it, the one sent or
            # carried back from the chunk after) and two tails' gradients
            dk, width = m.linear_key_head_dim, m.linear_conv_kernel_dim
            channels = 2 * hk * dk + values
            rebuilt = core_bytes(m, *tokens, e, True) + k.T * (channels * e + hv * (FP32 + e)) \
                + (b * _padded(s // 2) + k.T - b * (s // 2)) * values * FP32 \
                + b * (3 * hv * dk * m.linear_value_head_dim * FP32
                       + 2 * (width - 1) * channels * e)
    if selective and not rebuilt:
        rebuilt = core_bytes(m, *tokens, e, t > 1 or k.cp)
    rule = rebuilt + rule_backward_bytes(m, *tokens) - k.T * values * e \
        - _normed_bytes(m, k, e)
    norm = 4 * k.T * values * FP32
    return k.Tr * m.hidden_size * FP32 + max(rule, norm)


def forward_bytes(m: ModelConfig, k: Tokens, e: int, recompute: RecomputeGranularity | None,
                  cp_comm_type: CPCommType = CPCommType.p2p) -> int:
    """The most the layer's forward holds beyond what it keeps once done (negative where what
    it keeps after that moment outweighs it), at its rule's chunk loop: q|k|v before the
    convolution as the caller holds it (unless kept), q and k normalised (fp32), one chunk's
    step (forward_step_bytes) and what the core holds without keeping it: under selective
    recompute or p2p (whose forward builds no graph) the convolution's output, the rule's
    padded inputs, its output (p2p: and its other chunk's); a2a's gathered input and rates,
    all_gather's whole sequence; less what the layer keeps that is made after: out_proj's
    input and the gated norm's (where it is not the rule's output itself)."""
    T, t = k.T, k.t
    hv, hk = m.linear_num_value_heads // t, m.linear_num_key_heads // t
    dk, dv = m.linear_key_head_dim, m.linear_value_head_dim
    channels, values = 2 * hk * dk + hv * dv, hv * dv
    selective = recompute is RecomputeGranularity.selective
    relay = k.cp and cp_comm_type is CPCommType.p2p
    core = _core_tokens(m, k, cp_comm_type)
    cb, cs, ck, cv = core
    held = 0 if selective or relay else T * channels * e
    own_out = e == FP32 and not k.cp  # the gated norm keeps the rule's output itself
    working = 2 * cb * cs * ck * dk * FP32 + forward_step_bytes(m, cb, ck, cv)
    out = cb * _padded(cs) * cv * dv * FP32  # the rule's output
    if not own_out:
        working += out
    if e != FP32:  # v and beta as the rule is given them, widened
        working += cb * cs * cv * (dv + 1) * FP32
    if selective or relay:
        working += cb * cs * (2 * ck * dk + cv * dv) * e + _rule_bytes(m, *core)
        if relay:  # the first chunk's output, waiting
            working += out
    if k.cp and cp_comm_type is CPCommType.a2a:
        working += T * channels * e + 2 * T * hv * 2 * FP32
    elif k.cp and cp_comm_type is CPCommType.all_gather:
        working += k.S // k.s * T * (channels * e + hv * (FP32 + e))
    after = T * values * e + (0 if own_out else _normed_bytes(m, k, e))
    return held + working - after


def forward_step_bytes(m: ModelConfig, b: int, hk: int, hv: int) -> int:
    """One chunk's step of the rule without a graph, at its most (fp32), for each value head:
    2 C x C, 2 C x dk (and q's and k's copies for the value heads, 2 C x dk, where key heads
    are shared), 3 C x dv and 3 dk x dv (as the allocator counts it, for dk, dv >= C)."""
    dk, dv = m.linear_key_head_dim, m.linear_value_head_dim
    shared = 2 * CHUNK * dk if hk < hv else 0
    return b * hv * (2 * CHUNK * CHUNK + 2 * CHUNK * dk + shared + 3 * CHUNK * dv
                     + 3 * dk * dv) * FP32


def rule_backward_bytes(m: ModelConfig, b: int, s: int, hk: int, hv: int) -> int:
    """The chunked rule's backward on b x s tokens (fp32): its output's gradient (and its copy
    padded to whole chunks where s is not), its inputs' gradients, padded, and one chunk's step
    rebuilt with its gradients at their most, for each value head: 4 C x C, 6 C x dk (8 where
    key heads are shared: q's and k's copies for the value heads), 5 C x dv, 4 dk x dv and 5
    C-long (C = CHUNK; fitted to the allocator at dk and dv of 64 and 128, Qwen3-Next's, and
    within 6% of it elsewhere from 64 to 256)."""
    dk, dv = m.linear_key_head_dim, m.linear_value_head_dim
    padded = b * _padded(s)
    keys = (8 if hk < hv else 6) * CHUNK * dk
    step = b * hv * (4 * CHUNK * CHUNK + keys + 5 * CHUNK * dv + 4 * dk * dv + 5 * CHUNK)
    output = b * s * hv * dv + (padded * hv * dv if padded != b * s else 0)
    return (output + padded * (hv * dv + 2 * hk * dk + 2 * hv) + step) * FP32


def _normed_bytes(m: ModelConfig, k: Tokens, e: int) -> int:
    """The gated norm's input as kept: the rule's output cast to the compute dtype (bf16);
    else the exchange's output, the rank's own tokens (context parallel), or a view of the
    rule's padded output (one process)."""
    values = m.linear_value_size // k.t
    if e != FP32:
        return k.T * values * e
    return k.T * values * FP32 if k.cp else k.b * _padded(k.s) * values * FP32


def _padded(s: int) -> int:
    return -(-s // CHUNK) * CHUNK


def core_bytes(m: ModelConfig, b: int, s: int, hk: int, hv: int, e: int, narrowed: bool
               ) -> int:
    """The core (convolution and chunked rule) on b x s tokens of hk key and hv value heads:
    the convolution's padded input and its silu's input; q and k as the L2 norm keeps them
    (fp32: views of the convolution's output, all of it; under bf16 their fp32 copies) with
    their rsqrt; the rule's inputs padded to whole chunks (q, k, v, g, beta in fp32, the
    document ids) and the state entering each chunk; the convolution's weight where it is a
    copy (this rank's heads' channels, or a cast)."""
    dk, dv, width = m.linear_key_head_dim, m.linear_value_head_dim, m.linear_conv_kernel_dim
    T, channels = b * s, 2 * hk * dk + hv * dv
    conv = b * (s + width - 1) * channels * e + T * channels * e
    norm = (T * channels if e == FP32 else 2 * T * hk * dk) * FP32 + 2 * T * hk * FP32
    weight = channels * width * e if narrowed or e != FP32 else 0
    return conv + norm + _rule_bytes(m, b, s, hk, hv) + weight


def _rule_bytes(m: ModelConfig, b: int, s: int, hk: int, hv: int) -> int:
    """What the chunked rule keeps on b x s tokens: its inputs padded to whole chunks (q, k, v,
    g, beta in fp32), the document ids and the state entering each chunk."""
    dk, dv = m.linear_key_head_dim, m.linear_value_head_dim
    padded = _padded(s)
    chunks = padded // CHUNK
    return (b * padded * (2 * hk * dk + hv * dv + 2 * hv) * FP32 + b * (padded + chunks) * 8
            + chunks * b * hv * dk * dv * FP32)


def hf_names(cfg: ModelConfig, ours: str, theirs: str, family) -> HfNames:
    """Qwen3-Next's or Qwen3.5's linear_attn: in_proj is Qwen3-Next's in_proj_qkvz then
    in_proj_ba (each's rows regrouped from by key head to by part), or Qwen3.5's in_proj_qkv,
    _z, _b and _a as they are; the conv1d weight is [channels, 1, width] on disk (the layouts:
    trainer.checkpoint.hf_qwen3_next)."""
    h, hv = cfg.hidden_size, cfg.linear_num_value_heads
    kq, v = cfg.linear_key_size, cfg.linear_value_size
    la = f"{theirs}linear_attn."
    # Qwen3-Next's qkvz and ba (grouped), or Qwen3.5's qkv, z, b and a (our parts' order)
    rows = (2 * kq + 2 * v, 2 * hv) if len(family.linear_in) == 2 else (2 * kq + v, v, hv, hv)
    return {f"{ours}attn.conv_weight": [(f"{la}conv1d.weight", 2 * kq + v)],
            f"{ours}attn.A_log": [(f"{la}A_log", hv)],
            f"{ours}attn.dt_bias": [(f"{la}dt_bias", hv)],
            f"{ours}attn.in_proj.weight": [(f"{la}{name}.weight", n)
                                           for name, n in zip(family.linear_in, rows)],
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
    tp_styles={"in_proj": "column", "out_proj": "row"},
    # q | k | v | z | b | a (Megatron's in_proj): each part split over TP by heads
    fused=lambda cfg: {"in_proj": (cfg.linear_key_size, cfg.linear_key_size,
                                   cfg.linear_value_size, cfg.linear_value_size,
                                   cfg.linear_num_value_heads, cfg.linear_num_value_heads)},
    # not a linear, kept whole on every rank (each TP rank reads its channels); not Muon's
    whole=("conv_weight",),
    residual_outputs=("out_proj.weight",),
    initial={"A_log": ("log_uniform", 1.0, 16.0), "dt_bias": ("ones",),
             "norm.weight": ("ones",)},  # Megatron's A range, its dt_bias; the norm at one
    # Cheap to recompute, costly to keep: the convolution and the chunked rule (selective
    # recompute wraps it; context parallel's exchanges wrap it: parallel.context.linear).
    hook="linear_attention_fn",
    tp_heads="heads_fn",
    head_norms=("conv_weight", "A_log", "dt_bias", "norm"),
    core_flops=core_flops, kept_bytes=kept_bytes, backward_bytes=backward_bytes,
    forward_bytes=forward_bytes,
    hf_names=hf_names, rules=check_hybrid)
