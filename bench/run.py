"""Benchmarks: the trainer against its peers and against the analytic limits, as ratios measured
side by side in one run (absolute times on a shared 2-core CPU mean little; ratios and byte
counts do). Writes bench/results.json, stamped with the commit and the time, each figure with
its goal and whether this run met it (bench/table.py), prints that table and writes it into
docs/benchmarks.md. results.json is this one run's output: a figure that changes is measured again.

    python bench/run.py           # quick mode for this machine
    python bench/run.py --full    # longer runs, more repetitions
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import auto  # noqa: E402
import checksum  # noqa: E402
import comm_memory  # noqa: E402
import compile_blocks  # noqa: E402
import compose  # noqa: E402
import context  # noqa: E402
import deepseek  # noqa: E402
import documents  # noqa: E402
import finetune  # noqa: E402
import fsdp2  # noqa: E402
import hf_interop  # noqa: E402
import hybrid  # noqa: E402
import loader  # noqa: E402
import memory  # noqa: E402
import moe  # noqa: E402
import muon  # noqa: E402
import overhead  # noqa: E402
import overlap  # noqa: E402
import pipeline  # noqa: E402
import prepare_speed  # noqa: E402
import soak  # noqa: E402
import stamp  # noqa: E402
import table  # noqa: E402
import window  # noqa: E402

from trainer.units import duration  # noqa: E402


def sections(quick: bool) -> list[tuple[str, Callable[[dict], dict]]]:
    """The measurements in the order they run: (name, measure(figures so far) -> figures)."""
    def overhead_and_fsdp2(_: dict) -> dict:
        return {"overhead_vs_plain_loop": overhead.measure(quick),
                **{f"step_time_vs_fsdp2_w{w}": fsdp2.measure(w, quick) for w in (2, 4)}}

    def comm(_: dict) -> dict:
        found = comm_memory.measure(quick)
        return {"comm_bytes_vs_analytic": {k: r["ratio_by_op"] for k, r in found.items()},
                "memory_vs_analytic": {k: r["memory_ratio"] for k, r in found.items()},
                "comm_memory_details": found}

    def loader_headroom(f: dict) -> dict:
        times = sorted(f["overhead_vs_plain_loop"]["step_s_ours"])
        step_s = times[len(times) // 2]
        return {"loader_headroom": loader.measure(step_s, overhead.MICRO, overhead.SEQ, quick)}

    def one(key: str, measure: Callable[[], dict]) -> Callable[[dict], dict]:
        return lambda _: {key: measure()}

    return [
        ("overhead and FSDP2", overhead_and_fsdp2),
        ("communication and memory against the analytic counts", comm),
        ("composing a config", one("compose_vs_bare_hydra", lambda: compose.measure(quick))),
        ("the loader's headroom", loader_headroom),
        ("memory follows the layout", one("memory_follows_layout",
                                          lambda: memory.measure(quick))),
        ("overlap", one("overlap", lambda: overlap.measure(3 if quick else 5))),
        ("context parallel", one("context_parallel", lambda: context.measure(quick))),
        ("pipeline", one("pipeline", lambda: pipeline.measure(quick))),
        ("parallel=auto", one("auto", lambda: auto.measure(quick))),
        ("trainer.prepare", one("prepare", lambda: prepare_speed.measure(quick))),
        ("Hugging Face import and export", one("hf_interop", lambda: hf_interop.measure(quick))),
        ("checkpoint checksums", one("checkpoint_checksums", lambda: checksum.measure(quick))),
        ("mixture of experts", one("moe", lambda: moe.measure(quick))),
        ("DeepSeek-V3's model", one("deepseek", lambda: deepseek.measure(quick))),
        ("documents", one("documents", lambda: documents.measure(quick))),
        ("sliding windows", one("window", lambda: window.measure(quick))),
        ("compiled blocks", one("compile", lambda: compile_blocks.measure(quick))),
        ("Muon against AdamW", one("muon", lambda: muon.measure(quick))),
        ("LoRA and DPO", one("finetune", lambda: finetune.measure(quick))),
        ("hybrid linear attention", one("hybrid", lambda: hybrid.measure(quick))),
        ("soak (2 x 4,096 steps of 8 ranks)", one("soak", lambda: soak.measure(quick))),
    ]


def run(quick: bool) -> dict:
    """Every section in turn, a line before each (its number, the time so far, and the time
    left by the last run of this mode's section times, where results.json has them)."""
    started, at_start = time.perf_counter(), stamp.commit()  # the code the run starts with
    mode = "quick" if quick else "full"
    try:
        before = json.loads((HERE / "results.json").read_text())
        last = before["section_s"] if before.get("mode") == mode else {}
    except (OSError, ValueError, KeyError):
        last = {}
    todo = sections(quick)
    figures: dict = {}
    took: dict[str, float] = {}
    for number, (name, measure) in enumerate(todo, 1):
        left = [last.get(later) for later, _ in todo[number - 1:]]
        eta = f", about {duration(sum(left))} left by the last run" if None not in left else ""
        print(f"bench [{number}/{len(todo)}] {name} ({duration(time.perf_counter() - started)} "
              f"so far{eta})", flush=True)
        began = time.perf_counter()
        figures.update(measure(figures))
        took[name] = round(time.perf_counter() - began, 1)
    return {
        "measured": stamp.now(),
        "commit": at_start + ("" if stamp.commit() == at_start else
                              f" (the tree changed during the run: {stamp.commit()} at its end)"),
        "mode": mode,
        "machine": stamp.machine(),
        "wall_s": round(time.perf_counter() - started, 1),
        "section_s": took,
        "figures": figures,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="longer runs, more repetitions")
    args = parser.parse_args()
    result = run(quick=not args.full)
    result["table"] = table.rows(result["figures"])
    (HERE / "results.json").write_text(json.dumps(result, indent=1))
    table.write_page(result)
    print(table.text(result["table"]))
    print(f"\nwrote {HERE / 'results.json'} ({result['wall_s']} s, {result['mode']} mode) and "
          f"docs/benchmarks.md's table")


if __name__ == "__main__":
    main()
