"""Context parallel: a sequence split over cp weight replicas, on top of GTP_remat's sequence
shards (runtime CP = CP x sequence shards), in zigzag chunks so causal attention's work is even;
attention exchanges K/V by cp_comm_type. Its step: parallel.context; its terms of the plan:
trainer.plan.axis_costs.context.
"""
from __future__ import annotations

import math

from parallel.layout.axes.axis import Axis, Group, LayoutError, multiples_near, off


def check_seq_length(layout) -> None:
    """Zigzag CP cuts a sequence into 2 x runtime CP chunks; SP then splits each CP-local part
    over TP."""
    cp, sp, seq = layout.runtime_context_parallel_size, layout.sp_degree, layout.seq_length
    if seq is None:
        return
    multiple = math.lcm(2 * cp if cp > 1 else 1, cp * sp)
    if seq % multiple == 0:
        return
    why = []
    if cp > 1:
        why.append(f"2 x runtime CP = {2 * cp} (runtime CP = parallel.context_parallel_size "
                   f"{layout.context_parallel_size} x sequence shards per GTP_remat group "
                   f"{layout.gtp_remat_num_sequence_shards})")
    if sp > 1:
        why.append(f"runtime CP x SP degree = {cp} x {sp} (sequence parallel splits the "
                   f"CP-local part over TP)")
    raise LayoutError(
        f"train.seq_length={seq} must be divisible by {' and by '.join(why)}. Fix: set "
        f"train.seq_length to a multiple of {multiple} ({multiples_near(seq, multiple)}).")


def zigzag_chunks(position: int, cp: int) -> tuple[int, int]:
    """The chunks runtime CP position `position` keeps of a sequence cut into 2 x cp: its own
    and its mirror, so every position does the same causal work."""
    return position, 2 * cp - 1 - position


def window_reaches(query_chunk: int, key_chunk: int, chunk: int, window: int) -> bool:
    """Whether any query of `query_chunk` sees any key of `key_chunk` (chunks of `chunk`
    tokens) when a query may look `window` positions back: the key chunk is not after it and
    its last key is within the window of the query chunk's first row."""
    return key_chunk <= query_chunk and query_chunk * chunk - window <= (key_chunk + 1) * chunk - 1


def reached_slots(reader: int, owner: int, cp: int, chunk: int, window: int) -> list[int]:
    """Which of position `owner`'s two chunks (0: its own, 1: its mirror) some query of
    position `reader` sees under the window."""
    mine = zigzag_chunks(reader, cp)
    return [slot for slot, key in enumerate(zigzag_chunks(owner, cp))
            if any(window_reaches(query, key, chunk, window) for query in mine)]


# The most chunks a window's exchange may receive: what one ring step holds in flight. It keeps
# them for backward, where the ring keeps only its own; past this the ring runs.
EXCHANGED_CHUNKS = 2


def window_exchange(cp: int, chunk: int, window: int) -> list[tuple[int, int]] | None:
    """Under a sliding window, each runtime CP position's (chunks it receives, chunks it
    sends) in a layer's forward (parallel.context.window; backward sends the received chunks'
    gradients home); None where some position would receive more than EXCHANGED_CHUNKS (a
    window longer than about a chunk): the ring runs then, skipping the pairs it never
    reaches, and holds one block in flight instead of all it reaches."""
    reach = [[reached_slots(d, m, cp, chunk, window) for m in range(cp)] for d in range(cp)]
    counts = [(sum(len(reach[p][m]) for m in range(cp) if m != p),
               sum(len(reach[d][p]) for d in range(cp) if d != p)) for p in range(cp)]
    return None if max(received for received, _ in counts) > EXCHANGED_CHUNKS else counts


CONTEXT = Axis(
    "context parallel", (off("context_parallel_size"),), {"cp": "context_parallel_size"},
    (Group("context", ("seq", "cp"), "runtime CP (configured CP x sequence shards): split one "
           "sequence, exchange K/V", "token"),),
    {"wire": "parallel.context:inject_attention"},
    (check_seq_length,),
    comm_options={"cp_comm_type": "parallel.cp_comm_type"})
