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

Under peft=lora (EngineOptions.lora) a frozen weight keeps no input for its gradient, the
adapters keep their r-wide outputs, and the first block, fed by the frozen embedding, keeps
less: trainer.parts.lora.block_kept_bytes. DPO's reference pass runs without gradients before
the policy's micro-batches and adds nothing to their peak.

With multi-token prediction (model.mtp_num_layers = D) the last stage also keeps, per depth,
what trainer.parts.mtp lists: enorm's and hnorm's tensors (4*Tr*h + 2*Tr fp32, hnorm's input
Tr*h fp32 more unless fp32 without SP), eh_proj's input Tr*2h*e (and under bf16 its whole
weight's copy 2*h*h*e), a block of the last block's kind recomputed as the model's (its stream
in the compute dtype: its norms keep e, not fp32; full recompute keeps Tr*h*e), its norm
(2*Tr*h + Tr)*e, the head's input T*h*e and the loss's softmax T*V/t fp32. Counted with the
head's, they are freed before the model's blocks' backward.

A step's transients peak at one of two moments of a backward, never both: the loss's (all that
is kept, and the logits' gradients) or a block's (the head's activations freed; the gradient
entering the block, Tr*h fp32, its MLP's two products 2*T*f/t*e, a rebuilt block under full
recompute, its gathered weights). With multi-token prediction the loss's moment is the last
depth's (its loss's backward runs first, beside all that is kept), and a depth's block's
backward is a third moment: the model's blocks and head still kept, the depth's norm, head
input and softmax freed. tests/multirank/test_step_memory.py counts them with the allocator
itself.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from parallel.layout import Layout
from parallel.layout.axes.context import window_exchange
from trainer.config import CPCommType, ModelConfig, RecomputeGranularity
from trainer.parts import BlockParts, block_parts, mtp
from trainer.parts.lora import Adapters, head_kept_bytes, local_adapter_elements, uncast_elements
from trainer.parts.lora import block_kept_bytes as lora_block_bytes
from trainer.parts.norm import block_norms
from trainer.parts.tokens import FP32, Tokens, compute_bytes
from trainer.plan.axis_costs.gtp_remat import REDUCES_IN_FLIGHT, gathered_bytes
from trainer.plan.options import EngineOptions


def block_activation_bytes(m: ModelConfig, k: Tokens, e: int,
                           recompute: RecomputeGranularity | None,
                           cp_comm_type: CPCommType = CPCommType.p2p,
                           parts: BlockParts | None = None, window: int | None = None,
                           lora: Adapters | None = None, grad_in: bool = True) -> int:
    """What one block keeps for its backward: its parts' (trainer.parts; parts: the block's,
    None for block 0's), and what its sliding window's exchange receives (window: the
    block's). lora: peft=lora's adapters, the base frozen (grad_in: whether the block's input
    carries a gradient; not so in the model's first block)."""
    if recompute is RecomputeGranularity.full:
        return k.Tr * m.hidden_size * FP32
    parts = parts or block_parts(m, 0)
    if lora is not None:
        kept = lora_block_bytes(m, parts, k, e, recompute, cp_comm_type, lora, grad_in)
    else:
        kept = sum(part.kept_bytes(m, k, e, recompute, cp_comm_type) for part in parts)
    return kept + window_bytes(m, k, e, recompute, cp_comm_type, window)


