"""Bytes a rank holds during a training step beyond its state: activations and transients.

Activations are what autograd keeps from one micro-batch's forward for its backward (micro-
batches run forward and backward one after the other, so one micro-batch's worth is alive at a
time). The counts follow this trainer's own model and kernels tensor by tensor, as measured
with torch.autograd.graph.saved_tensors_hooks; symbols, all local to the rank:

    b micro_batch_size   s = seq_length / runtime CP (this rank's tokens of a sequence)
    T = b*s              Tr = T / TP with sequence parallel, else T (the residual stream)
    S = seq_length       h hidden, f ffn, V padded vocab, n heads, d = h/n, t = TP
                         (d = model.kv_channels when set; q = n*d stands for h in Q)
    c = g*d              the width of k and of v (g query groups; c = h without GQA)
    e bytes of the compute dtype (fp32 4, bf16 2); norms and the residual stream stay fp32

A block keeps (no recompute):
    norms            2 x (input, normalised input): 4*Tr*h fp32
    linear inputs    qkv and gate_up (gathered over TP with SP): 2*T*h*e
    attention        in units of Q = T*h/t*e (q or the output) and K = T*c/t*e (k or v):
                     without CP: qkv output (v is a view of it), rotated q and k, output:
                     3Q + 3K; CP by p2p (ring): rotated q, the stacked K/V (the ring's
                     first block; the qkv output is not kept) and output: 2Q + 2K;
                     all_gather: rotated q, output and the gathered K and V of the whole
                     sequence: 2Q + 2*b*S*c/t*e;
                     a2a: the head-split q, k, v and output, and the output back in sequence
                     order: 3Q + 2K (b*S*h/(t*C) = T*h/t: the same bytes as local tokens)
    MLP              gate_up output, silu(gate), silu(gate)*up: 4*T*f/t*e
    small            rotary cos/sin 8*T*d, logsumexp 4*b*(n/t)*s, rsqrt 8*Tr bytes
    qk_layernorm     normalised q and k and their rsqrt: T*(q + c + n + g)/t*e; with CP (not
                     selective) also the qkv output they take as input: T*(q + 2c)/t*e
                     (q = n*d, the width of q, is h unless model.kv_channels sets d)
selective recompute drops silu(gate) and the logsumexp (with CP of any type it keeps the
local q, k and v and the output: 3Q + 3K); full recompute keeps only the block input (Tr*h
fp32) and rebuilds one block's activations at a time in backward. After the blocks: the final
norm (2*Tr*h fp32), the head input (T*h*e) and the loss's softmax (T*V/t fp32). No type builds
a mask. Under bf16 without weight sharding,
autocast also keeps a bf16 copy of every local weight.

A step's transients peak at one of two moments of a backward, never both: the loss's (all that
is kept, and the logits' gradients) or a block's (the head's activations freed; the gradient
entering the block, Tr*h fp32, its MLP's two products 2*T*f/t*e, a rebuilt block under full
recompute, its gathered weights). tests/multirank/test_step_memory.py counts both with the
allocator itself.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from parallel.layout import Layout
from trainer.config import CPCommType, ModelConfig, RecomputeGranularity
from trainer.parts import BlockParts, block_parts
from trainer.parts.tokens import FP32, Tokens, compute_bytes
from trainer.plan.axis_costs.gtp_remat import gathered_bytes
from trainer.plan.options import EngineOptions


def block_activation_bytes(m: ModelConfig, k: Tokens, e: int,
                           recompute: RecomputeGranularity | None,
                           cp_comm_type: CPCommType = CPCommType.p2p,
                           parts: BlockParts | None = None) -> int:
    """What one block keeps for its backward: its parts' (trainer.parts; parts: the block's,
    None for block 0's)."""
    if recompute is RecomputeGranularity.full:
        return k.Tr * m.hidden_size * FP32
    parts = parts or block_parts(m, 0)
    return sum(part.kept_bytes(m, k, e, recompute, cp_comm_type) for part in parts)


def head_activation_bytes(m: ModelConfig, k: Tokens, e: int) -> int:
    """The final norm, the head's input and the loss's saved softmax."""
    return 2 * k.Tr * m.hidden_size * FP32 + k.T * m.hidden_size * e + loss_bytes(m, k)


