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
autocast also keeps a bf16 copy of every local weight, one set per micro-batch in flight
(trainer.plan.moments.autocast_copy_bytes).

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

A zero-bubble schedule's split backward (parallel.weight_grads) keeps, from a pair's I to its
W, every TP linear's input and output gradient in the compute dtype: per block
sum over its linears of T*(in + out)*e (TP-local widths; a column linear's input gathered
over TP with SP, a row linear's output before its reduction), and the head's T*(h + V/t)*e
on the last chunk: weight_grad_bytes. The experts' and the whole (not TP-split) linears form
their weight gradients in I, as do norms and the embedding; under peft=lora nothing waits.

What a step forms beyond them, and when: trainer.plan.moments.
"""
from __future__ import annotations

from collections import Counter

from parallel.layout import Layout
from parallel.layout.axes.context import window_exchange
from parallel.layout.pipeline_schedules import SPLIT_BACKWARD
from trainer.config import CPCommType, ModelConfig, RecomputeGranularity
from trainer.parts import BlockParts, block_parts, mtp
from trainer.parts.lora import Adapters, head_kept_bytes
from trainer.parts.lora import block_kept_bytes as lora_block_bytes
from trainer.parts.tokens import FP32, Tokens, compute_bytes
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


def loss_bytes(m: ModelConfig, k: Tokens) -> int:
    """One [T, V/t] fp32 buffer: the softmax (or log-softmax) of the local logits."""
    return k.T * (m.padded_vocab_size // k.t) * FP32


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


def weight_grad_bytes(m: ModelConfig, layout: Layout, options: EngineOptions, chunk: range,
                      head: bool) -> int:
    """What one micro-batch's pair holds between its I and its W (see the docstring above):
    the TP linears' inputs and output gradients of its blocks, and the head's (`head`)."""
    if options.lora is not None:
        return 0
    k, e = Tokens.of(layout), compute_bytes(options.precision)
    widths = 0
    for block in chunk:
        for part in block_parts(m, block):
            shapes = part.shapes(m)
            for module, style in part.tp_styles.items():
                widths += sum(layout.tp_local_shape(*shapes[f"{module}.weight"],
                                                    style == "column"))
    if head:
        widths += m.hidden_size + m.padded_vocab_size // k.t
    return k.T * widths * e


def stage_weight_grad_bytes(m: ModelConfig, layout: Layout, options: EngineOptions,
                            chunks: list[range], last: bool) -> list[int] | None:
    """weight_grad_bytes of each of a stage's chunks (`last`: the head in its last), where
    the schedule splits the backward; None where it does not."""
    if options.pipeline_schedule not in SPLIT_BACKWARD:
        return None
    return [weight_grad_bytes(m, layout, options, chunk, last and i == len(chunks) - 1)
            for i, chunk in enumerate(chunks)]


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
