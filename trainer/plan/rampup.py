"""Batch-size ramp-up (Megatron's --rampup-batch-size START INCREMENT SAMPLES): the global batch
of the step that starts at c consumed samples, as Megatron-Core's
RampupBatchsizeNumMicroBatchesCalculator gives it, and the compose-time rules that calculator
asserts at run time. Pure integers and floats, no torch; the layout's batch parallel size and
micro-batch size stay, the number of micro-batches follows the batch.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from parallel.layout import Layout, LayoutError

KEY = "train.rampup_batch_size"


@dataclass(frozen=True)
class BatchRamp:
    start: int  # the first steps' global batch
    increment: int  # what each increase adds
    samples: int  # consumed samples over which the batch reaches `target`
    target: int  # train.global_batch_size, the batch after the ramp

    @classmethod
    def from_config(cls, values: list[int] | None, layout: Layout) -> BatchRamp | None:
        """None without a ramp. Every rule is one line naming the key and the fix."""
        if values is None:
            return None
        shown = f"{KEY}={list(values)}"
        if len(values) != 3:
            raise ValueError(f"{shown} must be three numbers [start, increment, samples] "
                             f"(Megatron's --rampup-batch-size). Fix: e.g. {KEY}=[16,16,10000], "
                             "or null for no ramp-up.")
        start, increment, samples = values
        target = layout.global_batch_size
        if min(start, increment, samples) < 1:
            raise ValueError(f"{shown}: start, increment and samples must each be >= 1 (Megatron "
                             "divides by the ramp's samples). Fix: set them so, or null for no "
                             "ramp-up.")
        if start >= target:
            raise ValueError(f"{shown} starts at {start}, not below train.global_batch_size="
                             f"{target} (the batch it ramps up to): nothing would ramp. Fix: a "
                             f"smaller start, a larger train.global_batch_size, or {KEY}=null.")
        if (target - start) % increment:
            raise ValueError(f"{shown}: the ramp from {start} to train.global_batch_size={target}"
                             f" ({target - start}) is not whole increments of {increment}. Fix: "
                             f"an increment that divides {target - start}, or another start.")
        ramp = cls(start, increment, samples, target)
        for size in range(start, target, increment):
            try:  # whole micro-batches on every batch lane (and interleaving's multiples of PP)
                replace(layout, global_batch_size=size)
            except LayoutError as error:
                raise ValueError(f"{shown} ramps through a global batch of {size}, which this "
                                 f"layout cannot run: {str(error).split(' Fix:')[0]} Fix: a "
                                 f"start and increment that are multiples of "
                                 f"train.micro_batch_size x batch_parallel_size = "
                                 f"{layout.micro_batch_times_batch_parallel_size}.") from None
        return ramp

    def global_batch(self, consumed: int) -> int:
        """Megatron's current global batch once `consumed` samples are consumed (its update():
        the float division and int() are its own, so a boundary falls where it falls there)."""
        if consumed > self.samples:
            return self.target
        return self.start + int(consumed / self.samples_per_increment) * self.increment

    @property
    def samples_per_increment(self) -> float:
        """Megatron's rampup_samples_per_increment: a float, as its update() divides by it."""
        return self.samples / ((self.target - self.start) // self.increment)

    def steps(self, consumed: int, end: int) -> list[tuple[int, int]]:
        """(consumed, batch) of each step from `consumed` while the ramp lasts, up to `end`
        samples (the last one cut to what is left); the steps after it are the target's."""
        steps = []
        while consumed < end and consumed <= self.samples:
            steps.append((consumed, min(self.global_batch(consumed), end - consumed)))
            consumed += steps[-1][1]
        return steps

    def describe(self) -> str:
        return (f"batch ramp-up {self.start} to {self.target} by {self.increment} every "
                f"{self.samples_per_increment:,.6g} samples "
                f"({KEY}=[{self.start},{self.increment},{self.samples}])")
