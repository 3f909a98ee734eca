"""GTP_remat's cost entry: the weights a rank gathers for use and their gradients (memory), the
gathers and reduce-scatters of a block's, the head's and the embedding's weights, less what
overlap hides (time), and the search's weight and sequence shards."""
from __future__ import annotations

from parallel.layout import Layout
from parallel.layout.axes.gtp_remat import GTP_REMAT, SEQUENCE_SHARDS, WEIGHT_SHARDS
from trainer.config import RecomputeGranularity
from trainer.parts.tokens import FP32
from trainer.plan.axis_costs.entry import AxisCosts, Micro, Offer, divisors
from trainer.plan.hardware import Hardware
from trainer.plan.options import EngineOptions

# parallel.bundle.GradReduceQueue's depth: block gradient reduce-scatters in flight at once
# with parallel.overlap_grad_reduce (tests/unit/test_memory.py holds them equal).
REDUCES_IN_FLIGHT = 2


def head_gathered_bytes(layout: Layout, options: EngineOptions, e: int, chunks: list[int],
                        block_weights: int, head_weights: int, freed: int,
                        first: bool, last: bool) -> int:
    """The head's (or embedding's) gathered weight and its gradient alive at once: the TP-local
    full weight, gathered with its gradient formed whole (under bf16 first narrow, then
    widened). A block's are counted block by block (trainer.plan.moments.bundle_bytes).
    chunks: the stage's blocks per model chunk; block_weights: one block's gathered 2-D
    weights; freed: what one block keeps for its backward (gone once its backward is done)."""
    narrow = e if e != FP32 else 0
    head = head_weights * (e + narrow + FP32)
    if options.overlap_grad_reduce and first and not last and head_weights:
        # parallel.bundle.GradReduceQueue: the packed gradients of up to REDUCES_IN_FLIGHT
        # blocks already done, and their reduce-scatters' outputs (1/G of each), stay alive
        # beside the next backward; those blocks' kept activations are gone by then. The runner
        # ends the queue with each pass, so the head (first in its chunk's backward) sees none;
        # a first stage's embedding (last) sees up to the depth (with the head on the stage
        # too, the head's larger transient is the one the plan takes for both).
        reduce_bytes = 2 if options.grad_reduce_in_bf16 else FP32
        queued = (block_weights + block_weights // layout.gtp_remat_size) * reduce_bytes
        done = chunks[0]
        head += max(0, min(REDUCES_IN_FLIGHT, done) * queued - done * freed)
    return head


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


def _messages(k: Micro) -> tuple[float, float, bool, bool]:
    """(a block's gather, its gradients' reduce-scatter, whether each overlaps): a full weight
    is W/t elements."""
    gather, scatter = gather_seconds(k.layout, k.options, k.hw,
                                     k.block_weights / k.layout.tp_size, k.e)
    scatter *= k.grad_weights / k.block_weights  # peft=lora: the adapters' gradients alone
    return (gather, scatter, k.options.overlap_param_gather and k.overlaps,
            k.options.overlap_grad_reduce and k.overlaps)


def block_s(k: Micro, recompute, fwd: float, bwd: float) -> float:
    """The next block's weights gather under this block's forward; in backward the gathers
    and the gradient reduce-scatters run under its backward, where overlapped."""
    gather, scatter, overlap_gather, overlap_reduce = _messages(k)
    regathers = 2 if recompute is RecomputeGranularity.full else 1
    exposed = max(0.0, gather - fwd) if overlap_gather else gather
    hidden = (regathers * gather if overlap_gather else 0.0) + (
        scatter if overlap_reduce else 0.0)
    shown = regathers * gather + scatter - hidden
    exposed += max(0.0, hidden - bwd) + shown
    return exposed


def head_s(k: Micro) -> float:
    """The head: gathered for forward and again for backward, hidden behind its compute."""
    gather, scatter, overlap_gather, _ = _messages(k)
    m = k.model
    scatter = scatter if k.trained_weights is None else 0.0  # a frozen head's: none
    head = (2 * gather + scatter) * m.padded_vocab_size * m.hidden_size / k.block_weights
    return max(0.0, head - 3 * k.head_s) if overlap_gather else head


def embedding_s(k: Micro) -> float:
    """The embedding: gathered once, its gradient reduce-scattered."""
    gather, scatter, _, _ = _messages(k)
    m = k.model
    scatter = scatter if k.trained_weights is None else 0.0  # a frozen embedding's: none
    return (gather + scatter) * m.padded_vocab_size * m.hidden_size / k.block_weights


def degrees(offer: Offer):
    """Each GTP_remat size G that divides the ranks TP leaves, each count of sequence shards
    dividing G (the rest of G are batch shards)."""
    tp = offer.chosen["parallel.tensor_model_parallel_size"]
    sp_degree = tp if offer.chosen["parallel.sequence_parallel"] else 1
    for g in divisors(offer.problem.world_size // tp):
        if not offer.allows(WEIGHT_SHARDS.config_key, tp * g, tp):
            continue
        for ns in divisors(g):
            if offer.allows(SEQUENCE_SHARDS.config_key, ns * sp_degree, sp_degree):
                yield {WEIGHT_SHARDS.config_key: tp * g,
                       SEQUENCE_SHARDS.config_key: ns * sp_degree}


COSTS = AxisCosts(
    GTP_REMAT.name, kind="weight gathers", block_s=block_s, head_s=head_s,
    embedding_s=embedding_s, degrees=degrees,
    labels=lambda lay, values: ((1, f"WS={lay.tensor_parallel_num_weight_shards}"),
                                (2, f"SS={lay.tensor_parallel_num_sequence_shards}")),
    inputs=lambda lay: (f"weight_shards={lay.tensor_parallel_num_weight_shards} "
                        f"sequence_shards={lay.tensor_parallel_num_sequence_shards}"))
