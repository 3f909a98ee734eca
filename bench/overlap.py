"""step_time_overlap_over_sequential: training steps of GTP_remat with overlapped communication
(parallel.overlap_param_gather and overlap_grad_reduce on) over the same steps with both off.

4 gloo ranks, model=small (conf/model/small.yaml), weight shards 4, fp32. Both engines live in
the same rank processes and their steps alternate (which one goes first alternates too), so
load from anything else on the machine falls on both alike; a step's time is its slowest
rank's, the first step of each is a warm-up, and the figure is the ratio of the medians.
Below 1.00: overlap hides communication. On a CPU box the gloo threads compete with compute
for the same cores, so expect little there; the figure is meant for machines with spare cores
or a network to wait on.

    python bench/overlap.py            # 3 timed steps each
    python bench/overlap.py --steps 5
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ranks import run_ranks  # noqa: E402

from parallel.layout import Layout  # noqa: E402
from trainer.config import ModelConfig, OptimConfig  # noqa: E402
from trainer.plan.options import EngineOptions  # noqa: E402
from trainer.train.batch import MicroBatch  # noqa: E402
from trainer.train.engine import build_engine  # noqa: E402
from trainer.train.step import train_step  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORLD, WEIGHT_SHARDS, MICRO, SEQ, MICRO_BATCHES = 4, 4, 1, 128, 2
OPTIM = OptimConfig(name="adamw", weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8,
                    clip_grad=1.0)
VARIANTS = {
    "sequential": EngineOptions(),
    "overlap": EngineOptions(overlap_param_gather=True, overlap_grad_reduce=True),
}


def small_model() -> ModelConfig:
    return ModelConfig(**OmegaConf.to_container(OmegaConf.load(ROOT / "conf/model/small.yaml")))


def make_layout() -> Layout:
    layout = Layout(WORLD, micro_batch_size=MICRO, seq_length=SEQ,
                    tensor_parallel_num_weight_shards=WEIGHT_SHARDS)
    return replace(layout, global_batch_size=MICRO * layout.batch_parallel_size * MICRO_BATCHES)


def timed_steps(rank: int, layout: Layout, model: ModelConfig, steps: int) -> dict:
    engines = {name: build_engine(model, OPTIM, 0, layout, torch.device("cpu"), options)
               for name, options in VARIANTS.items()}
    gen = torch.Generator().manual_seed(rank)  # content does not change the work
    samples = [torch.randint(0, model.vocab_size, (MICRO, SEQ + 1), generator=gen)
               for _ in range(layout.num_microbatches)]
    positions = torch.arange(SEQ).expand(MICRO, -1)
    batches = [MicroBatch(s[:, :-1], s[:, 1:], positions) for s in samples]
    times: dict[str, list[float]] = {name: [] for name in engines}
    for step in range(steps + 1):
        order = list(engines) if step % 2 == 0 else list(reversed(engines))
        for name in order:
            dist.barrier()  # every rank starts the step together
            start = time.perf_counter()
            train_step(engines[name].model, engines[name].optimizer, batches, 1e-4)
            times[name].append(time.perf_counter() - start)
    return times


def measure(steps: int = 3) -> dict:
    layout, model = make_layout(), small_model()
    ranks = run_ranks(WORLD, timed_steps, layout, model, steps)
    step_s = {name: [max(r[name][i] for r in ranks) for i in range(1, steps + 1)]
              for name in VARIANTS}  # the slowest rank's time, warm-up step dropped
    median = {name: statistics.median(times) for name, times in step_s.items()}
    return {
        "step_time_overlap_over_sequential": round(median["overlap"] / median["sequential"], 3),
        "step_s_median": {name: round(s, 3) for name, s in median.items()},
        "step_s": {name: [round(s, 3) for s in times] for name, times in step_s.items()},
        "setup": f"{WORLD} gloo ranks, model=small, weight shards {WEIGHT_SHARDS}, micro-batch "
                 f"{MICRO} x {SEQ} tokens, {layout.num_microbatches} micro-batches, fp32",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant")
    print(json.dumps(measure(parser.parse_args().steps), indent=1))


if __name__ == "__main__":
    main()
