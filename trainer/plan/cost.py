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
from trainer.parts.assembly import block_core_flops, block_weight_elements, mtp_token_flops
from trainer.parts.lora import Adapters, adapter_elements
from trainer.parts.tokens import compute_bytes
from trainer.plan.axis_costs import REGISTRY
from trainer.plan.axis_costs.entry import Micro
from trainer.plan.hardware import Hardware
from trainer.plan.options import EngineOptions

MUON_UPDATE = "muon update"  # Estimate.seconds' row under optim=muon

# Estimate.seconds' rows: compute, each axis's micro-batch messages, then each axis's per step
# (in the registry's order: TP, weight gathers, CP, EP dispatch, PP sends; optimizer, bubble).
KINDS = ("compute", *(c.kind for c in REGISTRY if c.kind),
         *(c.step_kind for c in REGISTRY if c.step_kind))


@dataclass(frozen=True)
class TokenFlops:
    """The forward FLOPs one token costs, counted from the config: a block's linears 2*W, its
    parts' core FLOPs (trainer.parts):
    causal attention 2*S*q (QK^T and AV, 2*S*q each over S keys, halved: a query sees the keys
    before it), the head 2*h*V, and multi-token prediction's depths (each its eh_proj, block
    and head). The embedding is a lookup; norms and activations are not counted (Megatron's
    and torchtitan's convention). Under peft=lora the adapters' matmuls count, and the frozen
    weights' skipped weight gradients do not (`training`)."""
    block_linear: float
    block_attention: float
    head: float
    num_layers: int
    mtp: float = 0.0
    block_adapters: float = 0.0  # peft=lora: its adapters' 2*r*(in + rows) each
    frozen: bool = False  # peft=lora: every weight but the adapters'

    @classmethod
    def of(cls, m: ModelConfig, seq_length: int, lora: Adapters | None = None) -> TokenFlops:
        return cls(2 * block_weight_elements(m), block_core_flops(m, seq_length),
                   2 * m.hidden_size * m.padded_vocab_size, m.num_layers,
                   mtp_token_flops(m, seq_length),
                   2 * adapter_elements(m, lora) if lora else 0.0, lora is not None)

    @property
    def forward(self) -> float:
        """One forward of the base model (DPO's reference pass: no adapters)."""
        return self.num_layers * (self.block_linear + self.block_attention) + self.head \
            + self.mtp

    @property
    def training(self) -> float:
        """Model FLOPs of a trained token: forward and a backward of twice its FLOPs. What
        recompute runs again is not model FLOPs (MFU counts it as lost time). Under peft=lora
        a frozen weight's backward forms the input's gradient only (once its forward's FLOPs,
        not twice); the adapters and attention's core run their whole backward."""
        if not self.frozen:
            return 3 * self.forward
        return (self.num_layers * (2 * self.block_linear + 3 * self.block_adapters
                                   + 3 * self.block_attention) + 2 * (self.head + self.mtp))


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


