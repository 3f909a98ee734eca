"""Typed schemas for every config group, registered with Hydra's ConfigStore.

Schemas hold types, values live in conf/*.yaml: a key missing from YAML is an error, and so are
an unknown key or a wrong type. launch.py turns the composed DictConfig into these dataclasses
once; nothing below it sees a DictConfig.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from hydra.errors import CompactHydraException
from omegaconf import II, MISSING, DictConfig, OmegaConf


class ConfigError(CompactHydraException):
    """A bad config or input found before any process starts; Hydra prints just the message."""


class Precision(Enum):
    fp32 = "fp32"
    bf16 = "bf16"  # bf16 weights and activations, fp32 master weights, grads and Adam moments


class CPCommType(Enum):
    """Megatron's --cp-comm-type: how context-parallel attention sees the whole sequence.
    p2p: K/V blocks around a ring (O(local tokens) per rank); all_gather: K/V gathered whole;
    a2a: Ulysses all-to-all between sequence and heads (local heads divisible by runtime CP)."""

    p2p = "p2p"
    all_gather = "all_gather"
    a2a = "a2a"


class RecomputeGranularity(Enum):
    """Megatron's --recompute-granularity: what a block's backward recomputes instead of
    keeping. selective: the attention core and the MLP activation; full: the whole block
    (its weights gathered again for the recompute)."""

    selective = "selective"
    full = "full"


# Megatron's --lr-decay-style, spelled as Megatron spells it (each member's name is its value,
# so `--cfg job` prints what Megatron takes); the earlier spellings inverse_sqrt and wsd stay as
# aliases of the same members. Built by the functional API: a class body cannot name a member
# "inverse-square-root".
LrDecayStyle = Enum("LrDecayStyle", [
    ("constant", "constant"), ("linear", "linear"), ("cosine", "cosine"),
    ("inverse-square-root", "inverse-square-root"), ("WSD", "WSD"),
    ("inverse_sqrt", "inverse-square-root"), ("wsd", "WSD")], module=__name__)


class WsdDecayStyle(Enum):
    """Megatron's --lr-wsd-decay-style: the shape of WSD's final anneal from lr to min_lr."""

    linear = "linear"
    cosine = "cosine"
    exponential = "exponential"  # 2 x 0.5^r - 1 of the way down, r the share of the anneal
    minus_sqrt = "minus_sqrt"  # 1 - sqrt(r)


class WeightDecayIncrStyle(Enum):
    """Megatron's --weight-decay-incr-style: weight decay from start to end over the run."""

    constant = "constant"
    linear = "linear"
    cosine = "cosine"


class LoggerName(Enum):
    console = "console"
    wandb = "wandb"
    tensorboard = "tensorboard"


