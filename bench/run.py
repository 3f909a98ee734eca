"""Benchmarks: the trainer against its peers and against the analytic limits, as ratios measured
side by side in one run (absolute times on a shared 2-core CPU mean little; ratios and byte
counts do). Writes bench/results.json, stamped with the commit and the time, each figure with
its goal and whether this run met it (bench/table.py), prints that table and writes it into
README.md. results.json is this one run's output: a figure that changes is measured again.

    python bench/run.py           # quick mode for this machine
    python bench/run.py --full    # longer runs, more repetitions, and the soak (bench/soak.py)
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import auto  # noqa: E402
import checksum  # noqa: E402
import comm_memory  # noqa: E402
import compile_blocks  # noqa: E402
import compose  # noqa: E402
import context  # noqa: E402
import documents  # noqa: E402
import fsdp2  # noqa: E402
import hf_interop  # noqa: E402
import loader  # noqa: E402
import memory  # noqa: E402
import moe  # noqa: E402
import overhead  # noqa: E402
import overlap  # noqa: E402
import pipeline  # noqa: E402
import prepare_speed  # noqa: E402
import soak  # noqa: E402
import table  # noqa: E402


def commit() -> str:
    """HEAD's commit, marked when the working tree differs from it (then the figures are of
    code that no commit holds)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=HERE.parent, capture_output=True, text=True,
                              check=True).stdout.strip()
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return git("rev-parse", "--short=12", "HEAD") + (" (with uncommitted changes)" if dirty else "")


def run(quick: bool) -> dict:
    started, at_start = time.perf_counter(), commit()  # the code the run starts with
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
    figures["moe"] = moe.measure(quick)
    figures["documents"] = documents.measure(quick)
    figures["compile"] = compile_blocks.measure(quick)
    if not quick:  # 2 x 4,096 steps of 8 ranks: about 3 h on a 2-core machine
        figures["soak"] = soak.measure(quick)
    return {
        "measured": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": at_start + ("" if commit() == at_start else
                              f" (the tree changed during the run: {commit()} at its end)"),
        "mode": "quick" if quick else "full",
        "machine": f"{platform.machine()}, {platform.python_version()}, "
                   f"{__import__('os').cpu_count()} CPUs",
        "wall_s": round(time.perf_counter() - started, 1),
        "figures": figures,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="longer runs, more repetitions")
    args = parser.parse_args()
    result = run(quick=not args.full)
    result["table"] = table.rows(result["figures"])
    (HERE / "results.json").write_text(json.dumps(result, indent=1))
    table.write_readme(result)
    print(table.text(result["table"]))
    print(f"\nwrote {HERE / 'results.json'} ({result['wall_s']} s, {result['mode']} mode) and "
          f"README.md's table")


if __name__ == "__main__":
    main()
