"""Expert parallel (Megatron-Core's EP and ETP): a mixture of experts' experts split over ep
ranks, each holding num_moe_experts / EP of them, the tokens sent to their experts' ranks and
back by all-to-all.

Megatron-Core numbers ranks twice over the same world. The dense view (tp-cp-ep-dp-pp, the seed's
order, with GTP_remat's sequence and batch shards inside TP's weight tile) places attention and
the dense weights; there EP is not an axis of its own (Megatron's decoder generator takes ep=1):
it is a split of the data-parallel ranks. The expert view, etp-ep-edp-pp, places the experts:
ETP ranks split each expert (expert_tensor_parallel), EP ranks hold different experts
(expert_model_parallel), and the rest of a stage's ranks, ETP x EP x PP's complement, hold the
same experts and sum their gradients (expert_data_parallel, Megatron's expert DP). Pipeline
stages are the same in both views (pp is the slowest axis of each), so an expert group never
leaves its stage. GTP_remat shards the dense weights only: experts are split by EP, not gathered
per block. Its step: parallel.experts; its terms of the plan: trainer.plan.axis_costs.expert.
"""
from __future__ import annotations

from parallel.layout.axes.axis import Axis, Group, Key, LayoutError, multiples_near

# parallel=auto chooses EP for a mixture of experts (1 for a dense model), and takes ETP as set.
EXPERTS = Key("expert_model_parallel_size", fix="set parallel.expert_model_parallel_size=1 (off)")
EXPERT_TENSOR = Key("expert_tensor_parallel_size", null="TP (parallel.tensor_model_parallel_size)",
                    effective="etp_size", searched=False)


def check_expert_world(layout) -> None:
    """The expert view fills each pipeline stage with ETP x EP x expert-DP ranks."""
    etp, ep, pp, world = layout.etp_size, layout.ep_size, layout.pp_size, layout.world_size
    tile = etp * ep * pp
    if world % layout.model_and_context_parallel_size:
        return  # the dense view's tile does not fill it: data parallel's rule names that
    if world % tile:
        raise LayoutError(
            f"world_size={world} (cluster.num_nodes x cluster.procs_per_node) is not divisible "
            f"by ETP x EP x PP = {etp} x {ep} x {pp} = {tile} (parallel."
            f"expert_tensor_parallel_size x {EXPERTS.config_key} x parallel."
            f"pipeline_model_parallel_size): the expert view numbers every stage's ranks as "
            f"ETP x EP x expert DP. Fix: use a world size that is a multiple of {tile} "
            f"({multiples_near(world, tile)}), or lower {EXPERTS.config_key}.")


EXPERT = Axis(
    "expert parallel", (EXPERTS, EXPERT_TENSOR), {},
    (Group("expert_tensor_parallel", ("etp",), "expert view: splits each expert (ETP)",
           "weight", order="expert"),
     Group("expert_model_parallel", ("ep",), "expert view: ranks holding different experts; "
           "tokens go to their experts' ranks and back by all-to-all", "weight", order="expert"),
     Group("expert_data_parallel", ("edp",), "expert view: ranks holding the same experts: "
           "gradients summed, optimizer state sharded", "weight", order="expert")),
    {"shard": "parallel.experts:shard_experts"},
    (check_expert_world,),
    expert_rank_axes={"etp": "etp_size", "ep": "ep_size", "edp": "expert_data_parallel_size"},
    comm_options={"moe_token_dispatcher_type": "model.moe_token_dispatcher_type"})