@dataclass
class ModelConfig:
    name: str = MISSING  # the family (trainer.parts.families): llama, qwen3, mixtral, qwen3_moe
    vocab_size: int = MISSING  # the tokenizer's vocabulary (padded: make_vocab_size_divisible_by)
    hidden_size: int = MISSING  # the width of the residual stream
    num_layers: int = MISSING  # transformer blocks
    num_heads: int = MISSING  # query heads of each attention
    ffn_hidden_size: int = MISSING  # the SwiGLU MLP's inner width (of gate and of up)
    rope_theta: float = MISSING  # the rotary embedding's base
    norm_eps: float = MISSING  # RMSNorm's epsilon
    # std of the normal initial weights; residual-branch outputs (attention's and the MLP's
    # output projections) take it over sqrt(2 x num_layers)
    init_std: float = MISSING
    # Megatron's names. Grouped-query attention: K/V heads shared by num_heads/num_query_groups
    # query heads each (null: one group per head, multi-head attention).
    num_query_groups: Optional[int] = None
    tie_word_embeddings: bool = False  # the output head uses the embedding's weight
    # The embedding and head have vocab_size rounded up to a multiple of this (padding rows are
    # never looked up, and their logits are excluded from the loss), so any tokenizer's
    # vocabulary splits over TP. Unlike Megatron, TP does not enter the rounding: the padded
    # shape, and so a checkpoint, is the same under every layout.
    make_vocab_size_divisible_by: int = 128
    # Llama 3's rope scaling (Megatron's --use-rope-scaling, --rope-scaling-factor): rotary
    # frequencies with wavelengths past 8,192 tokens divided by the factor, smoothly between
    # 2,048 and 8,192 (Meta's low/high frequency factors 1 and 4, as Megatron fixes them).
    use_rope_scaling: bool = False
    rope_scaling_factor: float = 8.0  # Llama 3's rope scaling factor (with use_rope_scaling)
    # Megatron's name: the width of one attention head (null: hidden_size / num_heads;
    # Qwen3-30B-A3B's heads are 128 wide at hidden 2048 and 32 heads)
    kv_channels: Optional[int] = None
    # an RMSNorm over each head of q and of k before the rotary embedding (Qwen3's q_norm and
    # k_norm)
    qk_layernorm: bool = False
    # Rotary scaling (Megatron's --rope-type): rope (plain, or Llama 3's with use_rope_scaling)
    # or yarn: the frequencies that turn fewer than beta_slow times over the original context
    # divided by rotary_scaling_factor, those turning more than beta_fast times kept, a ramp
    # between; cos/sin scaled by m(mscale) / m(mscale_all_dim), m(x) = 0.1 x ln(factor) + 1
    # (DeepSeek-V3's and transformers' YaRN; docs/attention.md)
    rope_type: str = "rope"
    rotary_scaling_factor: float = 40.0  # yarn: DeepSeek-V3's 40
    original_max_position_embeddings: int = 4096  # yarn: the context it was trained at
    beta_fast: float = 32.0  # yarn: rotations over the original context kept unscaled
    beta_slow: float = 1.0  # yarn: rotations under which frequencies are fully interpolated
    mscale: float = 1.0  # yarn: the cos/sin magnitude's log coefficient
    # yarn: of the softmax scale's correction in multi-latent attention (0: none)
    mscale_all_dim: float = 0.0

    # Local attention (Megatron's names; docs/attention.md). window_size: how far back a query
    # may look (query i sees keys i - window_size .. i, within its document; Megatron's
    # (window_size, 0), Hugging Face's sliding_window - 1); null: full causal attention.
    window_size: Optional[int] = None
    # which blocks use the window: null every block; an int k every block but each k-th
    # (blocks k-1, 2k-1, ... global: gpt-oss's 2, Gemma 3's 6); or a list of 1 (windowed) and 0
    # (global), one per block
    window_attn_skip_freq: Any = None
    # vanilla, or attention sinks: off-by-one (a zero logit in every softmax's denominator) or
    # learnable (one logit per head, gpt-oss's sinks)
    softmax_type: str = "vanilla"

    # Gemma 3's block (docs/attention.md; Megatron's names where it has the concept).
    # Megatron's: every RMSNorm's weight stored zero-centred and applied as (1 + weight), in
    # fp32 and cast back (Gemma's; the qk norms too); it starts at zero
    layernorm_zero_centered_gamma: bool = False
    # a norm after the attention and after the MLP too, before each residual add (Gemma 2/3's
    # post_attention_layernorm and post_feedforward_layernorm; Megatron-Bridge's Gemma layer
    # spec puts them after linear_proj and linear_fc2, core Megatron has no key)
    sandwich_norm: bool = False
    # the embedding's output times sqrt(hidden_size), rounded to fp32 then the compute dtype
    # (Gemma's, as transformers' Gemma3TextScaledWordEmbedding; Megatron-Bridge's Gemma3
    # embedding)
    scale_embedding: bool = False
    # the rotary base of the windowed blocks (Megatron-Bridge's rotary_base_local; Gemma 3's
    # rope_local_base_freq, 10000); null: every block uses rope_theta
    rotary_base_local: Optional[float] = None
    # Megatron's linear rope scaling: positions divided by this in the blocks that use
    # rope_theta (Gemma 3's global blocks, 8 for 4B/12B/27B; rotary_base_local's blocks are
    # not scaled, as transformers'); null: none
    seq_len_interpolation_factor: Optional[float] = None
    # Megatron's: the attention softmax's scale; null: head_dim ** -0.5 (Gemma 3's
    # query_pre_attn_scalar ** -0.5: q is scaled by softmax_scale * sqrt(head_dim) before the
    # kernels, which use their default)
    softmax_scale: Optional[float] = None

    # Megatron's: only this share of each head's dims turns with rotary positions (the first
    # ones; Qwen3-Next's partial_rotary_factor 0.25), the rest pass unrotated
    rotary_percent: float = 1.0
    # Megatron's: the attention's output times sigmoid of a gate, one per output dim, that q's
    # projection makes beside each head's query (Qwen3-Next's gated attention)
    attention_output_gate: bool = False

    # Hybrid linear attention (Qwen3-Next's; Megatron's names; docs/hybrid.md). gated_delta_net:
    # the blocks linear_attention_freq names run Gated DeltaNet (a recurrent state per value
    # head, the gated delta rule, a short causal convolution) instead of softmax attention;
    # null: every block softmax attention.
    experimental_attention_variant: Optional[str] = None
    # which blocks are linear: an int N makes every N-th block (N-1, 2N-1, ...) full attention
    # and the others linear (Qwen3-Next's 4: three linear to one full); a list of 1 (linear)
    # and 0 (full), one per block
    linear_attention_freq: Any = None
    linear_conv_kernel_dim: int = 4  # the causal convolution's width over q, k and v
    linear_key_head_dim: int = 128  # a query or key head of the linear blocks
    linear_value_head_dim: int = 128  # a value (and output gate) head of the linear blocks
    linear_num_key_heads: int = 16  # query and key heads of the linear blocks
    linear_num_value_heads: int = 32  # value heads (a multiple of the key heads, which they share)

    # Multi-latent attention (DeepSeek-V2/V3's; Megatron's names; docs/attention.md): q and
    # K/V each projected down to a latent, normed and projected up per head, with a decoupled
    # rotary key of qk_pos_emb_head_dim shared by a token's heads. Replaces grouped-query
    # attention (num_query_groups null, kv_channels unused).
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None  # the query's latent; null: q projected directly
    kv_lora_rank: int = 512  # the keys' and values' latent
    qk_head_dim: int = 128  # a query or key head's part without rotary positions
    qk_pos_emb_head_dim: int = 64  # its rotary part (the key's shared by the heads)
    v_head_dim: int = 128  # a value head

    # Multi-token prediction (DeepSeek-V3's; Megatron's names; docs/mtp.md): depth k predicts
    # the token k + 1 ahead from depth k - 1's hidden state and the embedding of the token k
    # ahead, through one more block; the embedding and the output head are the model's.
    mtp_num_layers: Optional[int] = None  # the depths D; null: none
    # the MTP losses' weight in the step's loss: factor / D times their sum (Megatron's 0.1)
    mtp_loss_scaling_factor: float = 0.1

    # The MLP's activation and the linear layers' biases (Megatron's names; gpt-oss's keys).
    # Every MLP here is gated, act(gate) * (up + glu_linear_offset), the experts' and the
    # shared expert's too; activation_func is the gate's function: silu (SwiGLU), fast_gelu
    # (the tanh-approximate GELU: GeGLU, Gemma 3's) or quick_gelu (x * sigmoid(1.702 x),
    # gpt-oss's)
    activation_func: str = "silu"
    glu_linear_offset: float = 0.0  # added to up before the product (gpt-oss's 1.0)
    # gate clamped to at most this and up to [-this, this] before the activation (gpt-oss's
    # 7.0); null: no clamp
    activation_func_clamp_value: Optional[float] = None
    # biases on the attention's qkv and output projections, the MLPs' linears, the router's
    # logits and every expert's two projections (gpt-oss's; Megatron's default is true, ours
    # false: Llama's and DeepSeek's have none). Each starts at zero; the 1-D ones are not
    # decayed (as norms), the experts' are, with the experts' weights
    add_bias_linear: bool = False
    add_qkv_bias: bool = False  # a bias on the qkv projection only (Qwen2's)
    # yarn: the ramp's ends rounded outwards to whole dims (Megatron's, DeepSeek's); false:
    # not rounded (gpt-oss's, transformers' truncate false)
    yarn_correction_range_round_to_int: bool = True

    # Mixture of experts (Megatron's names; docs/moe.md). Each MoE block routes every token to
    # moe_router_topk SwiGLU experts.

    num_moe_experts: Optional[int] = None  # experts of each MoE block; null: a dense model
    moe_router_topk: int = 2  # experts each token is routed to
    moe_ffn_hidden_size: Optional[int] = None  # an expert's inner width; null: ffn_hidden_size
    # a dense SwiGLU of this width that every token also passes; null: no shared expert
    moe_shared_expert_intermediate_size: Optional[int] = None
    # Megatron's: the shared expert's output times sigmoid of a one-row linear of the token
    # (Qwen3-Next's shared_expert_gate)
    moe_shared_expert_gate: bool = False
    # which blocks are MoE: an int k makes blocks 0, k, 2k, ... MoE (1: every block), or a list
    # of 0/1, one per block
    moe_layer_freq: Any = 1
    # The router's scores: softmax or sigmoid of its logits; sigmoid's top-k are normalised
    moe_router_score_function: str = "softmax"
    # softmax only. false: the softmax of the top-k logits (normalised, as Mixtral's and
    # Qwen3-MoE's norm_topk_prob); true: the top-k of the softmax over all experts (not
    # normalised)
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: Optional[float] = None  # the routing weights' factor; null: 1
    # group-limited routing (DeepSeek-V3's): the experts split into this many groups of
    # consecutive experts; null: no groups
    moe_router_num_groups: Optional[int] = None
    # the groups each token's experts are chosen within: the best by the sum of their
    # moe_router_topk / group_topk best scores (with the expert bias); null: no groups
    moe_router_group_topk: Optional[int] = None
    # Balance: aux_loss (the switch loss over a global micro-batch's tokens), seq_aux_loss
    # (DeepSeek's, per sequence) or none
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0  # the balance loss's weight
    moe_z_loss_coeff: Optional[float] = None  # the router z-loss's weight; null: off
    # DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the scores that
    # choose the experts (never to their weights), saved in checkpoints
    moe_router_enable_expert_bias: bool = False
    # how far the expert bias moves after each step towards equal token counts
    moe_router_bias_update_rate: float = 1e-3
    # How expert parallel moves the rows to their experts' ranks (parallel.experts): alltoall
    # (each row to its expert's rank and back) or allgather (every rank's rows gathered, the
    # results reduce-scattered back); both compute the same.
    moe_token_dispatcher_type: str = "alltoall"
    # Each expert runs at most ceil(tokens x topk / experts x this) of a micro-batch's (token,
    # expert) pairs, the rest dropped by router weight (trainer.model.capacity); null: dropless.
    moe_expert_capacity_factor: Optional[float] = None

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_heads

    @property
    def q_size(self) -> int:
        """Width of q (and of the attention's output): num_heads heads of head_dim."""
        return self.num_heads * self.head_dim

    @property
    def qkv_heads(self) -> tuple[int, int, int]:
        """Heads of q, k and v in the fused qkv projection (its parts' relative sizes); with
        attention_output_gate each query head's rows are its query's then its gate's."""
        return (self.num_heads * (2 if self.attention_output_gate else 1), self.query_groups,
                self.query_groups)

    @property
    def q_proj_size(self) -> int:
        """Rows of q's part of the qkv projection: q, and with attention_output_gate each
        head's gate beside its query (Qwen3-Next's q_proj)."""
        return self.q_size * (2 if self.attention_output_gate else 1)

    @property
    def rotary_dim(self) -> int:
        """The dims of a head that turn with rotary positions (rotary_percent of head_dim, the
        first ones; transformers' int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.rotary_percent)

    @property
    def kv_size(self) -> int:
        """Width of k (and of v): query_groups heads of head_dim."""
        return self.query_groups * self.head_dim

    @property
    def expert_ffn_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    def expert_capacity(self, tokens: float) -> int | None:
        """(token, expert) pairs each expert may run in a micro-batch of `tokens` tokens
        (Megatron's get_capacity, over the micro-batch's tokens: trainer.model.capacity);
        None: dropless."""
        if self.moe_expert_capacity_factor is None:
            return None
        return math.ceil(tokens * self.moe_router_topk / self.num_moe_experts
                         * self.moe_expert_capacity_factor)

    def is_moe_block(self, block: int) -> bool:
        """Whether block `block` is a mixture of experts (moe_layer_freq)."""
        if self.num_moe_experts is None:
            return False
        freq = self.moe_layer_freq
        return bool(freq[block]) if isinstance(freq, (list, tuple)) else block % freq == 0

    def is_linear_block(self, block: int) -> bool:
        """Whether block `block` runs linear attention (linear_attention_freq, as Megatron's
        counts blocks from one: N makes blocks N-1, 2N-1, ... full attention)."""
        if self.experimental_attention_variant is None:
            return False
        freq = self.linear_attention_freq
        if isinstance(freq, (list, tuple)):
            return bool(freq[block])
        return bool((block + 1) % freq)

    @property
    def linear_key_size(self) -> int:
        """Width of a linear block's q (and of its k): its key heads of key_head_dim."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_size(self) -> int:
        """Width of a linear block's v (and of its output gate z and its output)."""
        return self.linear_num_value_heads * self.linear_value_head_dim

    def window_of(self, block: int) -> int | None:
        """Block `block`'s sliding window (window_attn_skip_freq, as Megatron's
        is_layer_window_attention counts blocks from one); None: full causal attention."""
        freq = self.window_attn_skip_freq
        if self.window_size is None:
            return None
        if freq is None:
            return self.window_size
        if isinstance(freq, (list, tuple)):
            return self.window_size if freq[block] else None
        return self.window_size if (block + 1) % freq else None

    @property
    def padded_vocab_size(self) -> int:
        multiple = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // multiple) * multiple