def estimate(m: ModelConfig, layout: Layout, options: EngineOptions, hw: Hardware,
             muon_s: float | None = None) -> Estimate:
    """muon_s: under optim=muon, its update's time on the slowest stage (its Newton-Schulz
    work and exchange: trainer.plan.muon.update_seconds), a row of its own."""
    t = layout.tp_size
    b, s, S = layout.micro_batch_size, layout.context_local_length, layout.seq_length
    T, W = b * s, block_weight_elements(m)
    e, token = compute_bytes(options.precision), TokenFlops.of(m, S, options.lora)
    flops = hw.flops(options.precision)
    # Compute of one micro-batch through one block, forward and backward; under peft=lora the
    # frozen weights' backward skips their weight gradients (once their forward, not twice).
    linear_fwd = T * (token.block_linear + token.block_adapters) / t / flops
    skipped = T * token.block_linear / t / flops if token.frozen else 0.0
    attn_fwd = T * token.block_attention / t / flops
    extra = {RecomputeGranularity.full: linear_fwd + attn_fwd,
             RecomputeGranularity.selective: attn_fwd, None: 0.0}
    head_fwd = T * (token.head + token.mtp) / t / flops  # the last stage: head, MTP depths
    # Shared cores compute and move messages in turn: nothing overlaps.
    trained = token.block_adapters / 2 if token.frozen else None  # peft=lora: the adapters'
    micro = Micro(m, layout, hw, options, T, e, W, attn_fwd, head_fwd, not hw.shares_cores,
                  trained)

    # The slowest stage's micro-batch, and each planned stage's weight elements. Each axis's
    # messages are its entry's (trainer.plan.axis_costs): a block's, the head's, the
    # embedding's, a stage's.
    micro_s, micro_parts, stage_elements = 0.0, dict.fromkeys(KINDS, 0.0), []
    all_chunks, pp = layout.pipeline_layers(m.num_layers), layout.pp_size
    for stage in sorted({0, min(1, pp - 1), pp - 1}):  # the middle stages are stage 1's twins
        chunks = all_chunks[stage::pp]
        parts = dict.fromkeys(KINDS, 0.0)
        counts: dict = {}
        for chunk in chunks:  # recompute_num_layers counts within each chunk
            for recompute, count in options.chunk_recompute(len(chunk)).items():
                counts[recompute] = counts.get(recompute, 0) + count
        for recompute, count in counts.items():
            fwd = linear_fwd + attn_fwd
            bwd = 2 * fwd + extra[recompute] - skipped
            parts["compute"] += count * (fwd + bwd)
            for costs in REGISTRY:
                if costs.block_s:
                    parts[costs.kind] += count * costs.block_s(micro, recompute, fwd, bwd)
        first, last = stage == 0, stage == pp - 1
        elements = sum(len(chunk) for chunk in chunks) * micro.grad_weights
        head = 0 if token.frozen else m.padded_vocab_size * m.hidden_size  # its gradient's
        if last:  # the head
            parts["compute"] += (2 if token.frozen else 3) * head_fwd
            for costs in REGISTRY:
                if costs.head_s:
                    parts[costs.kind] += costs.head_s(micro)
            elements += head if not m.tie_word_embeddings or layout.pp_size == 1 else 0
        if first:  # the embedding
            for costs in REGISTRY:
                if costs.embedding_s:
                    parts[costs.kind] += costs.embedding_s(micro)
            elements += head
        for costs in REGISTRY:
            if costs.stage_s:
                parts[costs.kind] += costs.stage_s(micro, len(chunks))
        if sum(parts.values()) > micro_s:
            micro_s, micro_parts = sum(parts.values()), parts
        stage_elements.append(elements)
    seconds = {kind: value * layout.num_microbatches for kind, value in micro_parts.items()}
    for costs in REGISTRY:
        if costs.step_s:
            seconds[costs.step_kind] = costs.step_s(micro, micro_s, stage_elements)
    if muon_s is not None:
        seconds[MUON_UPDATE] = muon_s
    return Estimate(sum(seconds.values()), seconds)


def floor_s(m: ModelConfig, layout: Layout, precision: Precision, hw: Hardware,
            lora: Adapters | None = None) -> float:
    """At most estimate(...).step_s under any option of this layout (recompute, cp_comm_type,
    overlap): the last stage's compute without recompute and the messages no option hides (TP's),
    m times and through the bubble, plus the optimizer's reduction of the smallest stage. The
    search skips a layout whose floor is already slower than the candidates it keeps. lora:
    peft=lora's, whose compute and gradients are estimate's under it."""
    t, pp = layout.tp_size, layout.pp_size
    b, s = layout.micro_batch_size, layout.context_local_length
    T, W = b * s, block_weight_elements(m)
    e, token = compute_bytes(precision), TokenFlops.of(m, layout.seq_length, lora)
    flops = hw.flops(precision)
    micro = Micro(m, layout, hw, None, T, e, W,
                  trained_weights=token.block_adapters / 2 if token.frozen else None)
    per_stage = [sum(map(len, layout.stage_chunks(stage, m.num_layers))) for stage in range(pp)]
    blocks = per_stage[-1]  # the last stage's, which also runs the head
    block = (3 * T * (token.block_linear + token.block_adapters + token.block_attention)
             - (T * token.block_linear if token.frozen else 0)) / t / flops
    for costs in REGISTRY:
        if costs.floor_block_s:
            block += costs.floor_block_s(micro)
    step = blocks * block + (2 if token.frozen else 3) * T * (token.head + token.mtp) / t / flops
    for costs in REGISTRY:
        if costs.floor_head_s:
            step += costs.floor_head_s(micro)
    extra, reduce = 0.0, 0.0  # micro-batches of the bubble; per-step terms
    for costs in REGISTRY:
        if costs.floor_microbatches:
            extra += costs.floor_microbatches(micro)
        if costs.floor_step_s:
            reduce += costs.floor_step_s(micro, per_stage)
    return step * (layout.num_microbatches + extra) + reduce
