"""What a rank forms during a step beyond the activations it keeps (trainer.plan.activations),
at the moments it peaks; symbols as there.

A step's transients peak at one moment, counted beside all that is kept: the loss's (the
logits' gradients, or where the vocabulary is small the final norm's backward or, under SP,
the head's own forward) or a block's (the head's activations freed, and the chunk's later
blocks' activations, which run their backward first; the gradient entering the block, Tr*h
fp32, its MLP's two products 2*T*f/t*e, its attention's backward, a rebuilt block under full
recompute, its gathered weights). A Gated DeltaNet block's forward is a block moment too, its
chunk loop's (trainer.parts.gdn.forward_bytes), before its MLP side and the later blocks are
made. With multi-token prediction the loss's moment is the last depth's (its loss's backward
runs first, beside all that is kept), and a depth's block's backward is a third moment: the
model's blocks and head still kept, the depth's norm, head input and softmax freed.
tests/multirank/test_step_memory.py counts them with the allocator itself.
"""
from __future__ import annotations

from dataclasses import dataclass

from parallel.layout import Layout
from parallel.layout.pipeline_schedules import SPLIT_BACKWARD
from trainer.config import CPCommType, ModelConfig, RecomputeGranularity
from trainer.parts import BlockParts, block_parts, mtp
from trainer.parts.lora import local_adapter_elements, uncast_elements
from trainer.parts.norm import block_norms
from trainer.parts.tokens import FP32, Tokens, compute_bytes
from trainer.plan.activations import (
    block_activation_bytes,
    blocks_alike,
    head_activation_bytes,
    loss_bytes,
    mtp_block_bytes,
    weight_grad_bytes,
)
from trainer.plan.axis_costs.gtp_remat import REDUCES_IN_FLIGHT, head_gathered_bytes
from trainer.plan.options import EngineOptions


def block_backward_bytes(parts: BlockParts, m: ModelConfig, k: Tokens, e: int,
                         selective: bool, gathered: int = 0, message: int = 0,
                         cp_comm_type: CPCommType = CPCommType.p2p, split: bool = False,
                         received: bool = False) -> int:
    """The most a block's backward forms beside what it keeps: its MLP's moments, its
    attention's (Gated DeltaNet's rule: trainer.parts.gdn; softmax attention's never outgrow
    the MLP's), or a zero-centred norm's (fp32 whatever the compute dtype: trainer.parts.norm),
    the largest;
    with `gathered`, what weight sharding holds then, of which the fp32 gradient message
    (`message`) is not made yet at a norm's moment (no weight's gradient is); `split`: run
    as a zero-bubble schedule's I, the MLP's moment with what W needs kept (Part.split_bytes);
    `received`: the gradient entering it (the MLP's first) is a pipeline message, which the
    stage's messages count (the last block of a chunk before the model's last)."""
    # the attention's backward runs after the MLP's and its norm's: their activations are gone
    recompute = RecomputeGranularity.selective if selective else None
    mlp_side = mlp_side_bytes(parts, m, k, e, recompute, cp_comm_type)
    attention = parts.attention.backward_bytes(m, k, e, selective, cp_comm_type)
    split_extra = parts.mlp.split_bytes(m, k, e) if split else 0
    entering = k.Tr * m.hidden_size * FP32 if received else 0
    return max(parts.mlp.backward_bytes(m, k, e, selective) + split_extra + gathered - entering,
               attention - mlp_side + gathered if attention else 0,
               parts.norm.backward_bytes(m, k, e, selective) + gathered - message)


def mlp_side_bytes(parts: BlockParts, m: ModelConfig, k: Tokens, e: int,
                   recompute: RecomputeGranularity | None, cp_comm_type: CPCommType) -> int:
    """What a block keeps after its attention: its MLP's activations and its second norm's."""
    return parts.mlp.kept_bytes(m, k, e, recompute, cp_comm_type) + \
        parts.norm.kept_bytes(m, k, e) // len(block_norms(m))


def block_forward_bytes(parts: BlockParts, m: ModelConfig, k: Tokens, e: int,
                        recompute: RecomputeGranularity | None, cp_comm_type: CPCommType) -> int:
    """A block's attention's forward at its most, beside what the block keeps once done (its
    MLP side not made yet): Gated DeltaNet's chunk loop (trainer.parts.gdn); other parts'
    forwards never outgrow a backward (0)."""
    forward = parts.attention.forward_bytes(m, k, e, recompute, cp_comm_type)
    return forward - mlp_side_bytes(parts, m, k, e, recompute, cp_comm_type) if forward else 0