@dataclass
class ParallelConfig:
    """Degrees only; every derived size comes from parallel.layout.Layout."""

    tensor_model_parallel_size: int = MISSING  # TP: ranks that split each weight matrix
    sequence_parallel: bool = MISSING  # SP: activations split over TP between layers (TP > 1)
    # WS: ranks that share one copy of the weights, TP included (GTP_remat = WS / TP); null = TP
    tensor_parallel_num_weight_shards: Optional[int] = MISSING
    # SS: ranks that split one sequence inside a TP x GTP_remat tile, SP included; null = SP
    # degree
    tensor_parallel_num_sequence_shards: Optional[int] = MISSING
    # CP: further sequence splits across weight replicas (runtime CP = CP x sequence shards)
    context_parallel_size: int = MISSING
    # EP, Megatron-Core's expert parallel: each MoE layer's experts split over EP ranks of the
    # expert view (parallel.layout.axes.expert)
    expert_model_parallel_size: int = MISSING
    # ETP: ranks that split each expert's FFN; null = TP, 1 keeps experts whole under TP
    expert_tensor_parallel_size: Optional[int] = MISSING
    pipeline_model_parallel_size: int = MISSING  # PP: pipeline stages
    # The order a stage runs its micro-batches in (parallel.layout.pipeline_schedules.SCHEDULES):
    # 1f1b (up to PP in flight), interleaved_1f1b (virtual chunks per stage: a smaller bubble
    # for more messages), gpipe (every forward, then every backward), zb_h1 (zero bubble: each
    # backward split into I, its input's gradient, and W, its weights', the W's filling the
    # bubble) or zbv (zero bubble over two chunks a stage in a V).
    pipeline_schedule: str = MISSING
    # Megatron's name: model chunks per stage for interleaved_1f1b (2 for zbv); null = 1
    virtual_pipeline_model_parallel_size: Optional[int] = MISSING
    # blocks on the first stage; the others split the rest evenly; null: an even split
    num_layers_in_first_pipeline_stage: Optional[int] = MISSING
    # blocks on the last stage; the others split the rest evenly; null: an even split
    num_layers_in_last_pipeline_stage: Optional[int] = MISSING
    # Communication (Megatron's flag names): how weight gathers and gradient reductions run;
    # they change bytes and timing, never the result.

    grad_reduce_in_bf16: bool = MISSING  # bf16 only: reduce-scatter gradients in bf16
    overlap_param_gather: bool = MISSING  # gather the next block's weights during this block
    overlap_grad_reduce: bool = MISSING  # reduce-scatter a block's gradients as they complete
    # how context-parallel attention sees the whole sequence (Megatron's --cp-comm-type): p2p
    # (a ring of K/V blocks), all_gather (K/V gathered whole) or a2a (Ulysses)
    cp_comm_type: CPCommType = MISSING


