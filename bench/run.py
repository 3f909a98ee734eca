"""Benchmarks: the trainer against its peers and against the analytic limits, as ratios measured
side by side in one run (absolute times on a shared 2-core CPU mean little; ratios and byte
counts do). Prints a table and writes bench/results.json.

    python bench/run.py           # quick mode for this machine (a few minutes)
    python bench/run.py --full    # longer runs, more repetitions
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import auto  # noqa: E402
import checksum  # noqa: E402
import comm_memory  # noqa: E402
import compose  # noqa: E402
import context  # noqa: E402
import fsdp2  # noqa: E402
import hf_interop  # noqa: E402
import loader  # noqa: E402
import memory  # noqa: E402
import overhead  # noqa: E402
import overlap  # noqa: E402
import pipeline  # noqa: E402
import prepare_speed  # noqa: E402


def _worst(ratios: dict[str, dict[str, float]]) -> float:
    """The ratio furthest from 1.00 over every layout and collective kind."""
    return max((r for by_op in ratios.values() for r in by_op.values()), key=lambda r: abs(r - 1))


def run(quick: bool) -> dict:
    started = time.perf_counter()
    figures: dict = {}
    over = overhead.measure(quick)
    figures["overhead_vs_plain_loop"] = over
    for world in (2, 4):
        figures[f"step_time_vs_fsdp2_w{world}"] = fsdp2.measure(world, quick)
    comm = comm_memory.measure(quick)
    figures["comm_bytes_vs_analytic"] = {name: r["ratio_by_op"] for name, r in comm.items()}
    figures["memory_vs_analytic"] = {name: r["memory_ratio"] for name, r in comm.items()}
    figures["comm_memory_details"] = comm
    figures["compose_vs_bare_hydra"] = compose.measure(quick)
    step_s = sorted(over["step_s_ours"])[len(over["step_s_ours"]) // 2]
    figures["loader_headroom"] = loader.measure(step_s, overhead.MICRO, overhead.SEQ, quick)
    figures["memory_follows_layout"] = memory.measure(quick)
    figures["overlap"] = overlap.measure(3 if quick else 5)
    figures["context_parallel"] = context.measure(quick)
    figures["pipeline"] = pipeline.measure(quick)
    figures["auto"] = auto.measure(quick)
    figures["prepare"] = prepare_speed.measure(quick)
    figures["hf_interop"] = hf_interop.measure(quick)
    figures["checkpoint_checksums"] = checksum.measure(quick)
    gpu = HERE / "gpu_results.json"
    figures["gpu"] = json.loads(gpu.read_text()) if gpu.exists() else None
    return {
        "measured": datetime.date.today().isoformat(),
        "mode": "quick" if quick else "full",
        "machine": f"{platform.machine()}, {platform.python_version()}, "
                   f"{__import__('os').cpu_count()} CPUs",
        "wall_s": round(time.perf_counter() - started, 1),
        "figures": figures,
    }


def table(result: dict) -> str:
    f = result["figures"]
    w2, w4 = f["step_time_vs_fsdp2_w2"], f["step_time_vs_fsdp2_w4"]
    rows = [
        ("overhead_vs_plain_loop", f["overhead_vs_plain_loop"]["overhead_vs_plain_loop"],
         "<= 1.05", f"spread {f['overhead_vs_plain_loop']['ratio_spread']}"),
        ("step_time_vs_fsdp2_w2", round(w2["ratio"], 3), "<= 1.0",
         f"ours {w2['ours']['step_s_median']:.3f} s, fsdp2 {w2['fsdp2']['step_s_median']:.3f} s"),
        ("step_time_vs_fsdp2_w4", round(w4["ratio"], 3), "<= 1.0",
         f"ours {w4['ours']['step_s_median']:.3f} s, fsdp2 {w4['fsdp2']['step_s_median']:.3f} s"),
        ("comm_bytes_vs_analytic", _worst(f["comm_bytes_vs_analytic"]), "1.00",
         "worst over " + ", ".join(f["comm_bytes_vs_analytic"])),
        ("memory_vs_analytic", max(f["memory_vs_analytic"].values()), "<= 1.05",
         "worst over the same layouts"),
        ("compose_vs_bare_hydra", f["compose_vs_bare_hydra"]["compose_vs_bare_hydra"], "<= 1.3",
         f"groups of 16,384 ranks: {f['compose_vs_bare_hydra']['groups_16384_ranks_s']} s"),
        ("loader_headroom", f["loader_headroom"]["loader_headroom"], ">= 50",
         f"{f['loader_headroom']['loader_samples_per_s']:,} samples/s delivered"),
        ("blend_loader_headroom", f["loader_headroom"]["blend_loader_headroom"], ">= 50",
         f"{f['loader_headroom']['blend_samples_per_s']:,} samples/s, "
         f"{f['loader_headroom']['blend_setup']}"),
    ]
    mem = f["memory_follows_layout"]
    seed, peaks = mem["seed_build"], mem["step_peak_vs_plan"]
    worst = max(peaks.values(), key=lambda r: abs(r["step_peak_over_planned"] - 1))
    rows += [
        ("seed_build_peak_over_state", seed["build_peak_over_state"], "<= 2",
         "rank 0 of seed_128rank_cp2, 2 layers, seq 8192, simulated"),
        ("seed_build_s", seed["build_s"], "< 5", "same build (was 40 s before sharded init)"),
        ("step_peak_over_planned", worst["step_peak_over_planned"], "0.8-1.2",
         "worst of " + ", ".join(f"{n} {r['step_peak_over_planned']}" for n, r in peaks.items())),
        ("real_rank_rss_over_planned",
         mem["real_ranks"]["fixed_mmap_threshold_1mib"]["peak_rss_over_planned"], "<= 1.2",
         f"{mem['real_ranks']['setup']}; glibc's default mmap threshold: "
         f"{mem['real_ranks']['glibc_default']['peak_rss_over_planned']}"),
        ("bf16_gather_bytes_over_fp32", mem["bf16_gathers"]["bf16_gather_bytes_over_fp32"],
         "0.50", mem["bf16_gathers"]["setup"]),
        ("overlap_step_time_ratio", f["overlap"]["step_time_overlap_over_sequential"], "< 1.0",
         f["overlap"]["setup"]),
    ]
    cp = f["context_parallel"]
    peak, steps = cp["attention_peak"], cp["steps"]
    rows += [
        ("p2p_attention_peak_over_ag", peak["cp8"]["p2p_over_all_gather"], "<= 0.25",
         f"runtime CP 8, seq {context.SEQ}, fwd+bwd of one layer, simulated rank; CP 4: "
         f"{peak['cp4']['p2p_over_all_gather']}"),
        ("a2a_attention_peak_over_ag", peak["cp8"]["a2a_over_all_gather"], "-",
         f"same; CP 4: {peak['cp4']['a2a_over_all_gather']}"),
        ("cp_step_time_over_ag", max(steps["step_time_over_all_gather"].values()), "-",
         ", ".join(f"{k} {v}" for k, v in steps["step_time_over_all_gather"].items())
         + f"; {steps['setup']}"),
        ("cp_bytes_over_analytic", max(steps["bytes_over_analytic"].values(), key=lambda r:
                                       abs(r - 1)), "1.00",
         ", ".join(f"{k} {v}" for k, v in steps["bytes_over_analytic"].items())),
    ]
    pp = f["pipeline"]
    bubble, versus = pp["bubble_over_ideal"], pp["step_time_vs_torch_pipelining"]
    rows += [(f"bubble_{name}_over_ideal", bubble[name]["ratio"], "<= 1.1",
              f"measured {bubble[name]['measured']}, ideal {bubble[name]['ideal']}; with gloo's "
              f"late-receive hops {bubble[name]['late_receive_model']}; gpipe "
              f"{bubble['gpipe']['ratio']}; {pp['setup']}")
             for name in ("1f1b", "interleaved_1f1b")]
    rows.append(("pp2_step_vs_torch_pipelining", versus["ratio"], "<= 1.0",
                 f"ours {versus['ours_s_median']} s, torch Schedule1F1B "
                 f"{versus['torch_s_median']} s; first loss off by "
                 f"{versus['first_loss']['relative_error']} (relative)"))
    rows += auto_rows(f["auto"])
    prep = f["prepare"]
    rows.append(("prepare_throughput_vs_lib", prep["prepare_throughput_vs_library"], ">= 0.8",
                 f"{prep['ours_tokens_per_s']:,} vs {prep['library_tokens_per_s']:,} tokens/s, "
                 f"{prep['setup']}"))
    hf = f["hf_interop"]
    rows += [
        ("hf_import_s", hf["hf_import_s"], "-",
         f"export {hf['hf_export_s']} s; transformers' load + save "
         f"{hf['transformers_load_and_save_s']} s; {hf['setup']}"),
        ("hf_peak_rss_over_weights", max(hf["import_peak_rss_over_weights"],
                                         hf["export_peak_rss_over_weights"]), "< 1",
         f"import {hf['import_peak_rss_over_weights']}, export "
         f"{hf['export_peak_rss_over_weights']} of {hf['weights_gb']} GB beyond the imports' "
         f"peak (MB: {hf['peak_rss_mb']})"),
    ]
    ck = f.get("checkpoint_checksums")
    if ck:
        rows += [
            ("checksum_gb_per_s", min(ck["checksum_gb_per_s_on_save"],
                                      ck["checksum_gb_per_s_on_load"]), ">= 1",
             f"save {ck['checksum_gb_per_s_on_save']}, load {ck['checksum_gb_per_s_on_load']} "
             f"GB/s; {ck['setup']}"),
            ("save_over_dcp_alone", ck["save_over_dcp_alone"], "-",
             f"checksums and meta.json; verify over load {ck['verify_over_load']}"),
        ]
    gpu = f.get("gpu")
    if gpu:
        plain = gpu["variants"]["plain"]
        rows.append(("gpu_bf16_mfu (plain)", round(plain["mfu"], 3), "-",
                     f"{gpu['device']}, {plain['tokens_per_s']:,.0f} tok/s, "
                     f"transformer-engine: {gpu['variants']['te_bf16']['status']}"))
    lines = [f"{'figure':26s} {'value':>8s}  {'goal':8s} notes"]
    lines += [f"{n:26s} {v:>8}  {g:8s} {note}" for n, v, g, note in rows]
    return "\n".join(lines)


def auto_rows(a: dict) -> list[tuple]:
    """parallel=auto: compose time, its ranking against measured step times, its memory."""
    compose = a["compose"]
    rows = [("auto_compose_over_plain", max(c["auto_over_plain"] for c in compose.values()),
             "<= 3", ", ".join(f"{n} {c['auto_s']} s / {c['plain_s']} s"
                               for n, c in compose.items()))]
    rows += [(f"auto_rank_correlation_w{world}", r["rank_correlation"], ">= 0.8",
              f"{len(r['layouts'])} layouts, calibrated {r['calibrated']}")
             for world, r in a["ranking"].items()]
    if a.get("memory"):
        worst = max(a["memory"].values(), key=lambda r: abs(r["measured_over_planned"] - 1))
        rows.append(("auto_memory_measured_over_plan", worst["measured_over_planned"],
                     "0.8-1.2", ", ".join(f"{n} {r['measured_over_planned']}"
                                          for n, r in a["memory"].items())))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="longer runs, more repetitions")
    args = parser.parse_args()
    result = run(quick=not args.full)
    (HERE / "results.json").write_text(json.dumps(result, indent=1))
    print(table(result))
    print(f"\nwrote {HERE / 'results.json'} ({result['wall_s']} s, {result['mode']} mode)")


if __name__ == "__main__":
    main()