@dataclass(frozen=True)
class StepMemory:
    """Per-micro-batch figures of one rank (bytes)."""

    activation_bytes: int  # kept by every block and the head at the end of forward
    backward_bytes: int  # a block's backward: the gradient entering it and its MLP's products
    recompute_bytes: int  # one block's activations rebuilt in backward (full recompute)
    autocast_weight_bytes: int  # bf16 copies of unsharded weights its pairs in flight keep
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


def autocast_copy_bytes(m: ModelConfig, layout: Layout, options: EngineOptions,
                        chunks: list[range], block_weights: int, head_weights: int,
                        last: bool, first: bool, depth_weights: int = 0,
                        kind_weights: dict[BlockParts, int] | None = None) -> list[int]:
    """The bf16 copies of its weights autocast makes in one micro-batch's forward through each
    of a stage's chunks (arguments as step_memory's), which the matmuls keep for the backward.
    autocast's cache lives for one forward call, so every (micro-batch, chunk) in flight holds
    a set of its own, from its forward to its backward (B, or a split backward's I), like its
    activations. Weight sharding gathers in bf16 and keeps none; a fully recomputed block
    keeps none; embedding lookups are not cast, so only the stage with the head keeps its."""
    e, k, lora = compute_bytes(options.precision), Tokens.of(layout), options.lora
    if e == FP32 or layout.gtp_remat_size > 1:
        return [0] * len(chunks)
    full = RecomputeGranularity.full
    per_chunk = []
    for c, chunk in enumerate(chunks):
        copied = [i for p, i in enumerate(chunk) if options.recomputes(p) is not full]
        head = last and c == len(chunks) - 1
        if lora is not None and lora.base_bf16:  # the frozen matrices are bf16 already:
            # the adapters' casts (and a tied head's, the fp32 embedding's) only
            elements = len(copied) * local_adapter_elements(m, lora, k.t) \
                + (head_weights if head and m.tie_word_embeddings else 0)
        else:  # each kept block's own weights (a hybrid's linear and full blocks differ)
            elements = sum((kind_weights or {}).get(block_parts(m, i), block_weights)
                           for i in copied) + (head_weights if head else 0)
            if head and options.recompute_granularity is not full:
                elements += mtp.depths(m) * depth_weights  # the depths' blocks' copies
            if lora is not None and first and c == 0 and options.recomputes(0) is not full:
                # the first block's input carries no gradient: some casts are not kept
                elements -= uncast_elements(m, lora, k.t)
        per_chunk.append(int(elements) * e)
    return per_chunk