@dataclass
class ClusterConfig:
    """World size = num_nodes x procs_per_node: a config value, never read from the environment
    at compose time; the launcher checks the real world against it at start."""

    num_nodes: int = MISSING  # nodes of the run (torchrun's --nnodes)
    procs_per_node: int = MISSING  # ranks on each node, one device each where there are GPUs
    # devices that share one NVLink domain; the dry run warns when a weight tile spans more
    gpus_per_nvlink_domain: int = MISSING
    timeout_s: int = MISSING  # a collective waiting longer fails its rank (a peer died or hung)
    max_restarts: int = MISSING  # launch.py restarts failed ranks from the latest checkpoint
    # The hardware, per device (each preset names its sources). parallel=auto sizes and times
    # its candidate layouts from these; the logs' MFU divides by the peak.

    device_memory_gib: float = MISSING  # memory of one device
    memory_margin: float = MISSING  # share of device memory a layout must leave free
    peak_bf16_tflops: float = MISSING  # dense bf16 peak of one device (train.precision=bf16)
    peak_fp32_tflops: float = MISSING  # its fp32 peak (train.precision=fp32)
    compute_efficiency: float = MISSING  # the share of peak a transformer's GEMMs reach
    nvlink_bandwidth_gbs: float = MISSING  # GB/s one device sends inside its NVLink domain
    network_bandwidth_gbs: float = MISSING  # GB/s one device sends to other domains
    link_latency_us: float = MISSING  # per message hop of a collective
    # CPU runs: the cores a node's ranks share. With more ranks than cores they take turns, so
    # overlap hides no communication (the same cores move it) and a pipeline's waiting ranks
    # hand their cores to the others. null: each rank has a device of its own (GPUs).
    cpu_cores_per_node: Optional[int] = None


