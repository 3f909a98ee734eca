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


CONTEXT = Axis(
    "context parallel", (off("context_parallel_size"),), {"cp": "context_parallel_size"},
    (Group("context", ("seq", "cp"), "runtime CP (configured CP x sequence shards): split one "
           "sequence, exchange K/V", "token"),),
    {"wire": "parallel.context:inject_attention"},
    (check_seq_length,),
    comm_options={"cp_comm_type": "parallel.cp_comm_type"})
