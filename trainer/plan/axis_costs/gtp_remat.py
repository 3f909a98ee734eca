"""GTP_remat's terms: the weights a rank gathers for use and their gradients (memory), the
gathers and reduce-scatters of a block's weights (time)."""
from __future__ import annotations

from parallel.layout import Layout
from trainer.plan.hardware import Hardware
from trainer.plan.options import EngineOptions
from trainer.plan.tokens import FP32

# parallel.bundle.GradReduceQueue's depth: block gradient reduce-scatters in flight at once
# with parallel.overlap_grad_reduce (tests/unit/test_memory.py holds them equal).
REDUCES_IN_FLIGHT = 2


def gathered_bytes(layout: Layout, options: EngineOptions, e: int, chunks: list[int],
                   block_weights: int, head_weights: int, freed: int,
                   first: bool, last: bool) -> tuple[int, int]:
    """(a block's, the head's or embedding's) gathered weights and gradients alive at once.
    A gathered weight is the TP-local full weight; a block's weights (two blocks' with overlap:
    the next one is already gathering) live through its backward beside the message its
    gradients are added into (parallel.bundle: master dtype, one block's weights) before one
    reduce-scatter returns the shards'; the weight gradient being formed is a term of the
    block's backward (trainer.plan.activations.backward_bytes). The head's (or embedding's)
    weight is gathered with its gradient formed whole, under bf16 first narrow, then widened.
    chunks: the stage's blocks per model chunk; freed: what one block keeps for its backward
    (gone once its backward is done)."""
    narrow = e if e != FP32 else 0
    alive = 2 if options.overlap_param_gather else 1
    block = alive * block_weights * e + block_weights * FP32
    head = head_weights * (e + narrow + FP32)
    if options.overlap_grad_reduce:
        # parallel.bundle.GradReduceQueue: in a chunk's backward the packed gradients of up to
        # REDUCES_IN_FLIGHT blocks already done, and their reduce-scatters' outputs (1/G of
        # each), stay alive beside the next block's backward; those blocks' kept activations
        # are gone by then. The runner ends the queue with each pass, so the head (first in its
        # chunk's backward) sees none; a first stage's embedding (last) sees up to the depth
        # (with the head on the stage too, the head's larger transient is the one the plan
        # takes for both).
        reduce_bytes = 2 if options.grad_reduce_in_bf16 else FP32
        queued = (block_weights + block_weights // layout.gtp_remat_size) * reduce_bytes
        before = min(REDUCES_IN_FLIGHT, max(chunks) - 1)
        block += max(0, before * (queued - freed))
        if first and not last and head_weights:
            done = chunks[0]
            head += max(0, min(REDUCES_IN_FLIGHT, done) * queued - done * freed)
    return block, head


def gather_seconds(layout: Layout, options: EngineOptions, hw: Hardware, weights: float,
                   e: int) -> tuple[float, float]:
    """(the all-gather of `weights` TP-local elements, the reduce-scatter of their gradients)
    over the gtp_remat group; 0 without weight sharding."""
    g = layout.gtp_remat_size
    if g == 1:
        return 0.0, 0.0
    link = hw.link(layout, "gtp_remat")
    grad_bytes = 2 if options.grad_reduce_in_bf16 else FP32
    return link.ring(g, weights * e), link.ring(g, weights * grad_bytes)
