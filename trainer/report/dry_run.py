"""The dry run: print what a layout means and write layout.json; start no process, need no GPU.

Everything shown is layout.json's record (trainer.report.record: the Layout's answers and the
memory plan); this module only formats it, and with dry_run_rank adds one rank measured
(built and stepped by trainer.train.measured_rank, beside the rank's own code).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from parallel.layout import GROUP_AXES, GROUP_PURPOSE, Layout
from parallel.layout.axes import group_names
from parallel.layout.pipeline_schedules import SPLIT_BACKWARD, last_stage
from parallel.layout.pipeline_simulation import bubble_fraction
from trainer.auto.search import Candidate, Choice
from trainer.compose.runspec import RunSpec
from trainer.plan.axis_costs import describe_inputs
from trainer.report.record import layout_record, write_layout_json

log = logging.getLogger(__name__)

WEIGHT_VIEW, TOKEN_VIEW = group_names("weight"), group_names("token")
EXPERT_VIEW = group_names("weight", "expert")
MAX_TABLE_RANKS = 64  # larger worlds get the summary only; layout.json always has every rank


STEP_COLUMNS = {"activation_bytes": "activations", "backward_bytes": "backward",
                "recompute_bytes": "recompute",
                "autocast_weight_bytes": "autocast", "logits_bytes": "logits",
                "gathered_bytes": "gathered", "message_bytes": "messages",
                "update_bytes": "update", "peak_bytes": "peak"}


def _bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:10.2f} {unit}"
    return f"{n:10d} B  "


def format_report(spec: RunSpec, record: dict[str, Any]) -> str:
    """The readable report of layout.json's facts."""
    config, layout = spec.config, spec.layout
    memory, rows = record["memory"], record["ranks"]
    c = config.cluster
    lines = [
        f"gtp-trainer dry run: {config.run_name}",
        f"world {layout.world_size} = {c.num_nodes} nodes x {c.procs_per_node} procs; "
        f"NVLink domain {c.gpus_per_nvlink_domain} ranks",
        f"inputs: {describe_inputs(layout)} micro_batch={config.train.micro_batch_size} "
        f"seq_length={config.train.seq_length}",
        training_line(spec),
        "", "derived (config node `layout`):",
    ]
    lines += [f"  {key:32s} {value}" for key, value in layout.derived().items()]
    lines += ["", "rank axes, fastest first:  " + "  ".join(
        f"{axis}={size}" for axis, size in layout.axis_sizes.items())]
    views = [("weight view (who holds which weight shard)", WEIGHT_VIEW),
             ("batch and sequence view (who sees which tokens)", TOKEN_VIEW)]
    if config.model.num_moe_experts is not None:
        lines += ["expert rank axes (Megatron-Core's expert view), fastest first:  " + "  ".join(
            f"{axis}={size}" for axis, size in layout.expert_axis_sizes.items())]
        views.append(("expert view (who holds which experts)", EXPERT_VIEW))
    for title, names in views:
        lines += ["", f"{title}:",
                  f"  {'group':15s} {'axes':22s} {'size':>5s} {'count':>6s}  rank 0's group"]
        for name in names:
            group = layout.group(name, 0)
            axes = "first+last of pp" if name == "embedding" else ",".join(GROUP_AXES[name])
            shown = str(group) if len(group) <= 8 else f"[{group[0]}, {group[1]}, ..., {group[-1]}]"
            count = len(layout.groups(name)) if name == "embedding" else (
                layout.world_size // len(group))
            label = name
            if len(name) > 15:  # the expert view's long names take a line of their own
                lines.append(f"  {name}")
                label = ""
            lines += [f"  {label:15s} {axes:22s} {len(group):5d} {count:6d}  {shown}",
                      f"  {'':15s} {GROUP_PURPOSE[name]}"]
    if rows and layout.world_size <= MAX_TABLE_RANKS:
        columns = list(rows[0])
        header = " ".join(f"{col:>{max(4, len(col))}s}" for col in columns)
        lines += ["", "per rank:", "  " + header]
        lines += ["  " + " ".join(f"{row[col]:>{max(4, len(col))}d}" for col in columns)
                  for row in rows]
    m = config.model
    shape = [f"{m.num_heads} heads" + (f" in {m.query_groups} K/V groups"
                                       if m.query_groups != m.num_heads else ""),
             f"vocabulary {m.vocab_size}" + (f" padded to {m.padded_vocab_size}"
                                             if m.padded_vocab_size != m.vocab_size else "")]
    shape += ["tied embeddings"] if m.tie_word_embeddings else []
    if m.num_moe_experts is not None:
        moe = sum(m.is_moe_block(i) for i in range(m.num_layers))
        capacity = (f", capacity factor {m.moe_expert_capacity_factor:g}"
                    if m.moe_expert_capacity_factor is not None else "")
        shape.append(f"{m.num_moe_experts} experts of {m.expert_ffn_size} (top "
                     f"{m.moe_router_topk}{capacity}) in {moe} blocks")
    lines += ["", f"memory per rank: model={m.name}, {m.num_layers} layers x hidden "
              f"{m.hidden_size}, {', '.join(shape)} ({memory['unsharded']['parameters']:,} "
              f"parameters), precision={config.train.precision.value}",
              f"  {'':18s} {'params':>14s} {'grads':>14s} {'optimizer':>14s} {'total':>14s}"]
    for entry in memory["per_stage"]:
        label = f"stage {entry['stage']}" if layout.pp_size > 1 else "each rank"
        lines.append(f"  {label:18s} " + " ".join(_bytes(entry[k]) for k in (
            "param_bytes", "grad_bytes", "optim_bytes", "total_bytes")))
    one = memory["unsharded"]
    lines.append(f"  {'one process':18s} " + " ".join(_bytes(one[k]) for k in (
        "param_bytes", "grad_bytes", "optim_bytes", "total_bytes")))
    lines.append("  (2-D weights split over TP x GTP_remat; norms whole; optimizer state split "
                 "over weight_replica" + ("; experts split over EP, their optimizer state over "
                                          "expert DP)" if m.num_moe_experts else ")"))
    if config.optim.name == "muon":
        taken, total = one["muon_elements"], memory["unsharded"]["parameters"]
        lines.append(f"  (optim=muon: Muon takes {taken:,} of the {total:,} parameters, the "
                     f"hidden matrices, one fp32 momentum each; AdamW the other "
                     f"{total - taken:,}, two moments each; optim.adamw_params moves more to "
                     f"AdamW)")
        for owners in memory.get("muon_owners", []):
            where = f"stage {owners['stage']} " if layout.pp_size > 1 else ""
            lines.append(f"  (Muon's owners, {where}{owners['buffer'].removeprefix('muon_')}: "
                         f"{owners['matrices']} matrices over {owners['ranks']} ranks, at most "
                         f"{owners['most_owned']} on one, the busiest rank's Newton-Schulz FLOPs "
                         f"{owners['flops_max_over_mean']:.2f}x the mean)")
    t = config.train
    recompute = t.recompute_granularity.value if t.recompute_granularity else "off"
    if t.recompute_granularity and t.recompute_num_layers is not None:
        recompute += f", first {t.recompute_num_layers} blocks"
    context = ""
    if layout.runtime_context_parallel_size > 1:
        context = f"; cp_comm_type {config.parallel.cp_comm_type.value}"
    lines += ["", f"during a step (one micro-batch of {t.micro_batch_size} x {t.seq_length} "
              f"tokens, {layout.context_local_length} of each "
              f"sequence on this rank; recompute {recompute}; overlap_param_gather "
              f"{'on' if config.parallel.overlap_param_gather else 'off'}{context}):",
              f"  {'':18s} " + " ".join(f"{title:>14s}" for title in STEP_COLUMNS.values())]
    for entry in memory["per_stage"]:
        label = f"stage {entry['stage']}" if layout.pp_size > 1 else "each rank"
        lines.append(f"  {label:18s} " + " ".join(_bytes(entry[k]) for k in STEP_COLUMNS))
    lines += ["  (peak = state + the larger of the update and: activations + autocast + messages"
              " + the larger", "   of the loss's backward (logits, the head's gathered weight) "
              "and a block's (backward", "   + recompute + gathered - the head's activations);"
              " the formula of each term: docs/dry-run.md, memory plan)"]
    if "expert_dispatch" in memory:
        d = memory["expert_dispatch"]
        lines += [f"  expert dispatch (one MoE layer, one micro-batch): {d['rows_sent']:,} rows "
                  f"leave this rank; its experts",
                  f"   run {d['rows_expected']:,} expected (the router balanced: what the peak "
                  f"counts), at most {d['rows_most']:,}",
                  ("   (its experts' capacity), which keeps " if m.moe_expert_capacity_factor
                   is not None else "   (dropless: every row of its EP group), which keeps ")
                  + f"{_bytes(d['worst_case_extra_bytes']).strip()} more a layer"]
    if config.checkpoint.async_save:
        staged = max(entry["staging_bytes"] for entry in memory["per_stage"])
        lines += [f"  checkpoint.async_save: each save copies up to {_bytes(staged).strip()} "
                  f"a rank to host memory (weights, Adam moments, buffers), held until written"]
    if layout.pp_size > 1:
        lines += pipeline_lines(config.parallel.pipeline_schedule, layout, memory)
    if spec.auto is not None:
        lines += auto_lines(spec.auto)
    return "\n".join(lines)


def training_line(spec: RunSpec) -> str:
    """The steps, their global batch (a ramp-up's sizes) and Megatron's schedule."""
    plan = spec.plan
    batch = plan.describe_batch()
    if plan.ramp:  # the memory plan below is the largest batch's (the most micro-batches)
        batch += (f", then {plan.global_batch_size}; memory planned at "
                  f"{plan.global_batch_size} ({spec.layout.num_microbatches} micro-batches)")
    return (f"training: {plan.train_steps:,} steps, {batch}, to {plan.train_samples:,} samples; "
            f"{spec.schedule.describe()}; {spec.weight_decay.describe()}")


def auto_lines(choice: Choice) -> list[str]:
    """parallel=auto: the choice, the next best and what the search dropped."""
    hw = choice.hardware

    def row(label: str, c: Candidate) -> str:
        return (f"  {label:7s} {c.describe():58s} {c.estimate.step_s:9.3f} s "
                f"{c.layout.global_batch_size:6d} {1e3 * c.seconds_per_sample:9.3f} ms "
                f"{c.peak_bytes / 2**30:8.1f} GiB  {c.estimate.dominant}")
    lines = ["", f"parallel=auto: the fastest of {choice.fitting} layouts that fit "
             f"{choice.budget_bytes / 2**30:.1f} GiB a rank (cluster.device_memory_gib "
             f"{hw.device_memory_gib:g} less {100 * hw.memory_margin:g}%), by the cost model "
             f"(trainer/plan/cost.py: {hw.peak_bf16_tflops:g} / {hw.peak_fp32_tflops:g} TFLOP/s "
             f"bf16 / fp32 at {100 * hw.compute_efficiency:g}%, NVLink "
             f"{hw.nvlink_bandwidth_gbs:g} GB/s, network {hw.network_bandwidth_gbs:g} GB/s"
             + (f", {hw.ranks_per_core:g} ranks a CPU core" if hw.shares_cores else "")
             + f"); searched in {choice.search_s:.2f} s",
             f"  {'':7s} {'layout':58s} {'step':>11s} {'batch':>6s} {'per sample':>12s} "
             f"{'peak':>12s}  dominant cost",
             row("chosen", choice.chosen)]
    lines += [row(f"#{i + 2}", c) for i, c in enumerate(choice.alternatives)]
    lines.append("  step time by cost (chosen): " + ", ".join(
        f"{kind} {seconds:.3f} s" for kind, seconds in choice.chosen.estimate.seconds.items()
        if seconds))
    lines.append("  dropped: " + "; ".join(f"{n} {reason}" for reason, n in
                                           choice.dropped.items()))
    return lines


def pipeline_lines(schedule: str, layout: Layout, memory: dict[str, Any]) -> list[str]:
    """The schedule's bubble and what each stage holds and keeps in flight."""
    p, v, m = layout.pp_size, layout.virtual_pipeline_size, layout.num_microbatches
    chunks = f", {v} model chunks per stage" if v > 1 else ""
    if schedule in SPLIT_BACKWARD:
        how = ("simulated: stages of equal time, a backward twice the forward, half of it the "
               "weights' gradients (W)")
    else:
        how = f"(PP-1) / ({'v x ' if v > 1 else ''}m + PP-1), stages of equal time"
    lines = ["", f"pipeline: {p} stages, schedule {schedule}{chunks}, {m} micro-batches a step; "
             f"bubble {100 * bubble_fraction(schedule, p, m, v):.1f}% of the step ({how})"]
    last = last_stage(schedule, p, v)
    for entry in memory["per_stage"]:
        ends = (["embedding"] if entry["stage"] == 0 else []) + (
            ["final norm, head, loss"] if entry["stage"] == last else [])
        waiting = entry.get("weights_pending", 0)
        lines.append(f"  stage {entry['stage']}: blocks {_ranges(entry['blocks'])}"
                     f"{' + ' + ', '.join(ends) if ends else ''}; activations of "
                     f"{entry['in_flight']} (micro-batch, chunk) pair(s) in flight at most"
                     + (f", and what W needs of {waiting} more whose I has run" if waiting
                        else ""))
    return lines


def _ranges(blocks: list[int]) -> str:
    """'0-3, 8-11': consecutive runs."""
    runs: list[list[int]] = []
    for block in blocks:
        if runs and block == runs[-1][-1] + 1:
            runs[-1].append(block)
        else:
            runs.append([block])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def format_measured(measured: dict[str, Any], planned: dict[str, int]) -> str:
    m = measured
    transients = _bytes(planned["transient_bytes"]).strip()
    return "\n".join([
        "", f"measured (rank {m['rank']} of a simulated world of {m['world_size']}, "
        f"{m['device']}): build {m['build_s']:.2f} s, one step {m['step_s']:.2f} s",
        f"  {'state allocated':18s} {_bytes(m['state_bytes'])}   (planned "
        f"{_bytes(planned['total_bytes']).strip()})",
        f"  {'activations':18s} {_bytes(m['activation_bytes'])}   (planned "
        f"{_bytes(planned['activation_bytes']).strip()}; {m['in_flight']} (micro-batch, chunk) "
        f"pair(s) in flight, planned {planned['in_flight']})",
        f"  {'messages':18s} {_bytes(m['message_bytes'])}   (planned "
        f"{_bytes(planned['message_bytes']).strip()}: pipeline receives held at once)",
        f"  {'build peak':18s} {_bytes(m['build_peak_bytes'])}",
        f"  {'step peak':18s} {_bytes(m['step_peak_bytes'])}   (resident memory)",
        *([f"  {'step transients':18s} {_bytes(m['step_transient_bytes'])}   (allocator-"
           f"counted above the state; planned {transients})",
           f"  {'update transient':18s} {_bytes(m['update_transient_bytes'])}   (planned "
           f"{_bytes(planned['update_bytes']).strip()})"] if "step_transient_bytes" in m else []),
    ])


def dry_run(spec: RunSpec, run_dir: Path) -> dict[str, Any]:
    """The plan, printed and written to layout.json at once; with dry_run_rank, then that
    rank measured (saying what it does as it goes), beside the plan, and layout.json again."""
    record = layout_record(spec)
    print(format_report(spec, record), flush=True)
    for warning in record["warnings"]:
        log.warning(warning)
    print(f"\nwrote {write_layout_json(record, run_dir)}", flush=True)
    rank = spec.config.dry_run_rank
    if rank is not None:
        from trainer.train.measured_rank import measure_rank, slow_step_warning  # torch, if asked

        print("", flush=True)
        slow = slow_step_warning(spec)
        if slow is not None:
            log.warning(slow)
        record["measured"] = measure_rank(spec, rank, say=lambda line: print(line, flush=True))
        stage = spec.layout.coords(rank).pp
        print(format_measured(record["measured"], record["memory"]["per_stage"][stage]),
              flush=True)
        print(f"\nwrote {write_layout_json(record, run_dir)} (with what was measured)")
    return record
