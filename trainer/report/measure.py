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
On CPU a second step is counted by the allocator itself (trainer.report.allocations): the
transients of its micro-batches and of its optimizer update, beside the plan's terms.
"""
from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch._dynamo  # noqa: F401  (see measure_rank: imported before the baseline)
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from trainer.compose.runspec import RunSpec
from trainer.data.batch import rank_micro_batches
from trainer.plan.options import EngineOptions
from trainer.report.allocations import Allocations
from trainer.train.engine import Engine, build_engine
from trainer.train.step import train_step

_STATUS = Path("/proc/self/status")


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
        self.baseline = self._status("VmHWM")

    def above_baseline(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.baseline
        return self._status("VmHWM") - self.baseline

    @staticmethod
    def _status(field: str) -> int:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
        raise RuntimeError(f"{_STATUS} has no {field}: cannot measure resident memory here")


def state_bytes(engine: Engine) -> int:
    """Parameters, gradients and optimizer state this rank really allocated."""
    optimizer, model = engine.optimizer, engine.model
    total = sum(b.params.nbytes + b.grads.nbytes for b in optimizer.buffers)
    for name in model.stage_copies:  # tied embeddings: the last stage's copy and its gradient
        param = model.module.get_parameter(name)
        total += param.nbytes + (param.grad.nbytes if param.grad is not None else 0)
    for state in optimizer.adam.state.values():
        total += sum(v.nbytes for v in state.values() if isinstance(v, torch.Tensor) and v.ndim)
    return total


def measure_rank(spec: RunSpec, rank: int, step: bool = True) -> dict[str, Any]:
    """Build rank `rank`'s engine against a simulated world and run one training step (with
    step=False: the build only)."""
    config, layout = spec.config, spec.layout
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
    try:
        gen = torch.Generator().manual_seed(config.data.seed)
        vocab = config.model.vocab_size

        def fetch(samples: list[int]) -> torch.Tensor:
            return torch.randint(0, vocab, (len(samples), layout.seq_length + 1), generator=gen)

        micro_batches = rank_micro_batches(fetch, layout, rank, device)  # the loader's output
        peak = PeakMemory(device)
        if device.type == "cpu":
            peak.fix_mmap_threshold()
        peak.reset()
        start = time.perf_counter()
        engine = build_engine(config.model, config.optim, config.train.seed, layout,
                              device, EngineOptions.from_config(config))
        build_s = time.perf_counter() - start
        figures = {"rank": rank, "world_size": layout.world_size, "device": device.type,
                   "build_s": round(build_s, 3), "build_peak_bytes": peak.above_baseline()}
        if not step:
            return figures
        start = time.perf_counter()
        engine.model.runner.measure = True  # the activations the schedule keeps at once
        train_step(engine.model, engine.optimizer, micro_batches, spec.schedule.lr(0))
        figures.update(step_s=round(time.perf_counter() - start, 3),
                       step_peak_bytes=peak.above_baseline(), state_bytes=state_bytes(engine),
                       activation_bytes=engine.model.runner.peak_saved_bytes,
                       in_flight=engine.model.runner.peak_in_flight,
                       message_bytes=engine.model.runner.peak_message_bytes)
        if device.type == "cpu":
            # A second step counted by the allocator, above the state the first one made (the
            # profiler's own buffers would show in the first step's resident memory).
            with Allocations() as counted:
                train_step(engine.model, engine.optimizer, micro_batches, spec.schedule.lr(1),
                           counted.mark)
            figures.update(step_transient_bytes=counted.phase("micro_batches").transient_bytes,
                           update_transient_bytes=counted.phase("update").transient_bytes)
        return figures
    finally:
        dist.destroy_process_group()
