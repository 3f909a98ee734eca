"""compiled_over_eager: launch.py's step time with train.compile=blocks over the same run
without it, model=small, one process and WS 2 (two gloo ranks), side by side in one run
(interleaved, so drift on a shared machine hits both). Step times come from each run's own
metrics.jsonl (tokens_per_s), the median after the first steps; the first step's compile time
and graph count from its console line.

    python bench/compile_blocks.py        # prints the figures (quick mode)
"""
from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MICRO, SEQ, WARMUP = 2, 256, 3
LAYOUTS = {"one_process": (), "ws2": ("cluster.procs_per_node=2",
                                      "parallel.tensor_parallel_num_weight_shards=2")}
FIRST = re.compile(r"step 1 compiled (\d+) graph\(s\) in ([\d.]+) s")


def step_times(layout: tuple[str, ...], compiled: bool, steps: int) -> tuple[list[float], dict]:
    """Each step's seconds after WARMUP, and (compiled) the first step's graphs and time."""
    with tempfile.TemporaryDirectory(prefix="gtp-bench-") as run_dir:
        out = subprocess.run(
            [sys.executable, str(ROOT / "launch.py"), f"hydra.run.dir={run_dir}", "model=small",
             *layout, f"train.micro_batch_size={MICRO}", f"train.seq_length={SEQ}",
             f"train.train_samples={steps * MICRO}", "train.eval_interval=null",
             "logger.log_interval=1", "checkpoint.save_interval=null",
             f"train.compile={'blocks' if compiled else 'false'}"],
            cwd=ROOT, check=True, capture_output=True, text=True)
        records = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text()
                   .splitlines()]
    tokens = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    first = FIRST.search(out.stdout)
    compile_info = {"graphs": int(first[1]), "first_step_s": float(first[2])} if first else {}
    return [MICRO * SEQ / t for t in tokens[WARMUP:]], compile_info


def measure(quick: bool = True) -> dict:
    steps, repeats = (12, 2) if quick else (40, 3)
    result = {}
    for name, layout in LAYOUTS.items():
        eager, compiled, first = [], [], []
        for _ in range(repeats):
            eager.append(statistics.median(step_times(layout, False, steps)[0]))
            times, info = step_times(layout, True, steps)
            compiled.append(statistics.median(times))
            first.append(info)
        ratios = [c / e for c, e in zip(compiled, eager)]
        result[name] = {
            "ratio": round(statistics.median(ratios), 4),
            "ratio_spread": [round(min(ratios), 4), round(max(ratios), 4)],
            "step_s_eager": [round(x, 4) for x in eager],
            "step_s_compiled": [round(x, 4) for x in compiled],
            "first_step": first,
        }
    result["batch"] = (f"model=small, {MICRO} x {SEQ} tokens a rank, fp32, {steps} steps, "
                       f"median after {WARMUP}")
    return result


if __name__ == "__main__":
    print(json.dumps(measure(quick="--full" not in sys.argv), indent=1))