@dataclass
class TrainConfig:
    micro_batch_size: int = MISSING  # samples a batch lane runs forward and backward at once
    # samples one step trains on; null = micro_batch_size x batch_parallel_size
    global_batch_size: Optional[int] = MISSING
    seq_length: int = MISSING  # tokens of one sample
    # bf16: bf16 weights and activations in compute, fp32 master weights, gradients and Adam
    # moments
    precision: Precision = MISSING
    # what a block's backward recomputes instead of keeping: selective (the attention core and
    # the MLP activation) or full (the whole block); null = keep activations
    recompute_granularity: Optional[RecomputeGranularity] = MISSING
    # the first N blocks of each pipeline stage's model chunk recompute (Megatron's per stage);
    # null = all
    recompute_num_layers: Optional[int] = MISSING
    seed: int = MISSING  # model initialisation (the same full weights under every layout)
    # false | blocks: torch.compile each transformer block (regional compilation). Any, not an
    # enum: Hydra reads `false` as a boolean (trainer.checks says which values are valid).
    compile: Any = MISSING
    train_samples: int = MISSING  # the run ends after this many samples (whole steps)
    # Megatron's --rampup-batch-size [start, increment, samples]: the global batch starts at
    # `start` and grows by `increment` every samples / ((global - start) / increment) consumed
    # samples, reaching train.global_batch_size after `samples` (trainer.plan.rampup); null = none
    rampup_batch_size: Optional[List[int]] = MISSING
    eval_interval: Optional[int] = MISSING  # steps between evaluations; null = never
    eval_samples: int = MISSING  # validation samples per evaluation
    # lm: the next-token loss; dpo: preference pairs (trainer --preference data, dpo.*)
    objective: str = MISSING


