"""Context parallel's cost entry: the heads a2a splits, the K/V exchange of a block's attention
(time), and the search's CP and cp_comm_type. (What the attention keeps under each cp_comm_type
is the attention part's: trainer.parts.attention.)"""
from __future__ import annotations

from parallel.layout import Layout
from parallel.layout.axes.context import CONTEXT, window_exchange
from trainer.config import CPCommType, ModelConfig, Precision
from trainer.parts import block_parts
from trainer.parts.gdn import GATED_DELTA_NET
from trainer.parts.tokens import FP32
from trainer.plan.axis_costs.entry import AxisCosts, Micro, Offer, divisors
from trainer.plan.hardware import Hardware
from trainer.plan.options import EngineOptions


def check_model(model: ModelConfig, layout: Layout, options: EngineOptions) -> None:
    check_comm_type(model, layout, options.cp_comm_type)
    check_linear(model, layout, options.cp_comm_type)


def check_linear(model: ModelConfig, layout: Layout, cp_comm_type: CPCommType) -> None:
    """A hybrid's linear blocks under runtime CP (parallel.context.linear): a2a gives each
    context rank whole key heads; p2p passes a chunk's last width-1 inputs to the next chunk,
    which must hold them."""
    cp, tp = layout.runtime_context_parallel_size, layout.tp_size
    if cp == 1 or not any(model.is_linear_block(i) for i in range(model.num_layers)):
        return
    local = model.linear_num_key_heads // tp
    if cp_comm_type is CPCommType.a2a and local % cp:
        raise ValueError(
            f"parallel.cp_comm_type=a2a needs the linear blocks' key heads per TP rank (model."
            f"linear_num_key_heads={model.linear_num_key_heads} / parallel."
            f"tensor_model_parallel_size={tp} = {local}) divisible by runtime CP = {cp} "
            f"(parallel.context_parallel_size x sequence shards). Fix: use parallel."
            f"cp_comm_type=p2p, or a runtime CP that divides {local}.")
    if cp_comm_type is not CPCommType.p2p or not layout.seq_length:
        return
    chunk = layout.context_local_length // 2  # a rank keeps two zigzag chunks
    if model.linear_conv_kernel_dim - 1 > chunk:
        raise ValueError(
            f"model.linear_conv_kernel_dim={model.linear_conv_kernel_dim} reaches "
            f"{model.linear_conv_kernel_dim - 1} tokens back, past a context chunk of {chunk} "
            f"(train.seq_length={layout.seq_length} / (2 x runtime CP {cp})), which p2p passes "
            f"on whole. Fix: a longer train.seq_length, a smaller runtime CP, or parallel."
            f"cp_comm_type=a2a.")


def check_comm_type(model: ModelConfig, layout: Layout, cp_comm_type: CPCommType) -> None:
    """a2a gives each context rank whole heads: the TP-local heads must split over runtime CP."""
    cp, tp = layout.runtime_context_parallel_size, layout.tp_size
    if cp_comm_type is not CPCommType.a2a or cp == 1:
        return
    for key, heads in (("num_heads", model.num_heads), ("num_query_groups", model.query_groups)):
        local = heads // tp
        if local % cp:
            raise ValueError(
                f"parallel.cp_comm_type=a2a needs the {key} per TP rank (model.{key}={heads} / "
                f"parallel.tensor_model_parallel_size={tp} = {local}) divisible by runtime CP = "
                f"{cp} (parallel.context_parallel_size x sequence shards). Fix: use "
                f"parallel.cp_comm_type=p2p, or a runtime CP that divides {local}.")


def context_seconds(m: ModelConfig, layout: Layout, cp_comm_type: CPCommType, hw: Hardware,
                    T: int, e: int, attention_s: float, overlaps: bool) -> tuple[float, float]:
    """(forward, backward) exposed time of a block's K/V exchange over runtime CP C, averaged
    over the blocks (a sliding window's blocks exchange less):
    p2p sends K/V (2*T*c/t*e) C-1 hops forward, C-1 and their fp32 gradients C hops in
    backward, hidden behind the attention (attention_s forward, twice that backward) where
    ranks overlap; under a window that leaves chunks unreached, the chunks it reaches (each
    half the rank's K/V) in, those its peers reach out, and their fp32 gradients back
    (Layout's window_exchange: the busiest position); all_gather gathers K/V and
    reduce-scatters their gradients (in the compute dtype); a2a moves a rank's q, k, v and
    output between sequence and heads, both ways, (C-1)/C of each leaving it; neither is
    hidden. Widths as the attention part exchanges them (Part.exchanged_widths: multi-latent
    attention's v padded to q's); the bytes the context group sends
    (tests/multirank/test_context_parallel.py)."""
    if layout.runtime_context_parallel_size == 1:
        return 0.0, 0.0
    link = hw.link(layout, "context")
    linear = [m.is_linear_block(block) for block in range(m.num_layers)] or [False]
    full = linear.count(False)
    soft = (0.0, 0.0)
    if full:  # the softmax attention's blocks (a hybrid's linear ones below)
        soft = _softmax_seconds(m, layout, cp_comm_type, link, T, e, attention_s, overlaps)
    lin = linear_seconds(m, layout, cp_comm_type, hw, link, T, e) if full < len(linear) \
        else (0.0, 0.0)
    return tuple((full * soft[i] + (len(linear) - full) * lin[i]) / len(linear)
                 for i in (0, 1))


