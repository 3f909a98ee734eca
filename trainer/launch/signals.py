"""Preemption: on SIGUSR2 (what SLURM sends ahead of a time limit or preemption; submitit's
default) the run saves a checkpoint at the next step boundary and exits cleanly. Under submitit,
the handler that submitit installed is then called, so it requeues the job; the requeued job
resumes from the checkpoint (checkpoint.resume).
"""
from __future__ import annotations

import signal
from typing import Any

SIGNAL = signal.SIGUSR2


class PreemptionWatch:
    """Records that the signal arrived; the trainer decides, with every rank, when to stop."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def _handler(self, signum: int, frame: Any) -> None:
        self.requested = True

    def __enter__(self) -> PreemptionWatch:
        self._previous = signal.signal(SIGNAL, self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        signal.signal(SIGNAL, self._previous)

    def hand_over(self) -> None:
        """After the checkpoint: give the signal to whoever handled it before us (submitit's
        requeue on rank 0; it exits the process). Without such a handler, nothing to do."""
        if callable(self._previous):
            self._previous(SIGNAL, None)