@dataclass
class DataConfig:
    path: Optional[str] = MISSING  # a prepared dataset folder or a Megatron prefix; null = built-in
    tokenizer: Optional[str] = MISSING  # built-in corpus only (null = byte); datasets name theirs
    cache_dir: Optional[str] = MISSING  # where the built-in corpus is prepared; null = ~/.cache
    seed: int = MISSING  # the shuffled sample order (independent of the layout)
    valid_fraction: Optional[float] = MISSING  # built-in or Megatron: held-out share (null = 0.01)
    blend: Optional[List[str]] = MISSING  # Megatron's --data-path: [weight, path, weight, path...]
    # Packed documents (Megatron's flags): a token attends only to earlier tokens of its own
    # document
    reset_attention_mask: bool = MISSING
    # RoPE positions restart at 0 at each document (needs reset_attention_mask)
    reset_position_ids: bool = MISSING
    # no loss where the input is a document's end-of-document token
    eod_mask_loss: bool = MISSING
    pack: bool = MISSING  # samples of whole documents (examples), padded; none split in two


@dataclass
class OptimConfig:
    name: str = MISSING  # the optimizer (trainer.checks.OPTIMIZERS): adamw | muon
    weight_decay: float = MISSING  # constant weight decay (weight_decay_incr_style=constant)
    # Megatron's names: weight decay at the start of a linear or cosine weight_decay_incr_style
    # (null with constant)
    start_weight_decay: Optional[float] = MISSING
    end_weight_decay: Optional[float] = MISSING  # and at train.train_samples (>= the start)
    # constant: weight_decay throughout; linear or cosine: from start to end over
    # train.train_samples
    weight_decay_incr_style: WeightDecayIncrStyle = MISSING
    beta1: float = MISSING  # Adam's first-moment decay, in [0, 1)
    beta2: float = MISSING  # Adam's second-moment decay, in [0, 1)
    eps: float = MISSING  # Adam's epsilon, > 0
    clip_grad: Optional[float] = MISSING  # the global gradient norm's bound; null = no clipping
    # optim=muon (Megatron's names; trainer.parts.matrices says which parameters Muon takes, the
    # Adam keys above serve the rest). Unused by adamw, which refuses them changed.
    muon_momentum: float = 0.95  # the momentum's EMA factor, in [0, 1)
    muon_nesterov: bool = True  # orthogonalise g + momentum * (buffer - g), torch's default
    muon_num_ns_steps: int = 5  # Newton-Schulz iterations, >= 1
    # the update's scale for a rows x cols matrix: spectral sqrt(max), shape_scaling
    # sqrt(max(1, rows/cols)), unit_rms_norm sqrt(rows/cols) (trainer.checks.SCALE_MODES)
    muon_scale_mode: str = "spectral"
    muon_extra_scale_factor: float = 0.2  # times the scale; 0.2 x spectral: AdamW's update RMS
    muon_split_qkv: bool = True  # fused q/k/v (and gate/up) parts orthogonalised apart
    muon_ns_dtype: str = "master"  # master: the master weights' dtype; bf16: torch.optim.Muon's
    # fnmatch patterns of parameter names Muon would take that go to AdamW instead
    adamw_params: List[str] = field(default_factory=list)
    # QK-clip (Kimi K2's MuonClip, Megatron's qk_clip): after each update, a head whose largest
    # attention logit passed it has its q and k rows scaled to bring it back; null = off
    qk_clip_threshold: Optional[float] = None
    qk_clip_alpha: float = 0.5  # the share of the scaling q takes (k takes the rest)


