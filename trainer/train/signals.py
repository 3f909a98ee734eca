"""Stop signals of a rank. SIGUSR2 (what SLURM sends ahead of a time limit or preemption;
submitit's default) saves a checkpoint at the next step boundary and exits 0, so submitit can
requeue the job; SIGINT (ctrl-C) and SIGTERM (kill, scancel) save the same way and exit
non-zero. A second interrupt stops at once, without saving. The watch only records (and counts
interrupts); the trainer decides, with every rank, when to stop (trainer.train.loop), and the
same command resumes from the checkpoint.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from hydra.errors import CompactHydraException

PREEMPT = signal.SIGUSR2
INTERRUPTS = (signal.SIGINT, signal.SIGTERM)
# Ranks can see different signals (`kill -INT` to one torchrun worker): they agree on the
# strongest, in this order, so that every rank stops at the same step and the same way.
STOP_SIGNALS = (PREEMPT, signal.SIGTERM, signal.SIGINT)
# torchrun's agent forwards the ctrl-C its workers already got from the terminal: the same
# signal twice within this window is one ctrl-C, not the second that stops at once.
DUPLICATE_S = 0.5
TEE_S = 0.2  # before a hard stop's exit: time for a console tee's thread to copy the last line


class Interrupted(CompactHydraException):
    """SIGINT or SIGTERM stopped the run (a checkpoint is saved unless it was the second)."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM


INTERRUPTED_EXIT_CODES = frozenset(128 + s for s in INTERRUPTS)


def hard_stop_line(signum: int) -> str:
    return (f"interrupted by a second {signal.Signals(signum).name}: stopped at once, without "
            f"saving; run the same command again to resume from the last checkpoint")


def code_of(signum: int | None) -> int:
    """A number every rank can all-reduce with MAX: 0 for none, then STOP_SIGNALS' order."""
    return 0 if signum is None else STOP_SIGNALS.index(signum) + 1


def signal_of(code: int) -> int | None:
    return STOP_SIGNALS[code - 1] if code else None


class PreemptionWatch:
    """Records the stop signals that arrive while the block runs.

    hard_stop=True (a process nobody supervises: a one-process run, torchrun and submitit
    ranks): a second interrupt exits the process at once. False (ranks started by launch.py):
    the parent forwards every signal, repeats it and does the hard stop itself, so a rank only
    records; the signals of a terminal's ctrl-C, which reach the parent and every rank, and the
    parent's forwarded copies are then all the same request."""

    def __init__(self, hard_stop: bool = True) -> None:
        self.hard_stop = hard_stop
        self.signum: int | None = None  # the strongest stop signal so far
        self._first_interrupt: float | None = None
        self._previous: dict[int, Any] = {}
        self._wakeup: tuple[int, int] | None = None  # (previous wakeup fd, our pipe's write end)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handler(self, signum: int, frame: Any) -> None:
        if code_of(signum) > code_of(self.signum):
            self.signum = signum

    def __enter__(self) -> PreemptionWatch:
        self._previous = {s: signal.signal(s, self._handler) for s in STOP_SIGNALS}
        if self.hard_stop:
            self._watch_for_a_second_interrupt()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._first_interrupt is not None:
            return  # stopping: a second interrupt during the exit must still stop at once
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if self._wakeup is not None:
            previous, write_end = self._wakeup
            signal.set_wakeup_fd(previous)
            os.close(write_end)  # the thread reads EOF and ends

    def _watch_for_a_second_interrupt(self) -> None:
        """Python runs a signal handler only between bytecodes of the main thread, which can sit
        in one C call (a collective waiting for a rank that is gone) until cluster.timeout_s.
        The C-level handler also writes each signal's number to the wakeup fd at once: a thread
        reading it can count interrupts, and exit, whatever the main thread is doing."""
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)  # set_wakeup_fd's requirement
        self._wakeup = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False), write_end
        threading.Thread(target=self._count_interrupts, args=(read_end,), daemon=True,
                         name="second-interrupt").start()

    def _count_interrupts(self, read_end: int) -> None:
        while data := os.read(read_end, 64):
            for signum in data:
                if signum not in INTERRUPTS:
                    continue
                now = time.monotonic()
                if self._first_interrupt is None:
                    self._first_interrupt = now
                elif now - self._first_interrupt > DUPLICATE_S:
                    # os.write: the main thread may hold sys.stderr's lock. The pause lets a tee
                    # of the console (trainer.report.console), a thread too, copy the line.
                    os.write(2, (hard_stop_line(signum) + "\n").encode())
                    time.sleep(TEE_S)
                    os._exit(128 + signum)  # no cleanup: the user asked not to wait for any
        os.close(read_end)

    def hand_over(self) -> None:
        """After the checkpoint of a preemption: give the signal to whoever handled it before us
        (submitit's requeue on rank 0; it exits the process). Without such a handler, nothing."""
        previous = self._previous.get(PREEMPT)
        if callable(previous):
            previous(PREEMPT, None)