def step_memory(m: ModelConfig, layout: Layout, options: EngineOptions, chunks: list[range],
                block_weights: int, head_weights: int, kept: int, last: bool = True,
                first: bool = True, messages: int = 0,
                depth_weights: tuple[int, int] = (0, 0),
                kind_weights: dict[BlockParts, int] | None = None, copies: int = 0
                ) -> StepMemory:
    """For a pipeline stage's blocks (`chunks`: its blocks by model chunk). block_weights:
    TP-local elements of one block's 2-D weights as gathered over GTP_remat (padding
    included); head_weights: the stage's head's or embedding's, the larger (0 for neither);
    kept: its activations in flight (trainer.plan.axis_costs.pipeline.stage_activation_bytes),
    copies: autocast's copies its pairs in flight keep beside them (autocast_copy_bytes); last:
    it computes the loss; first: it holds the embedding; messages: its received pipeline
    messages held at once (trainer.plan.axis_costs.pipeline); depth_weights: a multi-token
    prediction depth's block's 2-D weights, as block_weights, and the largest of them (on the
    last stage). A block's backward is its kind's, the largest of the kinds' where dense blocks
    and a mixture of experts' share the stage, each with its own weights (kind_weights: each
    kind's block_weights) and activations."""
    k, e = Tokens.of(layout), compute_bytes(options.precision)
    comm, h = options.cp_comm_type, m.hidden_size
    kinds = {block_parts(m, i) for chunk in chunks for i in chunk} or {block_parts(m, 0)}
    positions = [p for chunk in chunks for p in range(len(chunk))]
    full = options.recompute_granularity is RecomputeGranularity.full and any(
        options.recomputes(p) for p in positions)
    # A fully recomputed block is rebuilt from its input, which the chunk keeps already (a
    # windowed one with what its exchange receives: the kind's largest).
    windows = {m.window_of(i) for chunk in chunks for i in chunk} or {m.window_of(0)}
    lora = options.lora
    rebuilt_of = {parts: max(block_activation_bytes(m, k, e, None, comm, parts, w, lora)
                             for w in windows) - k.Tr * h * FP32
                  if full else 0 for parts in kinds}
    rebuilt = max(rebuilt_of.values())
    sharded = layout.gtp_remat_size > 1
    # Backward of the head: the gradient of the logits (fp32, and its scaled copy) beside the
    # saved softmax; under TP in bf16 also its bf16 cast, which autograd makes for the
    # vocab-parallel loss's input while the loss's own buffers are still held.
    local = k.T * (m.padded_vocab_size // k.t)
    cast = local * e if k.t > 1 and e != FP32 else 0
    # The loss's forward (the last depth's, with multi-token prediction): the step holds the
    # model's and every depth's logits until their losses are formed, beside the loss's own
    # buffers: under bf16 its fp32 copy of the logits, under TP the shifted logits the
    # vocab-parallel loss forms before their exp (its softmax, kept). Without depths never
    # above the backward's.
    forward = (1 + mtp.depths(m)) * local * e + (local * FP32 if e != FP32 else 0) \
        + (local * FP32 if k.t > 1 else 0)
    # The final norm's backward (a zero-centred norm's fp32 gradients: a block's without the
    # stream's gradient passing beside it and the one it hands on), the loss's softmax and the
    # head's input freed by then: above the loss's own where the vocabulary is small.
    final_norm = max(0, block_parts(m, m.num_layers - 1).norm.backward_bytes(m, k, e)
                     - k.Tr * h * (FP32 + e)) - loss_bytes(m, k) - k.T * h * e
    # The head's own forward under SP: the final norm's output still held while its gather
    # (fp32) is copied into the head's kept input (a contiguous one; under bf16 its cast),
    # beside the logits made, before the loss's softmax is.
    gather = (k.Tr * h * FP32 + (k.T * h * FP32 if e != FP32 or k.b > 1 else 0)
              if k.Tr != k.T else 0)
    head_forward = gather + local * e - loss_bytes(m, k)
    logits = max(2 * loss_bytes(m, k) + cast, forward, final_norm, head_forward) if last else 0
    sizes = [len(chunk) for chunk in chunks] or [0]
    if sharded:
        freed = max(block_activation_bytes(m, k, e, options.recompute_granularity, comm, parts,
                                           w, lora) for parts in kinds for w in windows)
        head = head_gathered_bytes(layout, options, e, sizes, block_weights, head_weights,
                                   freed, first, last)
    else:  # weights are used in place; the head's gradient is formed before it is added
        head = head_weights * FP32
    # freed when the model's blocks' backward starts (the depths' included)
    head_kept = head_activation_bytes(m, k, e, options.recompute_granularity, comm, lora) \
        if last else 0
    # A block's backward beside what it keeps, block by block (its kind's terms, and under
    # weight sharding its neighbours' weights); a fully recomputed block (the first
    # recompute_num_layers of a chunk) is rebuilt after the chunk's later blocks have run their
    # backward and freed their activations.
    selective = options.recompute_granularity is RecomputeGranularity.selective
    split = options.pipeline_schedule in SPLIT_BACKWARD
    backward = max(block_backward_bytes(parts, m, k, e, selective,
                                        cp_comm_type=options.cp_comm_type, split=split)
                   for parts in kinds)
    phases, bundles, alike = [], [], {}
    dense = blocks_alike(m)  # every block one kind: a chunk is known by its length
    for chunk in chunks:
        kinds_of = [block_parts(m, 0)] * len(chunk) if dense else \
            [block_parts(m, i) for i in chunk]
        weights = [(kind_weights or {}).get(kind, block_weights) for kind in kinds_of]
        # the search asks of many alike chunks
        key = (tuple(kinds_of), tuple(weights), tuple(m.window_of(i) for i in chunk))
        if key not in alike:
            alike[key] = chunk_phases(m, layout, options, chunk, weights, rebuilt_of)
        for phase, gathered in alike[key]:
            phases.append(phase)
            bundles.append(gathered)
    if not phases:  # a stage without blocks
        phases = [backward]
    block = max(bundles, default=0)  # gathered weights and messages (0 unsharded)
    # freed when the blocks' backward starts, but what the head's W waits for (split)
    head_waits = weight_grad_bytes(m, layout, options, range(0), True) if split and last else 0
    blocks_phase = max(phases) - head_kept + head_waits
    if last and mtp.depths(m):
        # A weight used more than once holds its earlier uses' gradient in autograd's buffer
        # until its last use's backward: the head's (its depths' uses wait for the model's)
        # through the depths' blocks' backward, in the compute dtype (autocast's one cast of
        # it takes them) or, sharded, its fp32 shard; and on a stage with the model's own
        # embedding, the embedding's (fp32: autocast leaves lookups alone) through the model's
        # blocks'.
        g = layout.gtp_remat_size
        held = head_weights // g * FP32 if sharded else head_weights * e
        blocks_phase = max(blocks_phase + (head_weights // g * FP32 if first else 0),
                           depth_phase(m, k, e, options, depth_weights[1] * e if sharded
                                       else 0, depth_weights[0] * e if e != FP32 and
                                       not sharded else 0) + held)
    return StepMemory(kept, backward, rebuilt, copies, logits, max(block, head), messages,
                      max(logits, head), blocks_phase)


def chunk_phases(m: ModelConfig, layout: Layout, options: EngineOptions, chunk: range,
                 weights: list[int], rebuilt_of: dict[BlockParts, int]) -> list[tuple[int, int]]:
    """Each block's backward in a model chunk (`chunk`: its blocks; weights: their 2-D weights
    as gathered; rebuilt_of: each kind's rebuilt activations under full recompute) beside what
    the chunk keeps, and of it the gathered weights and gradient messages (0 unsharded)."""
    k, e, comm = Tokens.of(layout), compute_bytes(options.precision), options.cp_comm_type
    sharded = layout.gtp_remat_size > 1
    selective = options.recompute_granularity is RecomputeGranularity.selective
    split = options.pipeline_schedule in SPLIT_BACKWARD
    # (the search asks this of thousands of layouts: each kind's terms are counted once)
    parts = [block_parts(m, 0)] * len(chunk) if blocks_alike(m) \
        else [block_parts(m, i) for i in chunk]
    windows = [m.window_of(i) for i in chunk]
    kept_of: dict = {}
    for p, kind in enumerate(parts):
        key = (options.recomputes(p), kind, windows[p])
        if key not in kept_of:
            kept_of[key] = block_activation_bytes(m, k, e, key[0], comm, kind, windows[p])
    freed = [kept_of[options.recomputes(p), kind, windows[p]] for p, kind in enumerate(parts)]
    # A block's backward runs after the chunk's later blocks' have freed what they kept (and
    # under bf16 without weight sharding their weights' casts, unless rebuilt): a hybrid's
    # linear block before a full-attention one peaks without the latter's activations.
    casts = [weights[p] * e if e != FP32 and not sharded and options.lora is None and
             options.recomputes(p) is not RecomputeGranularity.full else 0
             for p in range(len(parts))]
    # Under a split backward (I) their W holds their linears' inputs and output gradients
    # meanwhile: under full recompute, rebuilt inputs, more than the block input they free.
    waits = [weight_grad_bytes(m, layout, options, range(i, i + 1), False)
             for i in chunk] if options.pipeline_schedule in SPLIT_BACKWARD else [0] * len(parts)
    later = [0] * len(parts)  # what the blocks after each free (a suffix sum)
    for p in reversed(range(len(parts) - 1)):
        later[p] = later[p + 1] + freed[p + 1] + casts[p + 1] - waits[p + 1]
    out, seen = [], {}
    # the gradient entering a chunk before the model's last arrives as a message (counted
    # with the stage's messages), its last block's
    received = bool(chunk) and chunk[-1] != m.num_layers - 1
    for p, kind in enumerate(parts):
        # what the block's phase reads: its kind and recompute, its weights, the block before
        # it's and the few after it's (bundle_bytes); alike blocks are counted once
        ahead = slice(p + 1, p + 1 + REDUCES_IN_FLIGHT)
        message_in = received and p == len(parts) - 1
        key = (kind, options.recomputes(p), weights[p], weights[p - 1] if p else None,
               tuple(weights[ahead]), message_in)
        if key in seen:
            phase, gathered = seen[key]
            out.append((phase - later[p], gathered))
            continue
        gathered = bundle_bytes(layout, options, e, weights, p, split) if sharded else 0
        # bundle_bytes' gradient message (a split backward's W makes it, not I)
        message = weights[p] * FP32 if sharded and not split else 0
        if options.recomputes(p) is RecomputeGranularity.full:
            # a block rebuilt under bf16 without weight sharding casts its weights again,
            # kept through its backward (and the rebuilt forward's own moment: a MoE block's
            # exchange over ETP)
            copies = weights[p] * e if e != FP32 and not sharded else 0
            # (and its attention's forward, rebuilt)
            phase = max(block_backward_bytes(kind, m, k, e, False, gathered, message, comm,
                                             split, message_in),
                        kind.mlp.rebuild_bytes(m, k, e) + gathered,
                        block_forward_bytes(kind, m, k, e, None, comm) + gathered) \
                + rebuilt_of[kind] + copies
        else:  # its backward, or its attention's forward (the chunk's later blocks not run)
            recompute = options.recomputes(p)
            phase = max(block_backward_bytes(kind, m, k, e, selective, gathered, message, comm,
                                             split, message_in),
                        block_forward_bytes(kind, m, k, e, recompute, comm) + gathered)
        seen[key] = phase, gathered
        out.append((phase - later[p], gathered))
    return out


def bundle_bytes(layout: Layout, options: EngineOptions, e: int, weights: list[int], p: int,
                 split: bool = False) -> int:
    """Under weight sharding, what block `p` of a chunk holds of gathered weights and gradient
    messages in its backward (weights: each block's gathered 2-D weights, in forward order):
    its weights, and with overlap_param_gather the block before
    it's (its backward prefetches them, and holds the gather's input, this rank's shards,
    until it is waited on), all in the compute dtype; the message its gradients
    are added into (fp32); with overlap_grad_reduce the packed gradients of up to
    REDUCES_IN_FLIGHT blocks after it (done first) and their outputs (what those blocks kept
    and freed, chunk_phases takes off). Block by block: a dense block among a mixture of
    experts' gathers more than they do. In a split
    backward's I (`split`) its weights only: W forms the gradients and their messages."""
    g = layout.gtp_remat_size
    previous = weights[p - 1] if options.overlap_param_gather and p > 0 else 0
    # the prefetch's input, this rank's shards packed, is held until the gather is waited on
    held = (weights[p] + previous + previous // g) * e + (0 if split else weights[p] * FP32)
    if options.overlap_grad_reduce and not split:
        reduce_bytes = 2 if options.grad_reduce_in_bf16 else FP32
        done = range(p + 1, min(p + 1 + REDUCES_IN_FLIGHT, len(weights)))
        held += sum((weights[j] + weights[j] // g) * reduce_bytes for j in done)
    return held


def depth_phase(m: ModelConfig, k: Tokens, e: int, options: EngineOptions, gathered: int,
                copies: int = 0) -> int:
    """The last multi-token prediction depth's block's backward, beside all that is kept but
    that depth's norm, head input and softmax (freed by then): its MLP's backward and, under
    full recompute, its rebuilt activations (beyond the input it keeps); `gathered`: the
    weight its backward gathers (its linears are gathered one at a time, not bundled);
    `copies`: autocast's copies of its weights, made again when it is rebuilt."""
    parts = block_parts(m, m.num_layers - 1)
    comm = options.cp_comm_type
    if options.recompute_granularity is RecomputeGranularity.full:
        rebuilt = mtp_block_bytes(m, k, e, None, comm) - k.Tr * m.hidden_size * e + copies
        backward = max(parts.mlp.backward_bytes(m, k, e, False), parts.mlp.rebuild_bytes(m, k, e))
    else:
        selective = options.recompute_granularity is RecomputeGranularity.selective
        rebuilt, backward = 0, parts.mlp.backward_bytes(m, k, e, selective)
    # The gradient entering the block is its stream's, in the compute dtype (the MLP's term
    # counts fp32). Every loss's backward runs before the heads' (the losses' nodes came last
    # in the forward): the model's and the other depths' softmax are gone, the gradients of
    # their logits, in the compute dtype, wait for their heads.
    entering = k.Tr * m.hidden_size * (FP32 - e)
    logits = mtp.depths(m) * k.T * (m.padded_vocab_size // k.t) * (FP32 - e)
    return backward - entering + rebuilt + gathered - mtp.after_block_bytes(m, k, e) - logits