@dataclass
class ScheduleConfig:
    """Megatron's sample-based schedule (trainer.plan.lr_schedule): the step that consumes samples
    [s, s + global batch) trains at Megatron's OptimizerParamScheduler.get_lr() at s samples."""

    # the shape after warmup (inverse_sqrt and wsd are accepted for the Megatron spellings)
    lr_decay_style: LrDecayStyle = MISSING
    lr: float = MISSING  # the peak learning rate
    min_lr: float = MISSING  # the floor the decay ends at (<= lr)
    lr_warmup_init: float = MISSING  # the lr the linear warmup starts from
    # the linear warmup's length in samples; null = lr_warmup_fraction (or no warmup)
    lr_warmup_samples: Optional[int] = MISSING
    # the warmup as a share of lr_decay_samples (not rounded); not with lr_warmup_samples
    lr_warmup_fraction: Optional[float] = MISSING
    # where the decay ends (min_lr after it); null = train.train_samples
    lr_decay_samples: Optional[int] = MISSING
    lr_wsd_decay_samples: Optional[int] = MISSING  # WSD: length of the final anneal
    # WSD: the anneal's shape; null = exponential, Megatron's default
    lr_wsd_decay_style: Optional[WsdDecayStyle] = MISSING


@dataclass
class LoggerConfig:
    name: LoggerName = MISSING  # where metrics go besides metrics.jsonl and the console
    log_interval: int = MISSING  # steps between progress lines (and the last step)
    project: Optional[str] = MISSING  # wandb project; unused by console and tensorboard
    sample_prompts: Optional[List[str]] = MISSING  # greedy continuations at each evaluation
    sample_max_new_tokens: int = MISSING  # tokens each sample prompt's continuation has


RUN_CHECKPOINTS = "checkpoints"  # checkpoint.dir=null: <run dir>/checkpoints


