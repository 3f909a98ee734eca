"""GTP_remat weight and sequence shards (the seed): TP x GTP_remat ranks share one copy of the
weights, all-gathered before use; inside that weight tile, sequence shards split a sequence and
the rest take different micro-batches (batch shards). Its step: parallel.bundle; its terms of the
plan: trainer.plan.axis_costs.gtp_remat.
"""
from __future__ import annotations

from parallel.layout.axes.axis import Axis, Group, Key, LayoutError, multiples_near

WEIGHT_SHARDS = Key("tensor_parallel_num_weight_shards", null="its default")
SEQUENCE_SHARDS = Key("tensor_parallel_num_sequence_shards", null="its default")


def check_shards(layout) -> None:
    """Weight shards count the TP ranks, sequence shards the SP ranks; the sequence shards per
    GTP_remat group divide it (the rest of the group are batch shards)."""
    tp, ws, ss, sp = (layout.tp_size, layout.tensor_parallel_num_weight_shards,
                      layout.tensor_parallel_num_sequence_shards, layout.sp_degree)
    ws_key, ss_key = WEIGHT_SHARDS.config_key, SEQUENCE_SHARDS.config_key
    if ws < tp or ws % tp:
        raise LayoutError(
            f"{ws_key}={ws} is not a multiple of parallel.tensor_model_parallel_size={tp}: "
            f"weight shards count TP ranks too, so they must be a multiple of TP. Fix: set "
            f"{ws_key} to {multiples_near(ws, tp)}, or null for no sharding beyond TP.")
    if ss < sp or ss % sp:
        raise LayoutError(
            f"{ss_key}={ss} is not a multiple of the SP degree {sp} (TP="
            f"{tp}, sequence_parallel={layout.sequence_parallel}): sequence shards count the "
            f"SP ranks too. Fix: set {ss_key} to {multiples_near(ss, sp)}, or null for {sp}.")
    ns, g = ss // sp, ws // tp
    if ns > 1 and tp > 1 and not layout.sequence_parallel:
        raise LayoutError(
            f"{ss_key}={ss} shards sequences within GTP_remat, which requires "
            f"sequence_parallel when parallel.tensor_model_parallel_size={tp} > 1. Fix: set "
            f"parallel.sequence_parallel=true, or {ss_key}=null.")
    if g % ns:
        raise LayoutError(
            f"{ss_key}={ss} gives {ns} sequence shards per GTP_remat group, which does not "
            f"divide GTP_remat size {g} ({ws_key}={ws} / TP={tp}). Fix: make {ss_key} / "
            f"SP degree {sp} a divisor of {g}, e.g. {ss_key}={sp * _divisor_near(g, ns)}.")


def _divisor_near(n: int, value: int) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - value), d))


GTP_REMAT = Axis(
    "GTP_remat weight and sequence shards", (WEIGHT_SHARDS, SEQUENCE_SHARDS),
    {"seq": "gtp_remat_num_sequence_shards", "batch": "gtp_remat_num_batch_shards"},
    (Group("gtp_remat", ("seq", "batch"), "weight sharding beyond TP: all-gathers weights before "
           "use, reduce-scatters their gradients", "weight"),
     Group("weight_tile", ("tp", "seq", "batch"), "TP x GTP_remat ranks that together hold one "
           "full copy of the weights", "weight")),
    {"wire": "parallel.bundle:bundle_blocks"},
    (check_shards,),
    comm_options={"grad_reduce_in_compute_dtype": "parallel.grad_reduce_in_bf16",
                  "overlap_param_gather": "parallel.overlap_param_gather",
                  "overlap_grad_reduce": "parallel.overlap_grad_reduce"})
