"""The measured dry run: one rank of the configured world, built and stepped in this process.

torch's fake process group lets one process act as rank R of a world of any size: collectives
return at once with the right shapes (parallel.comm zero-fills their outputs), every allocation
is real, so the memory this process uses is what rank R would use. The rank builds its engine
exactly as a real rank does and runs one full training step (every micro-batch) on synthetic
tokens. Figures are high-water marks above the process's memory just before the build: resident
memory on CPU (the kernel's VmHWM, reset first), allocated memory on GPU. On CPU glibc's mmap
threshold is fixed first (PeakMemory.fix_mmap_threshold): by default glibc raises it after every
large free, up to 32 MiB, so freed tensors of that size stay resident and the peak moved by 0.2 of
the plan between runs of one config; fixed, resident memory follows the live tensors. The
baseline is taken after torch's own lazy imports: initialising a parameter on the meta device
imports torch._dynamo on first use (about 75 MB of code and 1.5 s on CPU), which is the
library's, not the rank's, and is imported at the top of this module so it never lands inside
the figures.
On CPU a second step is counted by the allocator itself (trainer.train.allocations): the
transients of its micro-batches and of its optimizer update, beside the plan's terms.
"""
from __future__ import annotations

import ctypes
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch._dynamo  # noqa: F401  (see measure_rank: imported before the baseline)
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from parallel.layout.pipeline_schedules import FORWARD, Action
from trainer.compose.runspec import RunSpec
from trainer.config import Precision
from trainer.plan.cost import estimate
from trainer.plan.hardware import Hardware
from trainer.plan.options import EngineOptions
from trainer.train.allocations import Allocations
from trainer.train.batch import rank_micro_batches
from trainer.train.engine import build_engine
from trainer.train.step import train_step
from trainer.train.throughput import state_bytes, status_bytes
from trainer.units import duration

SLOW_STEP_S = 60.0  # a measured step estimated to take longer is announced, with the fix
Say = Callable[[str], None]