def loss_bytes(m: ModelConfig, k: Tokens) -> int:
    """One [T, V/t] fp32 buffer: the softmax (or log-softmax) of the local logits."""
    return k.T * (m.padded_vocab_size // k.t) * FP32


@dataclass(frozen=True)
class StepMemory:
    """Per-micro-batch figures of one rank (bytes)."""

    activation_bytes: int  # kept by every block and the head at the end of forward
    backward_bytes: int  # a block's backward: the gradient entering it and its MLP's products
    recompute_bytes: int  # one block's activations rebuilt in backward (full recompute)
    autocast_weight_bytes: int  # bf16 copies of unsharded weights autocast keeps
    logits_bytes: int  # the local logits and the loss's backward buffers
    gathered_bytes: int  # gathered weights alive at once (one or two blocks) and their grads
    message_bytes: int = 0  # received pipeline messages held at once (parallel.pipeline)
    # The two moments of a backward, which are never alive together: the loss's (everything
    # kept, the logits' gradients, the head's or embedding's gathered weight) and a block's
    # (the head's activations already freed; its gradients, rebuilt activations and gathered
    # weights). Counted by the allocator, the first is the step's peak within 0.1% where it is
    # the larger; the second stands above what a block's backward holds.
    head_phase_bytes: int = 0
    block_phase_bytes: int = 0

    @property
    def transient_bytes(self) -> int:
        return (self.activation_bytes + self.autocast_weight_bytes + self.message_bytes
                + max(self.head_phase_bytes, self.block_phase_bytes))


def chunk_activation_bytes(m: ModelConfig, layout: Layout, options: EngineOptions,
                           chunk: range) -> int:
    """What one model chunk (its blocks, `chunk`) keeps of one micro-batch (without the
    head): its blocks counted by what each recomputes and by their parts."""
    k, e = Tokens.of(layout), compute_bytes(options.precision)
    if m.num_moe_experts is None:  # every block alike
        return sum(count * block_activation_bytes(m, k, e, recompute, options.cp_comm_type)
                   for recompute, count in options.chunk_recompute(len(chunk)).items() if count)
    kinds = Counter((options.recomputes(p), block_parts(m, i)) for p, i in enumerate(chunk))
    return sum(count * block_activation_bytes(m, k, e, recompute, options.cp_comm_type, parts)
               for (recompute, parts), count in kinds.items())


def stage_chunk_bytes(m: ModelConfig, layout: Layout, options: EngineOptions,
                      chunks: list[range], last: bool) -> list[int]:
    """What one micro-batch keeps in each of a stage's chunks (`chunks`: its blocks by virtual
    chunk; `last`: it holds the head, in its last chunk)."""
    per_chunk = [chunk_activation_bytes(m, layout, options, chunk) for chunk in chunks]
    if last:
        per_chunk[-1] += head_activation_bytes(m, Tokens.of(layout),
                                               compute_bytes(options.precision))
    return per_chunk


def step_memory(m: ModelConfig, layout: Layout, options: EngineOptions, chunks: list[range],
                block_weights: int, head_weights: int, kept: int, last: bool = True,
                first: bool = True, messages: int = 0) -> StepMemory:
    """For a pipeline stage's blocks (`chunks`: its blocks by model chunk). block_weights:
    TP-local elements of one block's 2-D weights as gathered over GTP_remat (padding
    included); head_weights: the stage's head's or embedding's, the larger (0 for neither);
    kept: its activations in flight (trainer.plan.axis_costs.pipeline.stage_activation_bytes); last:
    it computes the loss; first: it holds the embedding; messages: its received pipeline
    messages held at once (trainer.plan.axis_costs.pipeline). A block's terms are its kind's, the
    larger where dense blocks and a mixture of experts' share the stage."""
    k, e = Tokens.of(layout), compute_bytes(options.precision)
    comm, h = options.cp_comm_type, m.hidden_size
    kinds = {block_parts(m, i) for chunk in chunks for i in chunk} or {block_parts(m, 0)}
    positions = [p for chunk in chunks for p in range(len(chunk))]
    full = options.recompute_granularity is RecomputeGranularity.full and any(
        options.recomputes(p) for p in positions)
    # A fully recomputed block is rebuilt from its input, which the chunk keeps already.
    rebuilt = max(block_activation_bytes(m, k, e, None, comm, parts) for parts in kinds) \
        - k.Tr * h * FP32 if full else 0
    sharded = layout.gtp_remat_size > 1
    autocast = 0
    if e != FP32 and not sharded:  # a fully recomputed block keeps no copy of its weights
        kept_copies = sum(options.recomputes(p) is not RecomputeGranularity.full
                          for p in positions)
        autocast = (kept_copies * block_weights + head_weights) * e
    # Backward of the head: the gradient of the logits (fp32, and its scaled copy) beside the
    # saved softmax; under TP in bf16 also its bf16 cast, which autograd makes for the
    # vocab-parallel loss's input while the loss's own buffers are still held.
    cast = k.T * (m.padded_vocab_size // k.t) * e if k.t > 1 and e != FP32 else 0
    logits = 2 * loss_bytes(m, k) + cast if last else 0
    sizes = [len(chunk) for chunk in chunks] or [0]
    if sharded:
        freed = max(block_activation_bytes(m, k, e, options.recompute_granularity, comm, parts)
                    for parts in kinds)
        block, head = gathered_bytes(layout, options, e, sizes, block_weights, head_weights,
                                     freed, first, last)
    else:  # weights are used in place; the head's gradient is formed before it is added
        block, head = 0, head_weights * FP32
    head_kept = head_activation_bytes(m, k, e) if last else 0  # freed when blocks' backward starts
    # A block's backward beside what it keeps; a fully recomputed block (the first
    # recompute_num_layers of a chunk) is rebuilt after the chunk's later blocks have run their
    # backward and freed their activations.
    counts = options.chunk_recompute(max(sizes))
    selective = options.recompute_granularity is RecomputeGranularity.selective
    backward = max(parts.mlp.backward_bytes(m, k, e, selective) for parts in kinds)
    phases = [backward + block] if any(g is not RecomputeGranularity.full and n
                                       for g, n in counts.items()) else []
    if rebuilt:
        largest = max(chunks, key=len)
        kept_by_others = chunk_activation_bytes(m, layout, options, largest) - k.Tr * h * FP32 \
            * sum(options.recomputes(p) is RecomputeGranularity.full for p in range(len(largest)))
        # (and the rebuilt forward's own moment: a MoE block's exchange over ETP)
        phases.append(max(max(parts.mlp.backward_bytes(m, k, e, False),
                              parts.mlp.rebuild_bytes(m, k, e)) for parts in kinds)
                      + rebuilt + block - kept_by_others)
    return StepMemory(kept, backward, rebuilt, autocast, logits, max(block, head), messages,
                      max(logits, head), max(phases) - head_kept)
