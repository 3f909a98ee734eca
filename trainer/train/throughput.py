"""What people compare trainers by, measured each step on each rank: model FLOP/s per rank and
MFU, the rank's peak memory, and the share of the step spent waiting for data; at the end of a
run, each pipeline stage's measured peak beside the memory plan's.

Model FLOPs are counted from the config (trainer.plan.cost.TokenFlops: 6 x the weights a token
multiplies by, plus causal attention's 6 x S x q per layer), so recompute is not counted as
useful work. MFU divides a rank's model FLOP/s by the cluster preset's peak for the precision
(cluster.peak_bf16_tflops or peak_fp32_tflops; `local`'s were measured on this CPU).

Peak memory is the allocator's high-water mark on a GPU (torch.cuda.max_memory_allocated) and
the process's peak resident set on CPU (getrusage's ru_maxrss). The plan counts tensors only,
so on CPU the end-of-run table holds it against the peak resident set above what the rank held
before its model was built (the interpreter and libraries are not the plan's); the allocator's
own count is the measured dry run's (trainer/report/allocations.py)."""
from __future__ import annotations

import os
import resource
from dataclasses import dataclass

import torch

from parallel.layout import Layout
from trainer.config import Config
from trainer.plan.cost import TokenFlops
from trainer.plan.hardware import Hardware
from trainer.plan.memory import memory_plan
from trainer.plan.options import EngineOptions
from trainer.units import GiB


def resident_bytes() -> int:
    """The process's resident set now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux counts KiB


@dataclass(frozen=True)
class StepSpeed:
    tokens_per_s: float
    tflops_per_rank: float
    mfu: float
    peak_memory_bytes: int
    data_wait_share: float

    def as_dict(self) -> dict[str, float]:
        return {"tokens_per_s": self.tokens_per_s, "tflops_per_rank": self.tflops_per_rank,
                "mfu": self.mfu, "peak_memory_bytes": self.peak_memory_bytes,
                "data_wait_share": self.data_wait_share}


class Throughput:
    """Made before the rank builds its model (that resident set is the CPU baseline)."""

    def __init__(self, config: Config, layout: Layout, device: torch.device):
        self.config, self.layout, self.device = config, layout, device
        self.flops_per_token = TokenFlops.of(config.model, layout.seq_length).training
        self.peak_flops = Hardware.from_cluster(config.cluster).peak_flops(
            config.train.precision)
        self.baseline = 0 if device.type == "cuda" else resident_bytes()

    def step(self, tokens: int, seconds: float, data_seconds: float) -> StepSpeed:
        """tokens: the whole world's this step; seconds: the step's, data_seconds of them spent
        fetching this rank's samples."""
        tokens_per_s = tokens / seconds
        flops = tokens_per_s * self.flops_per_token / self.layout.world_size
        return StepSpeed(tokens_per_s, flops / 1e12, flops / self.peak_flops,
                         peak_memory_bytes(self.device), data_seconds / seconds)

    def measured_bytes(self) -> int:
        """This rank's figure to hold against the plan's peak (see the module's note)."""
        return max(0, peak_memory_bytes(self.device) - self.baseline)

    def memory_table(self, measured: list[int]) -> list[str]:
        """measured: measured_bytes() of every rank, by rank. One line a pipeline stage: the
        plan's peak, the most any of the stage's ranks measured, and their ratio."""
        options = EngineOptions.from_config(self.config)
        planned = [s["peak_bytes"] for s in
                   memory_plan(self.config.model, self.layout, options)["per_stage"]]
        worst = [0] * len(planned)
        for rank, value in enumerate(measured):
            stage = self.layout.coords(rank).pp
            worst[stage] = max(worst[stage], value)
        what = ("CUDA max allocated" if self.device.type == "cuda" else
                "peak RSS above the rank's RSS before its model was built")
        lines = [f"memory per rank, planned vs measured ({what}):"]
        for stage, (plan, got) in enumerate(zip(planned, worst)):
            lines.append(f"  stage {stage}: planned {plan / GiB:.3f} GiB, measured "
                         f"{got / GiB:.3f} GiB ({got / plan:.2f}x)")
        return lines