@dataclass
class PeakMemory:
    """High-water mark of this process's memory above a baseline taken at reset()."""

    device: torch.device
    baseline: int = 0

    @staticmethod
    def fix_mmap_threshold(threshold: int = 1 << 20) -> None:
        """Serve blocks from `threshold` bytes up by mmap, returned to the kernel when freed
        (glibc's mallopt(M_MMAP_THRESHOLD); it costs page faults, so only measurements ask)."""
        try:
            libc = ctypes.CDLL("libc.so.6")
        except OSError:  # not glibc: resident memory is that allocator's
            return
        libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD; setting it ends the dynamic threshold

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.baseline = torch.cuda.memory_allocated()
            return
        # Writing 5 to clear_refs resets the kernel's peak RSS to the current RSS (Linux >= 4.0).
        Path("/proc/self/clear_refs").write_text("5")
        self.baseline = status_bytes("VmHWM")

    def above_baseline(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.baseline
        return status_bytes("VmHWM") - self.baseline


def measure_rank(spec: RunSpec, rank: int, step: bool = True,
                 say: Say = lambda line: None) -> dict[str, Any]:
    """Build rank `rank`'s engine against a simulated world and run one training step (with
    step=False: the build only). say: told a line as each part begins and as the step goes."""
    config, layout = spec.config, spec.layout
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
    try:
        gen = torch.Generator().manual_seed(config.data.seed)
        vocab = config.model.vocab_size

        def fetch(samples: list[int]) -> torch.Tensor:
            return torch.randint(0, vocab, (len(samples), layout.seq_length + 1), generator=gen)

        micro_batches = rank_micro_batches(  # the loader's output
            fetch, layout, rank, device, mtp_depths=config.model.mtp_num_layers or 0)
        peak = PeakMemory(device)
        if device.type == "cpu":
            peak.fix_mmap_threshold()
        peak.reset()
        say(f"measuring rank {rank} of a simulated world of {layout.world_size} on "
            f"{device.type}: building its engine")
        start = time.perf_counter()
        engine = build_engine(config.model, config.optim, config.train.seed, layout,
                              device, EngineOptions.from_config(config), peft=config.peft)
        build_s = time.perf_counter() - start
        figures = {"rank": rank, "world_size": layout.world_size, "device": device.type,
                   "build_s": round(build_s, 3), "build_peak_bytes": peak.above_baseline()}
        say(f"  built in {build_s:.1f} s ({figures['build_peak_bytes'] / 2**30:.3f} GiB above "
            f"the start)")
        if not step:
            return figures
        start = time.perf_counter()
        engine.model.runner.measure = True  # the activations the schedule keeps at once
        steps = 2 if device.type == "cpu" else 1  # on CPU the allocator counts a second
        engine.model.runner.progress = _Progress("step 1", say, steps)
        # The schedule's values of a run's first two steps (their sizes do not depend on them).
        second = spec.layout.global_batch_size
        train_step(engine.model, engine.optimizer, micro_batches, spec.schedule.lr(0),
                   engine.model.runner.progress.mark, spec.weight_decay.weight_decay(0))
        figures.update(step_s=round(time.perf_counter() - start, 3),
                       step_peak_bytes=peak.above_baseline(), state_bytes=state_bytes(engine),
                       activation_bytes=engine.model.runner.peak_saved_bytes,
                       in_flight=engine.model.runner.peak_in_flight,
                       message_bytes=engine.model.runner.peak_message_bytes)
        if device.type == "cpu":
            # A second step counted by the allocator, above the state the first one made (the
            # profiler's own buffers would show in the first step's resident memory).
            progress = engine.model.runner.progress = _Progress(
                "step 2 (counted by the allocator)", say)
            with Allocations() as counted:
                train_step(engine.model, engine.optimizer, micro_batches,
                           spec.schedule.lr(second),
                           lambda phase: (counted.mark(phase), progress.mark(phase)),
                           spec.weight_decay.weight_decay(second))
            figures.update(step_transient_bytes=counted.phase("micro_batches").transient_bytes,
                           update_transient_bytes=counted.phase("update").transient_bytes)
        return figures
    finally:
        dist.destroy_process_group()


class _Progress:
    """A step's progress lines: each forward or backward of the schedule, at most one a second
    (and the last), then the optimizer update."""

    def __init__(self, step: str, say: Say, steps: int = 0):
        """steps: how many steps the measurement runs, for the time it takes in all (said
        after the first forward of the first step; 0: not said)."""
        self.step, self.say, self.steps = step, say, steps
        self.started = self.said = time.perf_counter()

    def __call__(self, done: int, total: int, action: Action) -> None:
        now = time.perf_counter()
        if done == 1 and action.kind == FORWARD and self.steps:  # a backward: two forwards
            left = (now - self.started) * 3 * (total // 2) * self.steps
            self.say(f"  {self.step}: the first forward took {now - self.started:.1f} s: at "
                     f"this pace the measurement takes about {duration(left)} in all")
        if done == total or now - self.said >= 1.0:
            self.said = now
            kind = "forward" if action.kind == FORWARD else "backward"
            self.say(f"  {self.step}: {done}/{total} passes done ({kind} of micro-batch "
                     f"{action.microbatch + 1}, chunk {action.chunk}), "
                     f"{now - self.started:.1f} s")

    def mark(self, phase: str) -> None:
        if phase == "update":
            self.say(f"  {self.step}: optimizer update, "
                     f"{time.perf_counter() - self.started:.1f} s")


def matmul_flops(precision: Precision, seconds: float = 0.25) -> float:
    """FLOP/s of this CPU's matrix products in the precision's dtype (timed for `seconds`)."""
    dtype = torch.bfloat16 if precision is Precision.bf16 else torch.float32
    a = torch.randn(512, 512).to(dtype)
    a @ a  # first call: thread pool and kernel selection
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ a
        count += 1
    return 2 * 512**3 * count / (time.perf_counter() - start)


def slow_step_warning(spec: RunSpec) -> str | None:
    """One line when the measured dry run's steps will take more than SLOW_STEP_S on this CPU,
    with the fix; None on GPU or when quick. A lower bound: the plan's model FLOPs of the
    slowest stage at this CPU's measured matmul rate (copies and fills of gathered weights
    come on top; the first forward's pace gives the real figure, _Progress)."""
    if torch.cuda.is_available():
        return None
    config = spec.config
    options = EngineOptions.from_config(config)
    rates = {p: matmul_flops(p) for p in {options.precision, Precision.fp32}}

    def steps_s(precision: Precision) -> float:
        here = dataclasses.replace(  # this CPU: its measured rate, and every rank's to itself
            Hardware.from_cluster(config.cluster), peak_bf16_tflops=rates[precision] / 1e12,
            peak_fp32_tflops=rates[precision] / 1e12, compute_efficiency=1.0,
            ranks_per_core=1.0)
        chosen = dataclasses.replace(options, precision=precision)
        return 2 * estimate(config.model, spec.layout, chosen, here).seconds["compute"]

    took = steps_s(options.precision)
    if took <= SLOW_STEP_S:
        return None
    name = options.precision.value
    fix = (f"train.precision=fp32 measures the same sizes in about "
           f"{duration(steps_s(Precision.fp32))}" if options.precision is not Precision.fp32
           else "fewer layers (model.num_layers) or a shorter train.seq_length measure a "
                "smaller step")
    return (f"{name} matrix products run at {rates[options.precision] / 1e9:.1f} GFLOP/s on "
            f"this CPU: measuring this rank's step (twice on CPU) will take at least "
            f"{duration(took)}; {fix}")

