"""Sliding windows: what a window saves under context parallel and on one process.

- CP 8 by p2p: 8 gloo ranks, 16,384 tokens (chunks of 1,024), a 1,024-token window in every
  block against the same ring without one; each configuration's engine lives in the same rank
  processes and their steps alternate, so machine load falls on all alike. The bytes the
  busiest rank sent over the context group in one step, over the ring's; beside them the
  analytic count: a window no longer than a chunk reaches only the chunk before each of a rank's
  two chunks, so at most two chunks of K/V go out and two come in, and in backward two chunks'
  gradients go home (fp32 here, as the K/V): 4 chunks' K/V a layer, where the ring sends
  (2(C - 1) + C) x 2 = 44 at C = 8. The median step time over the ring's, and all_gather's with
  the same window over all_gather's without (it gathers the whole K/V either way).
- One process: 8,192 tokens with a 1,024-token window over full causal attention (the same
  model and engine), the median of alternating steps.

    python bench/window.py
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from ranks import run_ranks  # noqa: E402

from parallel.layout import Layout  # noqa: E402
from trainer.config import CPCommType, ModelConfig, OptimConfig  # noqa: E402
from trainer.plan.options import EngineOptions  # noqa: E402

WINDOW, CP, CP_SEQ, ONE_SEQ = 1024, 8, 16384, 8192
MODEL = ModelConfig(name="llama", vocab_size=512, hidden_size=128, num_layers=2, num_heads=4,
                    ffn_hidden_size=344, rope_theta=1e4, norm_eps=1e-5, init_std=0.02)
OPTIM = OptimConfig(name="adamw", weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8,
                    clip_grad=1.0)
# (name, cp_comm_type, window)
CONFIGS = [("p2p", "p2p", None), ("p2p_window", "p2p", WINDOW),
           ("all_gather", "all_gather", None), ("all_gather_window", "all_gather", WINDOW)]


def _engines(layout: Layout, configs: list[tuple[str, str, int | None]]) -> dict:
    from trainer.train.engine import build_engine

    return {name: build_engine(replace(MODEL, window_size=window), OPTIM, 0, layout,
                               torch.device("cpu"), EngineOptions(cp_comm_type=CPCommType(comm)))
            for name, comm, window in configs}


def _alternate(rank: int, layout: Layout, configs: list, steps: int, seq: int) -> dict:
    """Each configuration's step, in rotating order, `steps` timed after a warm-up each."""
    from trainer.train.batch import rank_micro_batches
    from trainer.train.step import train_step

    engines = _engines(layout, configs)
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, MODEL.vocab_size, (layout.global_batch_size, seq + 1), generator=gen)
    micro = rank_micro_batches(lambda idx: batch[idx], layout, rank)
    names = [name for name, _, _ in configs]
    times: dict[str, list[float]] = {name: [] for name in names}
    sent: dict[str, int] = {}
    distributed = dist.is_initialized()
    for step in range(steps + 1):
        for name in names[step % len(names):] + names[:step % len(names)]:
            engine = engines[name]
            engine.groups.stats.reset()
            if distributed:
                dist.barrier()
            start = time.perf_counter()
            train_step(engine.model, engine.optimizer, micro, 1e-4)
            if distributed:
                dist.barrier()
            if step:
                times[name].append(time.perf_counter() - start)
            sent[name] = sum(b for (kind, _), b in engine.groups.stats.bytes.items()
                             if kind == "context")
    return {"times": times, "sent": sent}


def context_parallel(steps: int) -> dict:
    layout = Layout(CP, context_parallel_size=CP, seq_length=CP_SEQ)
    layout = replace(layout, global_batch_size=layout.batch_parallel_size)
    ranks = run_ranks(CP, _alternate, layout, CONFIGS, steps, CP_SEQ, timeout=1800)
    median = {name: statistics.median(max(r["times"][name][i] for r in ranks)
                                      for i in range(steps)) for name, _, _ in CONFIGS}
    busiest = {name: max(r["sent"][name] for r in ranks) for name, _, _ in CONFIGS}
    chunk_kv = (layout.micro_batch_size * layout.context_local_length // 2
                * MODEL.hidden_size * 4 * 2)  # one chunk's k and v, fp32
    per_layer = MODEL.num_layers * layout.num_microbatches
    analytic = {"p2p": (2 * (CP - 1) + CP) * 2 * chunk_kv * per_layer,
                "p2p_window": 4 * chunk_kv * per_layer}
    return {
        "setup": f"{CP} gloo ranks, runtime CP {CP}, 1 x {CP_SEQ} tokens, window {WINDOW}, "
                 f"hidden {MODEL.hidden_size}, {MODEL.num_heads} heads, {MODEL.num_layers} "
                 f"layers, fp32, {steps} timed steps",
        "step_s": {name: round(t, 3) for name, t in median.items()},
        "busiest_rank_bytes": busiest,
        "analytic_bytes": analytic,
        "bytes_window_over_ring": round(busiest["p2p_window"] / busiest["p2p"], 4),
        "analytic_window_over_ring": round(analytic["p2p_window"] / analytic["p2p"], 4),
        "bytes_over_analytic": {name: round(busiest[name] / analytic[name], 4)
                                for name in analytic},
        "step_time_window_over_ring": round(median["p2p_window"] / median["p2p"], 3),
        "all_gather_step_time_window_over_none": round(
            median["all_gather_window"] / median["all_gather"], 3),
        "step_time_window_p2p_over_window_all_gather": round(
            median["p2p_window"] / median["all_gather_window"], 3),
    }


def _one_process(rank: int, steps: int) -> dict:
    layout = Layout(1, seq_length=ONE_SEQ)
    return _alternate(rank, layout, [("full", "p2p", None), ("window", "p2p", WINDOW)], steps,
                      ONE_SEQ)


def one_process(steps: int) -> dict:
    times = run_ranks(1, _one_process, steps, timeout=1800)[0]["times"]
    median = {name: statistics.median(t) for name, t in times.items()}
    return {"setup": f"one process, 1 x {ONE_SEQ} tokens, window {WINDOW}, hidden "
                     f"{MODEL.hidden_size}, {MODEL.num_heads} heads, {MODEL.num_layers} layers, "
                     f"fp32, {steps} timed steps",
            "step_s": {name: round(t, 3) for name, t in median.items()},
            "step_time_window_over_full": round(median["window"] / median["full"], 3)}


def measure(quick: bool = True) -> dict:
    return {"context_parallel": context_parallel(2 if quick else 5),
            "one_process": one_process(3 if quick else 6)}


if __name__ == "__main__":
    print(json.dumps(measure(), indent=1))
