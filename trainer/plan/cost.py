"""The step time of one layout, estimated before it runs: compute at the hardware's achieved
FLOP/s, plus each communication's time on its link less what overlap hides, plus the pipeline
bubble. Symbols as in trainer/plan/activations.py (all local to a rank): b micro-batch, s this
rank's tokens of a sequence, T = b*s, S = seq_length, h, q (the width of q: heads x head
width), f, V, t = TP, G = GTP_remat, C = runtime CP, e bytes of the compute dtype.

Per micro-batch and block (forward; backward is twice the FLOPs and mirrors the messages):
    FLOPs        2*T*W/t for the linears (W: a block's weight elements), 2*T*S*q/t for causal
                 attention (each query sees S/2 keys: zigzag balances them); full recompute runs
                 the forward again, selective the attention core
    TP (t > 1)   two all-gathers and two reduce-scatters of T*h*e (SP; without SP two
                 all-reduces: the same bytes), not hidden
    GTP_remat    the block's weights gathered (forward, again in backward, and for a full
                 recompute; bf16 under bf16) and their gradients reduce-scattered; hidden behind
                 the block's compute with overlap_param_gather / overlap_grad_reduce
    CP (C > 1)   p2p: K/V (2*T*c/t*e) C-1 hops forward, C-1 and their fp32 gradients C hops in
                 backward, hidden behind attention; all_gather: K/V gathered, their gradients
                 reduce-scattered; a2a: q, k, v and the output between sequence and heads, both
                 ways; neither hidden
    PP           the residual stream (b*s/t_sp*h fp32) to the next stage, its gradient back
    EP           a mixture of experts' rows to their experts' ranks and back by all-to-all,
                 both ways in backward (T*topk*h*e, (EP-1)/EP of it leaving), not hidden
Per step: the optimizer's flat buffers reduce-scattered and gathered over weight_replica. The
step runs m micro-batches on the slowest stage plus the bubble: (PP-1)/v of them more.
Ranks sharing CPU cores (Hardware.shares_cores): nothing is hidden, and the bubble costs only
Hardware.bubble_share(PP) of its time. Each axis's messages are its own module's
(trainer.plan.axis_costs); this one composes them with the compute.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from parallel.layout import Layout
from trainer.config import ModelConfig, Precision, RecomputeGranularity
from trainer.parts.plan import block_weight_elements
from trainer.plan.axis_costs.context import context_seconds
from trainer.plan.axis_costs.data import optimizer_seconds
from trainer.plan.axis_costs.expert import dispatch_seconds
from trainer.plan.axis_costs.gtp_remat import gather_seconds
from trainer.plan.axis_costs.pipeline import bubble_seconds, send_seconds
from trainer.plan.axis_costs.tensor import tp_seconds
from trainer.plan.hardware import Hardware
from trainer.plan.options import EngineOptions
from trainer.plan.tokens import compute_bytes

KINDS = ("compute", "tensor parallel", "weight gathers", "context parallel", "expert dispatch",
         "pipeline sends", "optimizer reduce", "pipeline bubble")


@dataclass(frozen=True)
class TokenFlops:
    """The forward FLOPs one token costs, counted from the config: a block's linears 2*W, its
    causal attention 2*S*q (QK^T and AV, 2*S*q each over S keys, halved: a query sees the keys
    before it), the head 2*h*V. The embedding is a lookup; norms and activations are not
    counted (Megatron's and torchtitan's convention)."""
    block_linear: float
    block_attention: float
    head: float
    num_layers: int

    @classmethod
    def of(cls, m: ModelConfig, seq_length: int) -> TokenFlops:
        return cls(2 * block_weight_elements(m), 2 * seq_length * m.q_size,
                   2 * m.hidden_size * m.padded_vocab_size, m.num_layers)

    @property
    def training(self) -> float:
        """Model FLOPs of a trained token: forward and a backward of twice its FLOPs. What
        recompute runs again is not model FLOPs (MFU counts it as lost time)."""
        return 3 * (self.num_layers * (self.block_linear + self.block_attention) + self.head)


@dataclass(frozen=True)
class Estimate:
    step_s: float
    seconds: dict[str, float] = field(default_factory=dict)  # by KINDS: compute, exposed comm

    @property
    def dominant(self) -> str:
        return max(self.seconds, key=self.seconds.get)

    def as_dict(self) -> dict:
        return {"step_s": self.step_s, "dominant": self.dominant,
                "seconds": {k: round(v, 6) for k, v in self.seconds.items()}}


def estimate(m: ModelConfig, layout: Layout, options: EngineOptions, hw: Hardware) -> Estimate:
    t = layout.tp_size
    b, s, S, h = layout.micro_batch_size, layout.context_local_length, layout.seq_length, \
        m.hidden_size
    T, V, W = b * s, m.padded_vocab_size, block_weight_elements(m)
    e, token = compute_bytes(options.precision), TokenFlops.of(m, S)
    flops = hw.flops(options.precision)
    overlaps = not hw.shares_cores  # shared cores compute and move messages in turn
    overlap_gather = options.overlap_param_gather and overlaps
    overlap_reduce = options.overlap_grad_reduce and overlaps
    # Compute of one micro-batch through one block, forward and backward.
    linear_fwd = T * token.block_linear / t / flops
    attn_fwd = T * token.block_attention / t / flops
    extra = {RecomputeGranularity.full: linear_fwd + attn_fwd,
             RecomputeGranularity.selective: attn_fwd, None: 0.0}
    head_fwd = T * token.head / t / flops

    # Each axis's messages (trainer.plan.axis_costs): TP's per block and around the head, a block's
    # weight gathers and gradient reduce-scatters (a full weight is W/t elements), CP's K/V.
    tp_block, tp_head = tp_seconds(layout, hw, T * h * e)
    gather, scatter = gather_seconds(layout, options, hw, W / t, e)
    cp_fwd, cp_bwd = context_seconds(m, layout, options.cp_comm_type, hw, T, e, attn_fwd,
                                     overlaps)

    def block_time(recompute: RecomputeGranularity | None) -> tuple[float, dict[str, float]]:
        fwd = linear_fwd + attn_fwd
        bwd = 2 * fwd + extra[recompute]
        regathers = 2 if recompute is RecomputeGranularity.full else 1
        # The next block's weights gather under this block's forward; in backward the
        # gathers and the gradient reduce-scatters run under its backward, where overlapped.
        exposed = max(0.0, gather - fwd) if overlap_gather else gather
        hidden = (regathers * gather if overlap_gather else 0.0) + (
            scatter if overlap_reduce else 0.0)
        shown = regathers * gather + scatter - hidden
        exposed += max(0.0, hidden - bwd) + shown
        return fwd + bwd, {"tensor parallel": tp_block, "weight gathers": exposed,
                           "context parallel": cp_fwd + cp_bwd,
                           "expert dispatch": dispatch_seconds(m, layout, hw, T, e, recompute)}

    # The slowest stage's micro-batch, and its optimizer step.
    micro_s, micro_parts, optimizer_s = 0.0, dict.fromkeys(KINDS, 0.0), 0.0
    all_chunks, pp = layout.pipeline_layers(m.num_layers), layout.pp_size
    for stage in sorted({0, min(1, pp - 1), pp - 1}):  # the middle stages are stage 1's twins
        chunks = all_chunks[stage::pp]
        parts = dict.fromkeys(KINDS, 0.0)
        counts: dict = {}
        for chunk in chunks:  # recompute_num_layers counts within each chunk
            for recompute, count in options.chunk_recompute(len(chunk)).items():
                counts[recompute] = counts.get(recompute, 0) + count
        for recompute, count in counts.items():
            compute, comm = block_time(recompute)
            parts["compute"] += count * compute
            for kind, value in comm.items():
                parts[kind] += count * value
        first, last = stage == 0, stage == pp - 1
        elements = sum(len(chunk) for chunk in chunks) * W
        if last:  # the head: gathered for forward and again for backward
            parts["compute"] += 3 * head_fwd
            parts["tensor parallel"] += tp_head
            head = (2 * gather + scatter) * V * h / W
            parts["weight gathers"] += max(0.0, head - 3 * head_fwd) \
                if overlap_gather else head
            elements += V * h if not m.tie_word_embeddings or layout.pp_size == 1 else 0
        if first:  # the embedding: gathered once, its gradient reduce-scattered
            parts["weight gathers"] += (gather + scatter) * V * h / W
            elements += V * h
        parts["pipeline sends"] += send_seconds(m, layout, hw, len(chunks))
        if sum(parts.values()) > micro_s:
            micro_s, micro_parts = sum(parts.values()), parts
        optimizer_s = max(optimizer_s, optimizer_seconds(layout, hw, elements))
    seconds = {kind: value * layout.num_microbatches for kind, value in micro_parts.items()}
    seconds["pipeline bubble"] = bubble_seconds(micro_s, layout, hw)
    seconds["optimizer reduce"] = optimizer_s
    return Estimate(sum(seconds.values()), seconds)


def floor_s(m: ModelConfig, layout: Layout, precision: Precision, hw: Hardware) -> float:
    """At most estimate(...).step_s under any option of this layout (recompute, cp_comm_type,
    overlap): the last stage's compute without recompute and its TP messages, m times and
    through the bubble, plus the optimizer's reduction of the smallest stage. The search skips
    a layout whose floor is already slower than the candidates it keeps."""
    t, pp = layout.tp_size, layout.pp_size
    b, s, h = layout.micro_batch_size, layout.context_local_length, m.hidden_size
    T, W = b * s, block_weight_elements(m)
    e, token = compute_bytes(precision), TokenFlops.of(m, layout.seq_length)
    flops = hw.flops(precision)
    per_stage = [sum(map(len, layout.stage_chunks(stage, m.num_layers))) for stage in range(pp)]
    blocks = per_stage[-1]  # the last stage's, which also runs the head
    ring = tp_seconds(layout, hw, T * h * e)[1] / 2  # one TP collective of T*h*e
    micro = blocks * (3 * T * (token.block_linear + token.block_attention) / t / flops
                      + 8 * ring) + 3 * T * token.head / t / flops + 2 * ring
    optimizer = optimizer_seconds(layout, hw, min(per_stage) * W)
    bubble = (pp - 1) / layout.virtual_pipeline_size * hw.bubble_share(pp)
    return micro * (layout.num_microbatches + bubble) + optimizer
