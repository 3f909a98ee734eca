"""The benchmark table: bench/results.json's figures as rows (figure, value, goal, met, notes),
printed by bench/run.py, stored in results.json beside the figures, and written into
docs/benchmarks.md between its bench-table markers (tests/unit/test_bench_table.py holds the
page equal to it).
No torch: it only reads the figures.

    python bench/table.py          # rewrite docs/benchmarks.md's table from bench/results.json
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PAGE = HERE.parent / "docs" / "benchmarks.md"
BEGIN = "<!-- bench table: written by bench/run.py from bench/results.json; do not edit -->"
END = "<!-- end of bench table -->"


# torch.distributed.pipelining's schedule each of ours is timed against (bench/pipeline.py)
TORCH_SCHEDULES = {"1f1b": "Schedule1F1B",
                   "zb_h1": "ScheduleInterleavedZeroBubble (one stage a rank)",
                   "zbv": "ScheduleZBVZeroBubble"}

def met(value: Any, goal: str) -> bool | None:
    """Whether a figure meets its goal: '<= x', '>= x', '< x', '> x', 'a-b' (inclusive) or 'x'
    (equal at the shown precision); None where there is no goal ('-')."""
    if goal == "-":
        return None
    if m := re.fullmatch(r"(<=|>=|<|>) ?([\d.]+)( s)?", goal):
        op, bound = m.group(1), float(m.group(2))
        return {"<=": value <= bound, ">=": value >= bound, "<": value < bound,
                ">": value > bound}[op]
    if m := re.fullmatch(r"([\d.]+)-([\d.]+)", goal):
        return float(m.group(1)) <= value <= float(m.group(2))
    decimals = len(goal.partition(".")[2])
    return round(value, decimals) == float(goal)


def _worst(ratios: dict[str, dict[str, float]]) -> float:
    """The ratio furthest from 1.00 over every layout and collective kind."""
    return max((r for by_op in ratios.values() for r in by_op.values()), key=lambda r: abs(r - 1))


def _row(figure: str, value: Any, goal: str, notes: str) -> dict[str, Any]:
    if isinstance(value, float):
        value = round(value, 3)
    return {"figure": figure, "value": value, "goal": goal, "met": met(value, goal),
            "notes": notes}


def _stage_costs(bubble: dict[str, Any]) -> str:
    """Where a schedule's bubble goes beyond its ideal: the stages' unequal work (the head's
    and the loss's on the last), simulated; the rest is the runner's and gloo's."""
    at = bubble.get("simulated_at_measured_costs", {})
    if "bubble_at_stage_costs" not in at:  # a run before it was measured
        return ""
    return (f"; the schedule at each stage's measured busy time {at['bubble_at_stage_costs']} "
            f"(measured over it {bubble['over_simulated_at_stage_costs']})")


def rows(figures: dict[str, Any]) -> list[dict[str, Any]]:
    f = figures
    over, w2, w4 = f["overhead_vs_plain_loop"], f["step_time_vs_fsdp2_w2"], \
        f["step_time_vs_fsdp2_w4"]
    out = [
        _row("overhead_vs_plain_loop", over["overhead_vs_plain_loop"], "<= 1.05",
             f"launch.py's step time over a hand-written loop, same model, data and batch, one "
             f"process ({over['batch']}); spread {over['ratio_spread']}"),
        _row("step_time_vs_fsdp2_w2", w2["ratio"], "<= 1.0",
             f"weight sharding (WS 2) vs FSDP2 fully_shard, {w2['parameters']:,} parameters, "
             f"gloo: ours {w2['ours']['step_s_median']:.3f} s, fsdp2 "
             f"{w2['fsdp2']['step_s_median']:.3f} s"),
        _row("step_time_vs_fsdp2_w4", w4["ratio"], "<= 1.0",
             f"WS 4: ours {w4['ours']['step_s_median']:.3f} s, fsdp2 "
             f"{w4['fsdp2']['step_s_median']:.3f} s"),
        _row("comm_bytes_vs_analytic", _worst(f["comm_bytes_vs_analytic"]), "1.00",
             "bytes of every collective kind over the count from shapes and layout "
             "(bench/comm_memory.py), worst over " + ", ".join(f["comm_bytes_vs_analytic"])),
        _row("memory_vs_analytic", max(f["memory_vs_analytic"].values()), "<= 1.05",
             "parameters + gradients + AdamW state per rank over the analytic count, worst "
             "over the same layouts"),
        _row("compose_vs_bare_hydra", f["compose_vs_bare_hydra"]["compose_vs_bare_hydra"],
             "<= 1.3", f"launch.py --cfg job --resolve vs the same tree in a bare Hydra app "
             f"({f['compose_vs_bare_hydra']['compose_s_ours']} s vs "
             f"{f['compose_vs_bare_hydra']['compose_s_bare']} s, spread "
             f"{f['compose_vs_bare_hydra']['ratio_spread']}); all groups of 16,384 ranks: "
             f"{f['compose_vs_bare_hydra']['groups_16384_ranks_s']} s"),
        _row("loader_headroom", f["loader_headroom"]["loader_headroom"], ">= 50",
             f"{f['loader_headroom']['loader_samples_per_s']:,} samples/s delivered to a rank "
             f"over the samples/s training consumes"),
        _row("blend_loader_headroom", f["loader_headroom"]["blend_loader_headroom"], ">= 50",
             f"the same through data.blend: {f['loader_headroom']['blend_samples_per_s']:,} "
             f"samples/s, {f['loader_headroom']['blend_setup']}"),
    ]
    mem = f["memory_follows_layout"]
    seed, peaks = mem["seed_build"], mem["step_peak_vs_plan"]
    worst = max(peaks.values(), key=lambda r: abs(r["step_peak_over_planned"] - 1))
    counted = max(peaks.values(), key=lambda r: abs(r["allocated_peak_over_planned"] - 1))
    real = mem["real_ranks"]
    out += [
        _row("seed_build_peak_over_state", seed["build_peak_over_state"], "<= 2",
             "rank 0 of seed_128rank_cp2, 2 layers, seq 8192, built alone against a simulated "
             "128-rank world: build peak over planned state"),
        _row("seed_build_s", seed["build_s"], "< 5 s", "the same build"),
        _row("allocated_peak_over_planned", counted["allocated_peak_over_planned"],
             "0.98-1.02", "measured dry run: the step's peak as the allocator counts it "
             "(state plus the larger of the micro-batches' and the update's transients) over "
             "the planned peak, the worst of " + ", ".join(
                 f"{n} {r['allocated_peak_over_planned']}" for n, r in peaks.items())),
        _row("step_peak_over_planned", worst["step_peak_over_planned"], "-",
             "the same runs' resident-memory peak over the planned peak (end to end: glibc "
             "keeps freed blocks resident), the worst of " + ", ".join(
                 f"{n} {r['step_peak_over_planned']}" for n, r in peaks.items())),
        _row("real_rank_rss_over_planned",
             real["fixed_mmap_threshold_1mib"]["peak_rss_over_planned"], "<= 1.2",
             f"{real['setup']}, glibc's mmap threshold fixed at 1 MiB; with glibc's default "
             f"{real['glibc_default']['peak_rss_over_planned']}"),
        _row("bf16_gather_bytes_over_fp32", mem["bf16_gathers"]["bf16_gather_bytes_over_fp32"],
             "0.50", mem["bf16_gathers"]["setup"]),
        _row("overlap_step_time_ratio", f["overlap"]["step_time_overlap_over_sequential"],
             "< 1.0", f"overlap on over off: {f['overlap']['setup']}"),
    ]
    cp = f["context_parallel"]
    peak, steps = cp["attention_peak"], cp["steps"]
    out += [
        _row("p2p_attention_peak_over_ag", peak["cp8"]["p2p_over_all_gather"], "<= 0.25",
             f"one layer's context attention, forward and backward, simulated rank of runtime "
             f"CP 8; CP 4: {peak['cp4']['p2p_over_all_gather']}"),
        _row("a2a_attention_peak_over_ag", peak["cp8"]["a2a_over_all_gather"], "-",
             f"the same for a2a; CP 4: {peak['cp4']['a2a_over_all_gather']}"),
        _row("cp_step_time_over_ag", max(steps["step_time_over_all_gather"].values()), "-",
             ", ".join(f"{k} {v}" for k, v in steps["step_time_over_all_gather"].items())
             + f"; {steps['setup']}"),
        _row("cp_bytes_over_analytic", max(steps["bytes_over_analytic"].values(),
                                           key=lambda r: abs(r - 1)), "1.00",
             ", ".join(f"{k} {v}" for k, v in steps["bytes_over_analytic"].items())),
    ]
    pp = f["pipeline"]
    bubble, versus = pp["bubble_over_ideal"], pp["step_time_vs_torch_pipelining"]
    out += [_row(f"bubble_{name}_over_ideal", bubble[name]["ratio"], "<= 1.1",
                 f"measured {bubble[name]['measured']}, ideal {bubble[name]['ideal']}; with "
                 f"gloo's late-receive hops {bubble[name]['late_receive_model']}"
                 + _stage_costs(bubble[name]) + f"; gpipe {bubble['gpipe']['ratio']}; "
                 f"{pp['setup']}")
            for name in ("1f1b", "interleaved_1f1b")]
    out += [_row(f"bubble_{name}_over_1f1b_ideal", bubble[name]["over_1f1b_ideal"], goal,
                 f"measured {bubble[name]['measured']}, 1F1B's ideal {bubble[name]['ideal']}; "
                 f"the schedule at this run's F/B/W costs "
                 f"{bubble[name]['simulated_at_measured_costs']['bubble']} "
                 f"({bubble[name]['simulated_at_measured_costs']['action_s']}); {pp['setup']}")
            for name, goal in (("zb_h1", "<= 0.6"), ("zbv", "<= 0.5")) if name in bubble]
    near = pp.get("zero_bubble_where_w_is_near_i")
    if near:
        zb = near["zb_h1"]
        out.append(_row(
            "bubble_zb_h1_over_1f1b_ideal_w_near_i", zb["over_1f1b_ideal"], "-",
            f"the same where W costs about what I does (the zero-bubble paper's premise; above, "
            f"W is a sixth of a micro-batch's work): measured {zb['measured']}, the schedule at "
            f"this run's costs {zb['simulated_at_measured_costs']['bubble']} "
            f"({zb['simulated_at_measured_costs']['action_s']}); 1F1B "
            f"{near['1f1b']['ratio']} of its ideal; {near['setup']}"))
    if "ratio" in versus:  # a run before the zero-bubble schedules: 1F1B's alone
        versus = {"1f1b": versus}
    out += [_row("pp2_step_vs_torch_pipelining" + ("" if name == "1f1b" else f"_{name}"),
                 v["ratio"], "<= 1.0",
                 f"ours {v['ours_s_median']} s, torch {TORCH_SCHEDULES[name]} "
                 f"{v['torch_s_median']} s; first loss off by "
                 f"{v['first_loss']['relative_error']} (relative)")
            for name, v in versus.items()]
    out += _auto_rows(f["auto"])
    prep = f["prepare"]
    out.append(_row("prepare_throughput_vs_lib", prep["prepare_throughput_vs_library"],
                    ">= 0.8", f"{prep['ours_tokens_per_s']:,} vs "
                    f"{prep['library_tokens_per_s']:,} tokens/s, {prep['setup']}"))
    hf = f["hf_interop"]
    out += [
        _row("hf_import_s", hf["hf_import_s"], "-",
             f"export {hf['hf_export_s']} s; transformers' load + save "
             f"{hf['transformers_load_and_save_s']} s; {hf['setup']}"),
        _row("hf_peak_rss_over_weights", max(hf["import_peak_rss_over_weights"],
                                             hf["export_peak_rss_over_weights"]), "< 1",
             f"import {hf['import_peak_rss_over_weights']}, export "
             f"{hf['export_peak_rss_over_weights']} of {hf['weights_gb']} GB beyond the "
             f"imports' peak"),
    ]
    ck = f["checkpoint_checksums"]
    out += [
        _row("checksum_gb_per_s", min(ck["checksum_gb_per_s_on_save"],
                                      ck["checksum_gb_per_s_on_load"]), ">= 1",
             f"save {ck['checksum_gb_per_s_on_save']}, load {ck['checksum_gb_per_s_on_load']} "
             f"GB/s; {ck['setup']}"),
        _row("save_over_dcp_alone", ck["save_over_dcp_alone"], "-",
             f"checksums and meta.json; verify over load {ck['verify_over_load']}"),
    ]
    if "moe" in f:  # results of runs before bench/moe.py have none
        out += _moe_rows(f["moe"])
    if "documents" in f:  # nor before bench/documents.py
        out += _document_rows(f["documents"])
    if "compile" in f:  # nor before bench/compile_blocks.py
        out += _compile_rows(f["compile"])
    if "window" in f:  # nor before bench/window.py
        out += _window_rows(f["window"])
    if "muon" in f:  # nor before bench/muon.py
        out += _muon_rows(f["muon"])
    if "finetune" in f:  # nor before bench/finetune.py
        out += _finetune_rows(f["finetune"])
    if "hybrid" in f:  # nor before bench/hybrid.py
        out += _hybrid_rows(f["hybrid"])
    if "soak" in f:  # nor before bench/soak.py
        out += _soak_rows(f["soak"])
    if "deepseek" in f:  # nor before bench/deepseek.py
        out += _deepseek_rows(f["deepseek"])
    return out


def _finetune_rows(t: dict) -> list[dict[str, Any]]:
    """peft=lora over full fine-tuning (step, state), DPO over two next-token steps."""
    fb, up, state = t["forward_backward_s"], t["update_s"], t["state_lora_over_full"]
    return [
        _row("lora_step_over_full", t["lora_step_over_full"]["value"], "<= 0.8",
             f"model=small, rank 16 on every projection; forward+backward {fb['lora']} s vs "
             f"{fb['full']} s, update {up['lora']} s vs {up['full']} s"),
        _row("lora_state_measured_over_planned",
             state["bytes"]["measured"]["lora"] / state["bytes"]["planned"]["lora"], "1.00",
             f"a rank's weights, gradients and optimizer state under LoRA, allocated over "
             f"planned; LoRA's over full fine-tuning's {state['measured']} (planned "
             f"{state['planned']})"),
        _row("dpo_step_over_two_lm_steps", t["dpo_step_over_two_lm_steps"]["value"], "<= 1.0",
             f"LoRA, reference = adapters off: {t['step_s']['lora_dpo']} s vs 2 x "
             f"{t['step_s']['lora']} s"),
    ]


def _hybrid_rows(h: dict) -> list[dict[str, Any]]:
    """Qwen3-Next's hybrid: one process at 8k over its blocks all full attention (and where
    the time goes), and CP 4 p2p's relay bytes over the analytic count and over the ring."""
    one, cp = h["one_process"], h["context_parallel"]
    where = one["where_the_time_goes"]
    return [
        _row("hybrid_step_over_full_attention_8k", one["step_time_hybrid_over_full"], "-",
             f"step s {one['step_s']}; a linear block's core (convolution and chunked rule, "
             f"forward and backward) {one['core_s']['linear']} s against softmax attention's "
             f"fused kernel {one['core_s']['softmax']} s at 8k: the hybrid's cores "
             f"{where['linear_cores_s']} + {where['softmax_cores_s']} s, all-full's "
             f"{where['all_full_cores_s']} s; {one['setup']}"),
        _row("hybrid_p2p_linear_bytes_over_analytic", cp["linear_bytes_over_analytic"], "1.00",
             f"a linear block's relay bytes, the busiest rank's: {cp['linear_block_bytes']} B "
             f"(analytic {cp['linear_block_analytic_bytes']} B); {cp['setup']}"),
        _row("hybrid_p2p_linear_bytes_over_ring", cp["linear_bytes_over_ring"], "-",
             f"over one full block's ring; step s {cp['step_s']} (the relay's chain waits on "
             f"the ranks before: docs/hybrid.md)"),
    ]


def _deepseek_rows(d: dict) -> list[dict[str, Any]]:
    """DeepSeek-V3's model: beside a Mixtral-style one, MTP's cost against its FLOPs, and the
    measured dry run of MLA + MTP + EP layouts."""
    side, mtp, dry = d["deepseek_over_mixtral"], d["mtp_over_none"], d["dry_run"]
    where = ", ".join(f"{op} {share}" for op, share in
                      side["deepseek_self_cpu_share_by_op"].items())
    worst = max(dry.values(), key=lambda r: abs(r["allocated_peak_over_planned"] - 1))
    return [
        _row("deepseek_step_time_over_mixtral_style",
             side["step_time_deepseek_over_mixtral_style"], "-",
             f"{side['setup']}; active parameters {side['active_parameters']}; DeepSeek's self "
             f"CPU time by op: {where}"),
        _row("mtp1_step_time_ratio_over_flop_ratio", mtp["time_ratio_over_flop_ratio"],
             "0.9-1.1", f"step time with one MTP depth over without {mtp['step_time_ratio']}, "
             f"their FLOP ratio {mtp['flop_ratio']}; {mtp['setup']}"),
        _row("deepseek_dry_run_allocated_over_planned", worst["allocated_peak_over_planned"],
             "0.98-1.02", "measured dry run of a mid-sized DeepSeek-style model (MLA, MTP 1, 8 "
             "experts), the worst of " + ", ".join(
                 f"{n} {r['allocated_peak_over_planned']}" for n, r in dry.items())),
    ]


def _window_rows(w: dict) -> list[dict[str, Any]]:
    """Sliding windows: CP 8 p2p's bytes and step time over the ring's, one process's step."""
    cp, one = w["context_parallel"], w["one_process"]
    return [
        _row("window_p2p_bytes_over_ring", cp["bytes_window_over_ring"], "<= 0.25",
             f"the busiest rank's context bytes a step; analytic "
             f"{cp['analytic_window_over_ring']} (measured over analytic: "
             f"{', '.join(f'{k} {v}' for k, v in cp['bytes_over_analytic'].items())}); "
             f"{cp['setup']}"),
        _row("window_p2p_step_over_ring", cp["step_time_window_over_ring"], "<= 0.5",
             f"all_gather with the window over without "
             f"{cp['all_gather_step_time_window_over_none']}; p2p's window over all_gather's "
             f"{cp['step_time_window_p2p_over_window_all_gather']}; step s {cp['step_s']}"),
        _row("window_one_process_step_over_full", one["step_time_window_over_full"], "<= 0.6",
             f"step s {one['step_s']}; {one['setup']}"),
    ]


def _muon_rows(m: dict) -> list[dict[str, Any]]:
    """optim=muon over adamw: step time, the exchange's bytes, the owners' balance, the loss."""
    d = m["details"]
    timing, balance, loss = d["timing"], d["balance"], d["loss"]
    return [
        _row("muon_step_over_adamw", m["step_time_muon_over_adamw"]["value"], "-",
             f"alternating steps; Muon's update "
             f"{m['muon_update_share_of_step']['value']} of its step (the Newton-Schulz "
             f"iteration; AdamW's update is elementwise); {timing['setup']}"),
        _row("muon_bytes_over_analytic", m["exchange_bytes_busiest_over_analytic"]["value"],
             "1.00", f"the busiest rank's exchange bytes in one update; summed over the ranks "
             f"{m['exchange_bytes_sum_over_analytic']['value']}"),
        _row("muon_owner_flops_max_over_mean", m["ns_flops_max_over_mean_small_ws4"]["value"],
             "<= 1.2", f"model=small WS 4; {balance['seed_example']}: "
             f"{m['ns_flops_max_over_mean_seed']['value']}; the ranks assign the same owners: "
             f"{balance['ranks_assign_the_same_owners']}"),
        _row("muon_loss_over_adamw", m["loss_muon_over_adamw"]["value"], "<= 1.0",
             f"validation loss after the same samples, each at its best lr of a 3-point sweep "
             f"(lr {loss['best_lr']}); {loss['setup']}"),
    ]


def _compile_rows(c: dict) -> list[dict[str, Any]]:
    """train.compile=blocks: compiled over eager step time, one process and WS 2."""
    def first(r: dict) -> str:
        done = [x for x in r["first_step"] if x]
        return (f"first step {done[0]['graphs']} graph(s) in {done[0]['first_step_s']} s"
                if done else "first step not reported")
    one, ws2 = c["one_process"], c["ws2"]
    return [
        _row("compiled_over_eager", one["ratio"], "<= 0.8",
             f"train.compile=blocks over eager, launch.py step time, one process ({c['batch']});"
             f" spread {one['ratio_spread']}; {first(one)}"),
        _row("compiled_over_eager_ws2", ws2["ratio"], "-",
             f"the same under WS 2 (two gloo ranks); spread {ws2['ratio_spread']}; "
             f"{first(ws2)}"),
    ]


def _soak_rows(s: dict) -> list[dict[str, Any]]:
    """A long 8-rank run with background checkpoints, then the same with one rank killed."""
    plain, killed = s["plain"], s["killed_once"]
    return [
        _row("soak_rss_growth", plain["rss_growth"], "< 1.02",
             f"8 ranks (WS 4 x CP 2, model=tiny), {plain['steps']:,} steps, a background "
             f"checkpoint every 256: the worst rank's resident set at the end over after "
             f"warm-up ({plain['seconds']} s)"),
        _row("soak_fds_growth", plain["fds_growth"], "0",
             "open file descriptors at the end less after warm-up, the worst rank"),
        _row("soak_left_running", plain["left_running"] + killed["left_running"], "0",
             "processes alive after launch.py exited, both runs"),
        _row("soak_killed_once_restarts", killed["restarts"], "1",
             f"the same run with rank 3 killed mid-way under cluster.max_restarts=1: exit code "
             f"{killed['exit_code']}, each step logged once: {killed['steps_logged_once']}, "
             f"resident set growth {killed['rss_growth']:.3f}"),
    ]


def _document_rows(d: dict) -> list[dict[str, Any]]:
    """Packed documents and fine-tuning data: reset_attention_mask's step time, prepare from
    JSON lines, data.pack's efficiency."""
    one, cp4, prep, pack = (d["reset_attention_mask"], d["reset_attention_mask_cp4"],
                            d["prepare_json_lines"], d["packing"])
    return [
        _row("reset_attention_mask_step_over_without", one["with_over_without"], "<= 0.6",
             f"attention {one['attention_share_without']} of the step without; "
             f"{one['step_s']['with']} s vs {one['step_s']['without']} s; {one['setup']}"),
        _row("reset_attention_mask_cp4_step_over_without", cp4["with_over_without"], "<= 0.6",
             f"attention {cp4['attention_share_without']} of the step without; "
             f"{cp4['step_s']['with']} s vs {cp4['step_s']['without']} s; {cp4['setup']}"),
        _row("prepare_jsonl_throughput_vs_lib", prep["ours_over_library"], ">= 0.8",
             f"{prep['ours_tokens_per_s']:,} vs {prep['library_tokens_per_s']:,} tokens/s, "
             f"{prep['setup']}"),
        _row("prepare_workers_2_over_1", prep["workers_2_over_1_tokens_per_s"], "-",
             f"tokens/s of python -m trainer.prepare --workers 2 over --workers 1 (whole "
             f"command: {prep['workers_s']['1']} s and {prep['workers_s']['2']} s)"),
        _row("pack_efficiency_chat_2048", pack["efficiency"]["2048"], ">= 0.95",
             f"at train.seq_length 256: {pack['efficiency']['256']}; {pack['setup']}"),
    ]


def _moe_rows(moe: dict) -> list[dict[str, Any]]:
    """A mixture of experts: dispatch bytes, speed against dense and under EP, balance, and
    the measured dry run of EP layouts."""
    dispatch, dense, ep, bal = moe["dispatch"], moe["moe_over_dense"], moe["ep4_over_ep1"], \
        moe["imbalance"]
    where = ", ".join(f"{op} {share}" for op, share in dense["moe_self_cpu_share_by_op"].items())
    dry = moe["dry_run"]
    worst = max(dry.values(), key=lambda r: abs(r["allocated_peak_over_planned"] - 1))
    return [
        _row("moe_dispatch_bytes_over_analytic", dispatch["bytes_over_analytic"], "1.00",
             f"{dispatch['setup']}; the count from each rank's routing"),
        _row("moe_tokens_per_s_over_dense", dense["tokens_per_s_moe_over_dense"], ">= 0.7",
             f"{dense['setup']}; MoE's self CPU time by op: {where}"),
        _row("moe_step_time_ep4_over_ep1", ep["step_time_ep4_over_ep1"], "-",
             f"{ep['setup']}: EP 4 {ep['step_s']['ep4']} s, EP 1 {ep['step_s']['ep1']} s"),
        _row("moe_imbalance_after_256_steps", max(bal["aux_loss"], bal["expert_bias"]),
             "<= 1.5", f"aux_loss {bal['aux_loss']}, expert bias {bal['expert_bias']}; "
             f"{bal['setup']}"),
        _row("moe_dry_run_allocated_over_planned", worst["allocated_peak_over_planned"],
             "0.8-1.2", "measured dry run of a mid-sized MoE (8 experts, top 2), the worst of "
             + ", ".join(f"{n} {r['allocated_peak_over_planned']} (resident "
                         f"{r['step_peak_over_planned']})" for n, r in dry.items())),
    ]


def _auto_rows(a: dict) -> list[dict[str, Any]]:
    """parallel=auto: compose time, its ranking against measured step times, its memory."""
    compose = a["compose"]
    out = [_row("auto_compose_over_plain", max(c["auto_over_plain"] for c in compose.values()),
                "<= 3", ", ".join(f"{n} {c['auto_s']} s / {c['plain_s']} s"
                                  for n, c in compose.items()))]
    out += [_row(f"auto_rank_correlation_w{world}", r["rank_correlation"], ">= 0.8",
                 f"{len(r['layouts'])} layouts, calibrated {r['calibrated']}")
            for world, r in a["ranking"].items()]
    if a.get("memory"):
        worst = max(a["memory"].values(), key=lambda r: abs(r["measured_over_planned"] - 1))
        out.append(_row("auto_memory_measured_over_plan", worst["measured_over_planned"],
                        "0.8-1.2", ", ".join(f"{n} {r['measured_over_planned']}"
                                             for n, r in a["memory"].items())))
    return out


def text(table: list[dict[str, Any]]) -> str:
    """The table as run.py prints it."""
    lines = [f"{'figure':34s} {'value':>8s}  {'goal':8s} {'met':4s} notes"]
    lines += [f"{r['figure']:34s} {r['value']!s:>8}  {r['goal']:8s} {_met(r['met']):4s} "
              f"{r['notes']}" for r in table]
    return "\n".join(lines)


def _met(value: bool | None) -> str:
    return {True: "yes", False: "no", None: "-"}[value]


def markdown(result: dict[str, Any]) -> str:
    """The page's section between the markers: where and when, then the table."""
    table = result["table"]
    missed = [r["figure"] for r in table if r["met"] is False]
    lines = [BEGIN, "",
             f"Measured {result['measured']} at commit {result['commit']} on {result['machine']}"
             f" ({result['mode']} mode, {result['wall_s']:.0f} s): {len(table)} figures, "
             f"{sum(r['met'] is True for r in table)} goals met, {len(missed)} not met"
             + (f" ({', '.join(missed)})" if missed else "") + ".", "",
             "| figure | value | goal | met | notes |", "|---|---|---|---|---|"]
    lines += [f"| {r['figure']} | {r['value']} | {r['goal']} | {_met(r['met'])} | "
              f"{r['notes'].replace('|', '/')} |" for r in table]
    return "\n".join([*lines, "", END])


def page_section(page: str) -> str:
    """The generated section of docs/benchmarks.md, markers included."""
    start, end = page.index(BEGIN), page.index(END) + len(END)
    return page[start:end]


def write_page(result: dict[str, Any], path: Path = PAGE) -> None:
    page = path.read_text()
    path.write_text(page.replace(page_section(page), markdown(result)))


if __name__ == "__main__":
    results = json.loads((HERE / "results.json").read_text())
    if "table" not in results:
        sys.exit("bench/results.json has no table: run python bench/run.py")
    write_page(results)
    print(f"wrote {PAGE}'s bench table from {HERE / 'results.json'}")