@dataclass
class CheckpointConfig:
    dir: Optional[str] = MISSING  # where checkpoints are written; null = <run dir>/checkpoints
    save_interval: Optional[int] = MISSING  # steps between checkpoints; null = only at the end
    async_save: bool = MISSING  # write in the background from a host copy (one save in flight)
    load: Optional[str] = MISSING  # a checkpoint folder, or a folder of them (the latest)
    resume: bool = MISSING  # load null and checkpoint.dir holds a checkpoint: continue from it
    finetune: bool = MISSING  # load only the weights of checkpoint.load; start at step 0


@dataclass
class DpoConfig:
    """train.objective=dpo (trainer.train.dpo): Direct Preference Optimization with TRL's
    names."""

    beta: float = MISSING  # the KL penalty's weight (IPO's tau), > 0
    loss_type: str = MISSING  # sigmoid (DPO) | ipo (length-normalised, as TRL)
    # sigmoid only: the chance a pair's preference is flipped (conservative DPO), in [0, 0.5)
    label_smoothing: float = MISSING


@dataclass
class PeftConfig:
    """peft=lora (trainer.parts.lora): low-rank adapters on the named projections, everything
    else frozen. Hugging Face PEFT's names for the projections and the keys' meanings."""

    name: str = MISSING  # lora
    lora_rank: int = MISSING  # r: the adapters' inner width, 1 .. the projection's smaller side
    lora_alpha: float = MISSING  # the update is scaled by lora_alpha / lora_rank
    lora_dropout: float = MISSING  # dropout on the adapters' input, in [0, 1)
    # q_proj k_proj v_proj o_proj gate_proj up_proj down_proj: the projections adapted (on a
    # mixture of experts gate, up and down name the routed experts: one adapter per expert)
    target_modules: List[str] = MISSING
    # the frozen base's projections (and untied head) kept in: fp32, or bf16 (half the bytes;
    # needs train.precision=bf16, which computes in bf16 anyway). Adapters, norms and the
    # embedding stay fp32.
    base_precision: Precision = Precision.fp32


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    peft: Optional[PeftConfig] = None  # null: full fine-tuning (every weight trains)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    run_name: str = MISSING  # the run folder's parent: outputs/<run_name>/<overrides>
    # plan only: print the layout, its groups and the memory plan, write layout.json, start
    # nothing
    dry_run: bool = MISSING
    # With dry_run: build this rank's engine in this one process against a simulated world
    # (torch's fake process group) and measure one training step; null = plan only.
    dry_run_rank: Optional[int] = MISSING
    # Read-only, derived by the resolver plugin from parallel.*, cluster.* and train.*:
    # world_size, sp_degree, gtp_remat_size, gtp_remat_num_sequence_shards,
    # gtp_remat_num_batch_shards, data_parallel_size, batch_parallel_size,
    # runtime_context_parallel_size, num_weight_replicas, num_microbatches, global_batch_size
    # and expert_data_parallel_size (docs/layout.md)
    layout: Any = II("gtp.layout:${parallel},${cluster},${train}")


def unknown_keys(cfg: DictConfig, schema: DictConfig | None = None, prefix: str = "") -> list[str]:
    """Keys of the composed config that no schema declares. Hydra lets `+group.key=value` add
    keys even to a typed node, so this check runs once more on the final config."""
    schema = OmegaConf.structured(Config) if schema is None else schema
    found, declared = [], set(schema.keys())  # `in` would skip keys whose value is ???
    for key in cfg.keys():
        path = f"{prefix}{key}"
        if key not in declared:
            found.append(path)
        elif OmegaConf.is_dict(schema._get_node(key)) and OmegaConf.is_dict(cfg._get_node(key)) \
                and not cfg._get_node(key)._is_none():
            found += unknown_keys(cfg[key], schema_node(schema, key), f"{path}.")
    return found


def schema_node(schema: DictConfig, key: str) -> Any:
    """schema[key], and for a group that is null by default (peft) its schema's keys."""
    node = schema._get_node(key)
    if isinstance(node, DictConfig) and node._is_none() and \
            dataclasses.is_dataclass(node._metadata.ref_type):
        return OmegaConf.structured(node._metadata.ref_type)
    return node


SCHEMA_NAME = "gtp_trainer_schema"


def register_schemas() -> None:
    """Idempotent: ConfigStore.store replaces an entry of the same name."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=Config)


register_schemas()
