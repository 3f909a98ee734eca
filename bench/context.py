"""Context parallel by cp_comm_type: attention memory per rank, step time, and bytes moved.

- attention peak: one simulated rank of a runtime-CP world (torch's fake process group, one
  process; allocations are real) runs the context attention of one layer, forward and backward,
  on train.seq_length=4096 (1 sequence, 16 heads of 64, fp32), for runtime CP 4 and 8; its peak
  resident memory above the inputs (VmHWM, glibc's mmap threshold fixed at 64 KiB so freed
  blocks go back to the kernel), per type, over all_gather's. Goal: p2p <= 0.25 at CP 8.
- step time and bytes: 4 gloo ranks, runtime CP 4, a 2-layer model of hidden 256 and 8 heads
  at 4096 tokens; each type's engine lives in the same rank processes and their steps alternate,
  so machine load falls on all alike; median step over all_gather's. The bytes each type sent
  over the context group in one step, over the count worked out below from the shapes alone.

    python bench/context.py
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from multiprocessing import get_context
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

SEQ, HEADS, HEAD_DIM = 4096, 16, 64
MODEL = ModelConfig(name="llama", vocab_size=512, hidden_size=256, num_layers=2, num_heads=8,
                    ffn_hidden_size=688, rope_theta=1e4, norm_eps=1e-5, init_std=0.02)
OPTIM = OptimConfig(name="adamw", weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8,
                    clip_grad=1.0)
TYPES = [c.value for c in CPCommType]


def _attention_peak(comm: str, cp: int) -> int:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from parallel.comm import CommStats
    from parallel.context import context_attention
    from parallel.groups import build_groups
    from trainer.train.measured_rank import PeakMemory

    PeakMemory.fix_mmap_threshold(64 << 10)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cp)
    layout = Layout(cp, context_parallel_size=cp, seq_length=SEQ)
    groups = build_groups(layout, CommStats())
    attention = context_attention(comm, groups.context, layout, 0)
    local = layout.context_local_length
    # q, k, v as the model makes them: views of one projection output [1, tokens, 3 x heads x d]
    qkv = torch.randn(1, local, 3 * HEADS * HEAD_DIM, requires_grad=True)
    grad = torch.randn(1, HEADS, local, HEAD_DIM)

    def step() -> None:
        q, k, v = (t.view(1, local, HEADS, HEAD_DIM).transpose(1, 2) for t in qkv.chunk(3, -1))
        attention(q, k, v).backward(grad)
        qkv.grad = None

    step()  # warm up: the kernels' one-off allocations
    peak = PeakMemory(torch.device("cpu"))
    peak.reset()
    step()
    return peak.above_baseline()


def attention_peaks(cps: tuple[int, ...] = (4, 8)) -> dict:
    out = {}
    for cp in cps:
        peaks = {}
        for comm in TYPES:
            with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
                peaks[comm] = pool.submit(_attention_peak, comm, cp).result()
        out[f"cp{cp}"] = {
            "peak_bytes": peaks,
            "p2p_over_all_gather": round(peaks["p2p"] / peaks["all_gather"], 3),
            "a2a_over_all_gather": round(peaks["a2a"] / peaks["all_gather"], 3)}
    return out


def analytic_context_bytes(layout: Layout, comm: str) -> int:
    """One step, one rank, over the context group. Per layer and micro-batch, with x = the
    bytes of one of q, k, v on this rank (its tokens, all heads, fp32) and c = runtime CP:
    p2p: K/V (2x) take c-1 hops forward and c-1 in backward, their fp32 gradients c hops;
    all_gather: K/V gathered ((c-1) x 2x) and their gradients reduce-scattered (the same);
    a2a: q, k, v (3x) and the output (x) exchanged forward and their gradients backward, each
    all-to-all sending (c-1)/c of its tensor."""
    c = layout.runtime_context_parallel_size
    x = layout.micro_batch_size * layout.context_local_length * MODEL.hidden_size * 4
    per = {"p2p": (2 * (c - 1) + c) * 2 * x, "all_gather": 2 * (c - 1) * 2 * x,
           "a2a": 2 * ((c - 1) * 3 * x // c + (c - 1) * x // c)}[comm]
    return per * MODEL.num_layers * layout.num_microbatches


def _steps(rank: int, layout: Layout, steps: int) -> dict:
    from trainer.train.batch import rank_micro_batches
    from trainer.train.engine import build_engine
    from trainer.train.step import train_step

    engines = {comm: build_engine(MODEL, OPTIM, 0, layout, torch.device("cpu"),
                                  EngineOptions(cp_comm_type=CPCommType(comm)))
               for comm in TYPES}
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, MODEL.vocab_size, (layout.global_batch_size, SEQ + 1), generator=gen)
    micro = rank_micro_batches(lambda idx: batch[idx], layout, rank)
    times: dict[str, list[float]] = {comm: [] for comm in TYPES}
    sent: dict[str, int] = {}
    for step in range(steps + 1):  # the first step of each is a warm-up
        order = TYPES[step % len(TYPES):] + TYPES[:step % len(TYPES)]
        for comm in order:
            engine = engines[comm]
            engine.groups.stats.reset()
            dist.barrier()
            start = time.perf_counter()
            train_step(engine.model, engine.optimizer, micro, 1e-4)
            dist.barrier()
            if step:
                times[comm].append(time.perf_counter() - start)
            sent[comm] = sum(b for (kind, _), b in engine.groups.stats.bytes.items()
                             if kind == "context")
    return {"times": times, "sent": sent}


def step_times(steps: int) -> dict:
    layout = Layout(4, context_parallel_size=4, seq_length=SEQ)
    layout = replace(layout, global_batch_size=layout.batch_parallel_size)
    ranks = run_ranks(4, _steps, layout, steps)
    median = {comm: statistics.median(max(r["times"][comm][i] for r in ranks)
                                      for i in range(steps)) for comm in TYPES}
    return {
        "setup": f"4 gloo ranks, runtime CP 4, hidden {MODEL.hidden_size}, {MODEL.num_heads} "
                 f"heads, {MODEL.num_layers} layers, 1 x {SEQ} tokens, {steps} timed steps",
        "step_s": {comm: round(t, 3) for comm, t in median.items()},
        "step_time_over_all_gather": {comm: round(median[comm] / median["all_gather"], 3)
                                      for comm in TYPES},
        "bytes_over_analytic": {comm: round(ranks[0]["sent"][comm]
                                            / analytic_context_bytes(layout, comm), 4)
                                for comm in TYPES},
    }


def measure(quick: bool = True) -> dict:
    return {"attention_peak": attention_peaks(), "steps": step_times(3 if quick else 6)}


if __name__ == "__main__":
    print(json.dumps(measure(), indent=1))