def window_bytes(m: ModelConfig, k: Tokens, e: int, recompute: RecomputeGranularity | None,
                 cp_comm_type: CPCommType, window: int | None) -> int:
    """A windowed block under CP by p2p, where the window leaves chunks unreached: the K/V
    chunks its exchange received, kept for backward beside the rank's own (selective
    recompute receives them again in backward instead; parallel.context.window). Each is
    K = T*c/t*e (one chunk's k and v); counted for the position that receives the most."""
    if window is None or not k.cp or cp_comm_type is not CPCommType.p2p or recompute:
        return 0
    cp = k.S // k.s
    exchange = window_exchange(cp, k.s // 2, window)
    if exchange is None:
        return 0
    received = max(r for r, _ in exchange)
    return received * k.T * m.kv_size // k.t * e


def blocks_alike(m: ModelConfig) -> bool:
    """Whether every block keeps the same: one kind of block (no experts, no hybrid), one
    window."""
    return m.num_moe_experts is None and m.experimental_attention_variant is None and (
        m.window_size is None or m.window_attn_skip_freq is None)


def head_activation_bytes(m: ModelConfig, k: Tokens, e: int,
                          recompute: RecomputeGranularity | None = None,
                          cp_comm_type: CPCommType = CPCommType.p2p,
                          lora: Adapters | None = None) -> int:
    """The final norm, the head's input and the loss's saved softmax; and multi-token
    prediction's depths, after the head (their blocks recompute as `recompute` says). Under
    peft=lora (`lora`) the frozen final norm and head keep less (head_kept_bytes)."""
    return (2 * k.Tr * m.hidden_size * FP32 + k.T * m.hidden_size * e + loss_bytes(m, k)
            + mtp.depths(m) * mtp.kept_bytes(m, k, e, mtp_block_bytes(m, k, e, recompute,
                                                                      cp_comm_type))
            - (head_kept_bytes(m, k, e) if lora else 0))


def mtp_block_bytes(m: ModelConfig, k: Tokens, e: int,
                    recompute: RecomputeGranularity | None,
                    cp_comm_type: CPCommType = CPCommType.p2p) -> int:
    """What a multi-token prediction depth's block (the last block's kind) keeps. Its residual
    stream is eh_proj's output, in the compute dtype, so its norms keep that dtype where the
    model's keep fp32 (the norm part's fp32 terms scaled by e / 4), and under full recompute
    its input is Tr*h*e."""
    if recompute is RecomputeGranularity.full:
        return k.Tr * m.hidden_size * e
    parts = block_parts(m, m.num_layers - 1)
    return (parts.norm.kept_bytes(m, k, e, recompute, cp_comm_type) * e // FP32
            + sum(part.kept_bytes(m, k, e, recompute, cp_comm_type)
                  for part in (parts.attention, parts.mlp)))


def block_backward_bytes(parts: BlockParts, m: ModelConfig, k: Tokens, e: int,
                         selective: bool, gathered: int = 0, message: int = 0,
                         cp_comm_type: CPCommType = CPCommType.p2p) -> int:
    """The most a block's backward forms beside what it keeps: its MLP's moments, its
    attention's (Gated DeltaNet's rule: trainer.parts.gdn; softmax attention's never outgrow
    the MLP's), or a zero-centred norm's (fp32 whatever the compute dtype: trainer.parts.norm),
    the largest;
    with `gathered`, what weight sharding holds then, of which the fp32 gradient message
    (`message`) is not made yet at a norm's moment (no weight's gradient is)."""
    # the attention's backward runs after the MLP's and its norm's: their activations are gone
    recompute = RecomputeGranularity.selective if selective else None
    mlp_side = mlp_side_bytes(parts, m, k, e, recompute, cp_comm_type)
    attention = parts.attention.backward_bytes(m, k, e, selective, cp_comm_type)
    return max(parts.mlp.backward_bytes(m, k, e, selective) + gathered,
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
    k, e, lora = Tokens.of(layout), compute_bytes(options.precision), options.lora
    if blocks_alike(m) and (lora is None or 0 not in chunk):
        return sum(count * block_activation_bytes(m, k, e, recompute, options.cp_comm_type,
                                                  window=m.window_size, lora=lora)
                   for recompute, count in options.chunk_recompute(len(chunk)).items() if count)
    # under peft=lora the model's first block is fed by the frozen embedding: no gradient
    kinds = Counter((options.recomputes(p), block_parts(m, i), m.window_of(i), i > 0)
                    for p, i in enumerate(chunk))
    return sum(count * block_activation_bytes(m, k, e, recompute, options.cp_comm_type, parts,
                                              window, lora, grad_in)
               for (recompute, parts, window, grad_in), count in kinds.items())


def stage_chunk_bytes(m: ModelConfig, layout: Layout, options: EngineOptions,
                      chunks: list[range], last: bool) -> list[int]:
    """What one micro-batch keeps in each of a stage's chunks (`chunks`: its blocks by virtual
    chunk; `last`: it holds the head, in its last chunk)."""
    alike: dict[int, int] = {}  # a dense model's chunks are known by their length
    per_chunk = []
    for chunk in chunks:
        if blocks_alike(m) and len(chunk) in alike:
            per_chunk.append(alike[len(chunk)])
            continue
        per_chunk.append(chunk_activation_bytes(m, layout, options, chunk))
        alike[len(chunk)] = per_chunk[-1]
    if last:
        per_chunk[-1] += head_activation_bytes(m, Tokens.of(layout),
                                               compute_bytes(options.precision),
                                               options.recompute_granularity,
                                               options.cp_comm_type, options.lora)
    return per_chunk


def step_memory(m: ModelConfig, layout: Layout, options: EngineOptions, chunks: list[range],
                block_weights: int, head_weights: int, kept: int, last: bool = True,
                first: bool = True, messages: int = 0,
                depth_weights: tuple[int, int] = (0, 0),
                kind_weights: dict[BlockParts, int] | None = None) -> StepMemory:
    """For a pipeline stage's blocks (`chunks`: its blocks by model chunk). block_weights:
    TP-local elements of one block's 2-D weights as gathered over GTP_remat (padding
    included); head_weights: the stage's head's or embedding's, the larger (0 for neither);
    kept: its activations in flight (trainer.plan.axis_costs.pipeline.stage_activation_bytes); last:
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
    autocast = 0
    if e != FP32 and not sharded:  # a fully recomputed block keeps no copy of its weights
        copied = [i for chunk in chunks for p, i in enumerate(chunk)
                  if options.recomputes(p) is not RecomputeGranularity.full]
        kept_copies = len(copied)
        if last and options.recompute_granularity is not RecomputeGranularity.full:
            autocast += mtp.depths(m) * depth_weights[0] * e  # the depths' blocks' copies
        # each kept block's own weights (a hybrid's linear and full blocks differ)
        autocast += (sum((kind_weights or {}).get(block_parts(m, i), block_weights)
                         for i in copied) + head_weights) * e
        if lora is not None and lora.base_bf16:  # the frozen matrices are bf16 already:
            # the adapters' casts (and a tied head's, the fp32 embedding's) only
            autocast = int(kept_copies * local_adapter_elements(m, lora, k.t)
                           + (head_weights if m.tie_word_embeddings else 0)) * e
        elif lora is not None and first and \
                options.recomputes(0) is not RecomputeGranularity.full:
            # the first block's input carries no gradient: some casts are not kept
            autocast -= uncast_elements(m, lora, k.t) * e
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
        block, head = gathered_bytes(layout, options, e, sizes, block_weights, head_weights,
                                     freed, first, last)
    else:  # weights are used in place; the head's gradient is formed before it is added
        block, head = 0, head_weights * FP32
    # freed when the model's blocks' backward starts (the depths' included)
    head_kept = head_activation_bytes(m, k, e, options.recompute_granularity, comm, lora) \
        if last else 0
    # A block's backward beside what it keeps, block by block (its kind's terms, and under
    # weight sharding its neighbours' weights); a fully recomputed block (the first
    # recompute_num_layers of a chunk) is rebuilt after the chunk's later blocks have run their
    # backward and freed their activations.
    selective = options.recompute_granularity is RecomputeGranularity.selective
    backward = max(block_backward_bytes(parts, m, k, e, selective,
                                        cp_comm_type=options.cp_comm_type) for parts in kinds)
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
    block = max(bundles) if sharded and bundles else block
    blocks_phase = max(phases) - head_kept
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
    return StepMemory(kept, backward, rebuilt, autocast, logits, max(block, head), messages,
                      max(logits, head), blocks_phase)


def chunk_phases(m: ModelConfig, layout: Layout, options: EngineOptions, chunk: range,
                 weights: list[int], rebuilt_of: dict[BlockParts, int]) -> list[tuple[int, int]]:
    """Each block's backward in a model chunk (`chunk`: its blocks; weights: their 2-D weights
    as gathered; rebuilt_of: each kind's rebuilt activations under full recompute) beside what
    the chunk keeps, and of it the gathered weights and gradient messages (0 unsharded)."""
    k, e, comm = Tokens.of(layout), compute_bytes(options.precision), options.cp_comm_type
    sharded = layout.gtp_remat_size > 1
    selective = options.recompute_granularity is RecomputeGranularity.selective
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
    later = [sum(freed[p + 1:]) + sum(casts[p + 1:]) for p in range(len(parts))]
    out, seen = [], {}
    for p, kind in enumerate(parts):
        # what the block's phase reads: its kind and recompute, its weights, the block before
        # it's and the few after it's (bundle_bytes); alike blocks are counted once
        ahead = slice(p + 1, p + 1 + REDUCES_IN_FLIGHT)
        key = (kind, options.recomputes(p), weights[p], weights[p - 1] if p else None,
               tuple(weights[ahead]), tuple(freed[ahead]))
        if key in seen:
            phase, gathered = seen[key]
            out.append((phase - later[p], gathered))
            continue
        gathered = bundle_bytes(layout, options, e, weights, freed, p) if sharded else 0
        message = weights[p] * FP32 if sharded else 0  # bundle_bytes' gradient message
        if options.recomputes(p) is RecomputeGranularity.full:
            # a block rebuilt under bf16 without weight sharding casts its weights again,
            # kept through its backward (and the rebuilt forward's own moment: a MoE block's
            # exchange over ETP)
            copies = weights[p] * e if e != FP32 and not sharded else 0
            # (and its attention's forward, rebuilt)
            phase = max(block_backward_bytes(kind, m, k, e, False, gathered, message, comm),
                        kind.mlp.rebuild_bytes(m, k, e) + gathered,
                        block_forward_bytes(kind, m, k, e, None, comm) + gathered) \
                + rebuilt_of[kind] + copies
        else:  # its backward, or its attention's forward (the chunk's later blocks not run)
            recompute = options.recomputes(p)
            phase = max(block_backward_bytes(kind, m, k, e, selective, gathered, message, comm),
                        block_forward_bytes(kind, m, k, e, recompute, comm) + gathered)
        seen[key] = phase, gathered
        out.append((phase - later[p], gathered))
    return out


def bundle_bytes(layout: Layout, options: EngineOptions, e: int, weights: list[int],
                 freed: list[int], p: int) -> int:
    """Under weight sharding, what block `p` of a chunk holds of gathered weights and gradient
    messages in its backward (weights, freed: each block's gathered 2-D weights and what it
    keeps, in forward order): its weights, and with overlap_param_gather the block before
    it's (its backward prefetches them), both in the compute dtype; the message its gradients
    are added into (fp32); with overlap_grad_reduce the packed gradients of up to
    REDUCES_IN_FLIGHT blocks after it (done first) and their outputs, where they outweigh the
    activations those blocks freed. trainer.plan.axis_costs.gtp_remat.gathered_bytes, block by
    block: a dense block among a mixture of experts' gathers more than they do."""
    previous = weights[p - 1] if options.overlap_param_gather and p > 0 else 0
    held = (weights[p] + previous) * e + weights[p] * FP32
    if options.overlap_grad_reduce:
        reduce_bytes = 2 if options.grad_reduce_in_bf16 else FP32
        done = range(p + 1, min(p + 1 + REDUCES_IN_FLIGHT, len(weights)))
        g = layout.gtp_remat_size
        held += max(0, sum((weights[j] + weights[j] // g) * reduce_bytes - freed[j]
                           for j in done))
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
