"""What a rank allocates, counted by torch's own allocator rather than read off the process.

With profile_memory, torch's profiler records every allocation and free of the CPU allocator
with its bytes. Replayed in order they give the bytes alive at every point of a step, to the
byte: no resident pages, no freed memory the C library keeps. Marks split the replay into
phases (the micro-batches, the optimizer update, or a block's backward), so each term of the
memory plan can be held against the phase where it is alive. Figures are bytes alive above
what existed when counting started (a rank's state, its inputs).
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile, record_function

MARK = "gtp_trainer.mark "  # the name of a mark's (empty) range in the profiler's events


@dataclass(frozen=True)
class Phase:
    label: str
    start_bytes: int  # alive when it began
    peak_bytes: int  # the most alive at once during it
    end_bytes: int  # alive when it ended

    @property
    def transient_bytes(self) -> int:
        """The most it held beyond what it began and ended with: what it made and let go
        (what it keeps, such as AdamW's moments made by the first update, is state)."""
        return self.peak_bytes - max(self.start_bytes, self.end_bytes)


class Allocations:
    """Counts what the CPU allocator holds while the `with` block runs; `mark(label)` starts a
    phase of that name (the first is "start")."""

    def __init__(self) -> None:
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.phases: list[Phase] = []

    def __enter__(self) -> Allocations:
        with _quiet_stderr():
            self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        with _quiet_stderr():
            self._profile.__exit__(*exc)
        if exc[0] is None:
            self.phases = self._replay()

    @staticmethod
    def mark(label: str) -> None:
        with record_function(MARK + label):
            pass

    def phase(self, label: str) -> Phase:
        """The phase of that label at its most (a label marked more than once: its highest)."""
        matching = [p for p in self.phases if p.label == label]
        if not matching:
            raise KeyError(f"no phase {label!r} was marked (marked: "
                           f"{sorted({p.label for p in self.phases})})")
        return max(matching, key=lambda p: p.peak_bytes)

    def _replay(self) -> list[Phase]:
        events = sorted(self._profile.profiler.kineto_results.events(), key=lambda e: e.start_ns())
        phases, label, start = [], "start", 0
        alive = peak = 0
        for event in events:
            name = event.name()
            if name == "[memory]":
                if event.device_type() == torch._C._autograd.DeviceType.CPU:
                    alive += event.nbytes()
                    peak = max(peak, alive)
            elif name.startswith(MARK):
                phases.append(Phase(label, start, peak, alive))
                label, start, peak = name[len(MARK):], alive, alive
        phases.append(Phase(label, start, peak, alive))
        return phases


@contextmanager
def _quiet_stderr():
    """The profiler's C++ side logs a line to the process's stderr as it starts and stops;
    those lines say nothing to a person reading a dry run."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
