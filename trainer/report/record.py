"""What a run folder's layout.json records: the layout asked of the Layout, and the memory plan
settle made (trainer.plan.memory). A training run writes it as the dry run does; the dry run also
formats it for a person (trainer.report.dry_run).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from parallel.layout import AXES, Layout
from parallel.layout.axes import EXPERT_AXES, PARALLEL_KEYS
from parallel.layout.pipeline_simulation import bubble_fraction
from trainer.compose.runspec import RunSpec


def rank_rows(layout: Layout, procs_per_node: int) -> list[dict[str, int]]:
    """Per rank: node, its index on each axis, the positions the trainer uses, and its index
    on the expert view's ep and edp (which experts it holds, which part of their state)."""
    rows = []
    for rank in range(layout.world_size):
        coords = layout.coords(rank)._asdict()
        experts = layout.expert_coords(rank)
        rows.append({"rank": rank, "node": rank // procs_per_node, **coords,
                     "weight_shard": layout.weight_shard(rank),
                     "batch_partition": layout.batch_partition(rank),
                     "runtime_cp_rank": layout.runtime_cp_rank(rank),
                     "ep": experts["ep"], "edp": experts["edp"]})
    return rows


def nvlink_warnings(layout: Layout, domain: int) -> list[str]:
    crossing = layout.weight_tiles_crossing(domain)
    if not crossing:
        return []
    first, last = crossing[0]
    size = layout.weight_tile_size
    return [f"{len(crossing)} of {layout.world_size // size} weight tiles (TP x GTP_remat = "
            f"{size} ranks) span more than one NVLink domain of "
            f"cluster.gpus_per_nvlink_domain={domain} ranks (first: ranks {first}..{last}); their "
            f"weight all-gathers and gradient reduce-scatters will leave NVLink. Fix: make "
            f"parallel.tensor_parallel_num_weight_shards divide {domain}, or set "
            f"cluster.gpus_per_nvlink_domain if the domain is larger."]


def layout_record(spec: RunSpec) -> dict[str, Any]:
    """layout.json's content: the layout's inputs, derived values, axes, groups and ranks, the
    memory plan (trainer.plan.memory) and the pipeline's bubble."""
    config, layout = spec.config, spec.layout
    record = {
        "inputs": {  # every axis's keys (parallel.layout.axes), their nulls resolved
            "world_size": layout.world_size,
            **{key.name: getattr(layout, key.effective or key.name) for key in PARALLEL_KEYS},
            "pipeline_schedule": config.parallel.pipeline_schedule,
            "micro_batch_size": layout.micro_batch_size,
            "seq_length": layout.seq_length,
        },
        "derived": layout.derived(),
        "axes": {"order": list(AXES), "sizes": layout.axis_sizes, "strides": layout.axis_strides},
        "expert_axes": {"order": list(EXPERT_AXES), "sizes": layout.expert_axis_sizes},
        "groups": layout.all_groups(),
        "ranks": rank_rows(layout, config.cluster.procs_per_node),
        "memory": spec.memory,  # planned once, by settle
        "pipeline": {"bubble_fraction": bubble_fraction(
            config.parallel.pipeline_schedule, layout.pp_size, layout.num_microbatches,
            layout.virtual_pipeline_size)},
        "warnings": nvlink_warnings(layout, config.cluster.gpus_per_nvlink_domain),
        "training": training_record(spec),
    }
    if spec.auto is not None:
        record["auto"] = spec.auto.as_dict()
    return record


def training_record(spec: RunSpec) -> dict[str, Any]:
    """The sample plan and Megatron's schedule: steps, each step's batch, lr and weight decay."""
    plan, ramp = spec.plan, spec.plan.ramp
    return {"train_samples": plan.train_samples, "train_steps": plan.train_steps,
            "global_batch_size": plan.global_batch_size,
            "rampup_batch_size": [ramp.start, ramp.increment, ramp.samples] if ramp else None,
            "lr_schedule": spec.schedule.describe(),
            "weight_decay": spec.weight_decay.describe()}


def write_layout_json(record: dict[str, Any], run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "layout.json"
    path.write_text(json.dumps(record, indent=1))
    return path
