"""overhead_vs_plain_loop: a launch.py training run's step time over a minimal hand-written
loop (bench/plain_loop.py) on the same model, data, batch and optimizer, one process each.
launch.py's step time comes from its own metrics.jsonl (tokens_per_s of each step)."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MICRO, SEQ, WARMUP = 8, 128, 20


def launch_step_times(steps: int) -> list[float]:
    with tempfile.TemporaryDirectory(prefix="gtp-bench-") as run_dir:
        subprocess.run(
            [sys.executable, str(ROOT / "launch.py"), f"hydra.run.dir={run_dir}", "model=tiny",
             f"train.micro_batch_size={MICRO}", f"train.seq_length={SEQ}",
             f"train.train_samples={steps * MICRO}", "train.eval_interval=null",
             "logger.log_interval=1", "checkpoint.resume=false"],
            cwd=ROOT, check=True, capture_output=True, text=True)
        records = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text()
                   .splitlines()]
    return [MICRO * SEQ / r["tokens_per_s"] for r in records if "tokens_per_s" in r]


def plain_step_times(steps: int) -> list[float]:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "plain_loop.py"), str(steps),
                          str(MICRO), str(SEQ)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["step_s"]


def measure(quick: bool = True) -> dict:
    steps, repeats = (150, 3) if quick else (600, 5)
    ours, plain = [], []
    for _ in range(repeats):  # interleaved, so drift on a shared machine hits both
        ours.append(statistics.median(launch_step_times(steps)[WARMUP:]))
        plain.append(statistics.median(plain_step_times(steps)[WARMUP:]))
    ratios = [o / p for o, p in zip(ours, plain)]
    return {
        "overhead_vs_plain_loop": round(statistics.median(ratios), 4),
        "ratio_spread": [round(min(ratios), 4), round(max(ratios), 4)],
        "step_s_ours": [round(x, 5) for x in ours],
        "step_s_plain": [round(x, 5) for x in plain],
        "batch": f"{MICRO} x {SEQ} tokens, model=tiny, {steps} steps, median after {WARMUP}",
    }
