"""What people compare trainers by, measured each step on each rank: model FLOP/s per rank and
MFU, the rank's peak memory, and the share of the step spent waiting for data; at the end of a
run, each pipeline stage's measured peak beside the memory plan's.

Model FLOPs are counted from the config (trainer.plan.cost.TokenFlops: 6 x the weights a token
multiplies by, plus causal attention's 6 x S x q per layer; under peft=lora 4 x the frozen
weights and 6 x the adapters; with train.objective=dpo the reference's forward, 2 x the weights
more), so recompute is not counted as useful work. MFU divides a rank's model FLOP/s by the
cluster preset's peak for the precision (cluster.peak_bf16_tflops or peak_fp32_tflops; `local`'s
were measured on this CPU).

Peak memory is the allocator's high-water mark on a GPU (torch.cuda.max_memory_allocated) and
the process's own peak resident set on CPU (the kernel's VmHWM: getrusage's ru_maxrss of a rank
that a larger process spawned starts at that process's peak, carried across exec). The plan
counts tensors only, so the end-of-run table holds like with like: the state each rank holds,
counted tensor by tensor, against the plan's state; the peak against the plan's peak on a GPU,
and on CPU the resident set's growth is printed beside it, with what it holds beyond tensors
(the allocator's count of a step is the measured dry run's: trainer/train/allocations.py)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from parallel.layout import Layout
from trainer.config import Config
from trainer.parts.lora import Adapters
from trainer.plan.cost import TokenFlops
from trainer.plan.hardware import Hardware
from trainer.train.engine import Engine
from trainer.units import size

_STATUS = Path("/proc/self/status")


def status_bytes(field: str) -> int:
    """A size of /proc/self/status (Linux), such as VmRSS or VmHWM, in bytes."""
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"{_STATUS} has no {field}: cannot measure resident memory here")


def resident_bytes() -> int:
    """The process's resident set now (Linux)."""
    return status_bytes("VmRSS")


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return status_bytes("VmHWM")  # this process's own (see the module's note)


def state_bytes(engine: Engine) -> int:
    """Parameters, gradients and optimizer state a rank's engine really allocated."""
    optimizer, model = engine.optimizer, engine.model
    total = sum(b.params.nbytes + b.grads.nbytes for b in optimizer.buffers)
    for name in model.stage_copies:  # tied embeddings: the last stage's copy and its gradient
        param = model.module.get_parameter(name)
        total += param.nbytes + (param.grad.nbytes if param.grad is not None else 0)
    # frozen parameters (peft=lora's base): outside the optimizer, each its own tensor
    total += sum(p.nbytes for n, p in model.module.named_parameters()
                 if not p.requires_grad and n not in model.stage_copies)
    return total + sum(t.nbytes for t in optimizer.state_tensors())


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

    def __init__(self, config: Config, layout: Layout, device: torch.device,
                 planned: list[dict]):
        """planned: the memory plan's per_stage (RunSpec.memory, planned by settle)."""
        self.config, self.layout, self.device, self.planned = config, layout, device, planned
        flops = TokenFlops.of(config.model, layout.seq_length, Adapters.of(config.peft))
        # train.objective=dpo: each token also runs the reference's forward
        self.flops_per_token = flops.training + (
            flops.forward if config.train.objective == "dpo" else 0.0)
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

    def measured_bytes(self, engine: Engine, reference=None) -> list[int]:
        """This rank's [state it holds, peak above the baseline] (see the module's note);
        reference: DPO's frozen copy of the model (a ParallelModel), held beside."""
        held = sum(p.nbytes for p in reference.parameters()) if reference is not None else 0
        return [state_bytes(engine) + held,
                max(0, peak_memory_bytes(self.device) - self.baseline)]

    def memory_table(self, measured: list[list[int]]) -> list[str]:
        """measured: measured_bytes() of every rank, by rank. One line a pipeline stage: the
        plan's state and peak, each beside the most any of the stage's ranks measured."""
        planned = self.planned
        worst = [[0, 0] for _ in planned]
        for rank, values in enumerate(measured):
            stage = worst[self.layout.coords(rank).pp]
            stage[:] = [max(a, b) for a, b in zip(stage, values)]
        cuda = self.device.type == "cuda"
        lines = ["memory per rank, planned (layout.json's memory.per_stage: tensors) vs this run:"]
        for plan, (state, peak) in zip(planned, worst):
            measured_peak = (f"CUDA max allocated {size(peak)} ({peak / plan['peak_bytes']:.2f}x)"
                             if cuda else f"resident set grew {size(peak)}")
            lines.append(f"  stage {plan['stage']}: state planned {size(plan['total_bytes'])}, "
                         f"held {size(state)} ({state / plan['total_bytes']:.2f}x); peak "
                         f"planned {size(plan['peak_bytes'])}, {measured_peak}")
        lines.append(
            "  (held: the weights, gradients and optimizer state each rank holds, counted tensor "
            "by tensor; " + ("max allocated counts tensors too)" if cuda else
                             "resident set: the rank's process since before its model was built, "
                             "the tensors and the interpreter's, libraries' and C allocator's "
                             "growth, which the plan does not count; dry_run_rank=R counts a "
                             "step's tensors by the allocator)"))
        return lines