def _softmax_seconds(m: ModelConfig, layout: Layout, cp_comm_type: CPCommType, link, T: int,
                     e: int, attention_s: float, overlaps: bool) -> tuple[float, float]:
    c, t = layout.runtime_context_parallel_size, layout.tp_size
    attention = next(block_parts(m, i).attention for i in range(m.num_layers)
                     if not m.is_linear_block(i))
    q_size, kv_size = attention.exchanged_widths(m)  # as the part moves them
    kv = 2 * T * kv_size / t * e
    if cp_comm_type is CPCommType.p2p:
        hides = attention_s if overlaps else 0.0
        windows = [m.window_of(block) for block in range(m.num_layers)
                   if not m.is_linear_block(block)] or [None]
        times = {w: _p2p_seconds(layout, link, kv, e, w, hides) for w in set(windows)}
        return tuple(sum(times[w][i] for w in windows) / len(windows) for i in (0, 1))
    if cp_comm_type is CPCommType.all_gather:
        return link.ring(c, c * kv), link.ring(c, c * kv)
    moved = 2 * T * q_size / t * e + kv
    return link.all_to_all(c, moved), link.all_to_all(c, moved)


def linear_seconds(m: ModelConfig, layout: Layout, cp_comm_type: CPCommType, hw: Hardware,
                   link, T: int, e: int) -> tuple[float, float]:
    """(forward, backward) of a linear block's exchange over runtime CP C (parallel.context.
    linear), the rank's own work on its T tokens not included. p2p: the relay is a chain of
    2C chunks, so a rank waits for C-1 ranks' rule (its own chunks' worth each) forward and
    in backward (twice the work, and the chunk rebuilt: three times), and for the 2C-1
    messages of a state (hv/t x dk x dv fp32 a sample) and the convolution's last inputs.
    all_gather: the inputs q|k|v, g and beta gathered whole, their gradients reduce-scattered,
    and C times the rule's work (C-1 of it another rank's). a2a: the inputs and the output
    moved between sequence and heads, both ways."""
    c, t, b = layout.runtime_context_parallel_size, layout.tp_size, layout.micro_batch_size
    dk, dv = m.linear_key_head_dim, m.linear_value_head_dim
    hv = m.linear_num_value_heads // t
    channels = (2 * m.linear_key_size + m.linear_value_size) // t
    flops = hw.flops(Precision.bf16 if e != FP32 else Precision.fp32)
    rule_s = T * GATED_DELTA_NET.core_flops(m, layout.seq_length or T) / t / flops
    inputs = T * (channels * e + 2 * hv * FP32)  # q|k|v, g and beta of the rank's tokens
    if cp_comm_type is CPCommType.p2p:
        state = b * (hv * dk * dv * FP32 + (m.linear_conv_kernel_dim - 1) * channels * e)
        hops = (2 * c - 1) * link.send(state)
        return (c - 1) * rule_s + hops, 3 * (c - 1) * rule_s + hops
    if cp_comm_type is CPCommType.all_gather:
        gathered = link.ring(c, c * inputs)
        return gathered + (c - 1) * rule_s, gathered + 3 * (c - 1) * rule_s
    moved = inputs + T * hv * dv * FP32
    return link.all_to_all(c, moved), link.all_to_all(c, moved)


def _p2p_seconds(layout: Layout, link, kv: float, e: int, window: int | None,
                 hides: float) -> tuple[float, float]:
    """One block's p2p exchange, exposed: the ring's, or the window's (window.py)."""
    c = layout.runtime_context_parallel_size
    exchange = window_exchange(c, layout.context_local_length // 2, window) \
        if window is not None and layout.seq_length else None
    if exchange is None:
        fwd = (c - 1) * link.send(kv)
        bwd = (c - 1) * link.send(kv) + c * link.send(kv / e * FP32)
    else:  # a chunk's K/V is half the rank's
        fwd = max(link.send(sent * kv / 2) for _, sent in exchange)
        bwd = max(link.send(received * kv / 2 / e * FP32) for received, _ in exchange)
    return max(0.0, fwd - hides), max(0.0, bwd - 2 * hides)


def block_s(k: Micro, recompute, fwd: float, bwd: float) -> float:
    cp_fwd, cp_bwd = context_seconds(k.model, k.layout, k.options.cp_comm_type, k.hw, k.T, k.e,
                                     k.attention_s, k.overlaps)
    return cp_fwd + cp_bwd


CP_KEY, COMM_KEY = "parallel.context_parallel_size", "parallel.cp_comm_type"


def degrees(offer: Offer):
    """Each CP that divides the ranks TP x GTP_remat leave."""
    ws = offer.chosen["parallel.tensor_parallel_num_weight_shards"]
    for cp in divisors(offer.problem.world_size // ws):
        if offer.allows(CP_KEY, cp):
            yield {CP_KEY: cp}


def options(offer: Offer, layout: Layout):
    """Each cp_comm_type the model's heads allow (p2p alone without CP: it is unused)."""
    if COMM_KEY in offer.fixed:
        yield {"cp_comm_type": CPCommType(offer.fixed[COMM_KEY])}
        return
    if layout.runtime_context_parallel_size == 1:
        yield {"cp_comm_type": CPCommType.p2p}  # unused without CP; the default
        return
    for comm in CPCommType:
        try:
            check_comm_type(offer.problem.model, layout, comm)
            check_linear(offer.problem.model, layout, comm)
        except ValueError:
            offer.dropped["cp_comm_type=a2a needs the TP-local heads divisible by runtime "
                          "CP"] += 1
            continue
        yield {"cp_comm_type": comm}


COSTS = AxisCosts(
    CONTEXT.name, check_model, kind="context parallel", block_s=block_s, degrees=degrees,
    options=options,
    labels=lambda lay, values: ((3, f"CP={lay.context_parallel_size}"),) + (
        ((8, values[COMM_KEY]),) if lay.runtime_context_parallel_size > 1 else ()),
    inputs=lambda lay: f"CP={lay.context_parallel_size}")
