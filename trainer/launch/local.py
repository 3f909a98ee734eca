"""Ranks started on this machine by launch.py, which supervises them: a rank that fails stops
the others and is named (a hang by the line its watch wrote: trainer.train.hangs); stop signals
are forwarded, and a second interrupt kills the ranks at once; SIGUSR1 asks every rank for its
stacks. The ranks never outlive launch.py, however it dies (kill -9 included).
"""
from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.errors import CompactHydraException

from trainer.compose.runspec import RunSpec
from trainer.config import ConfigError
from trainer.launch.ranks import RankEnv, cpu_threads, run_rank
from trainer.launch.requeue import record_restart, resume_step
from trainer.train.hangs import (
    DUMP_SIGNAL,
    HUNG_EXIT,
    SUMMARY,
    hold_dump_signal,
    request_stacks,
    stacks_folder,
)
from trainer.train.signals import (
    INTERRUPTED_EXIT_CODES,
    INTERRUPTS,
    STOP_SIGNALS,
    Interrupted,
    PreemptionWatch,
    hard_stop_line,
)

POLL_S = 0.05
# A rank ignores stop signals until its watch is up (it inherits SIG_IGN from the start), so the
# parent repeats a stop signal this often until the ranks have stopped.
REPEAT_S = 1.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h
DONE_CODES = frozenset({0}) | INTERRUPTED_EXIT_CODES  # a rank that stopped as it was asked to


class RankFailed(CompactHydraException):
    """A rank of a run started here failed; the message names it and its error. restartable:
    a death, a hang or an unexpected error (cluster.max_restarts may try again), not an error
    the rank explained in one line (a diverged run, a full disk: a restart would meet it
    again)."""

    def __init__(self, message: str, restartable: bool = True):
        super().__init__(message)
        self.restartable = restartable


def check_local(spec: RunSpec) -> None:
    """Before anything of the run is written: launch.py starts ranks on this machine only."""
    if spec.config.cluster.num_nodes != 1:
        raise ConfigError(
            f"cluster.num_nodes={spec.config.cluster.num_nodes}: launch.py starts processes on "
            f"this machine only. Fix: set cluster.num_nodes=1, or start the ranks with torchrun "
            f"on each node, or with SLURM (-m hydra/launcher=slurm).")


def launch_local(spec: RunSpec, run_dir: Path, meta: dict[str, Any]) -> None:
    """Start every rank on this machine and supervise them (check_local passed). A failed or
    hung rank stops them all; under cluster.max_restarts = N they start again, resuming from
    the latest checkpoint (checkpoint.resume), up to N times, each restart one line on the
    console and one row of the run folder's restarts.jsonl."""
    most = spec.config.cluster.max_restarts
    for restart in range(most + 1):
        try:
            _start_and_supervise(spec, run_dir, meta)
            return
        except RankFailed as failure:
            if not failure.restartable or restart == most:
                if restart:
                    raise RankFailed(f"{failure} That was failure {restart + 1} of the run: "
                                     f"all cluster.max_restarts={most} restart(s) were used.",
                                     False) from None
                raise
            step = resume_step(spec, run_dir)
            where = f"step {step}" if step is not None else "the start (no checkpoint yet)"
            line = (f"restart {restart + 1} of cluster.max_restarts={most}: {failure} "
                    f"Resuming from {where}.")
            print(line, flush=True)
            record_restart(run_dir, {"restart": restart + 1, "failure": str(failure),
                                     "resumed_from_step": step or 0})


def _start_and_supervise(spec: RunSpec, run_dir: Path, meta: dict[str, Any]) -> None:
    layout = spec.layout
    context = multiprocessing.get_context("spawn")
    errors = context.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="gtp-rendezvous-") as meeting:
        init = f"file://{meeting}/store"
        procs = [context.Process(
            target=_local_rank_main, name=f"rank{r}",
            args=(RankEnv(r, layout.world_size, r, init, "launch.py"), spec, run_dir, meta,
                  errors, os.getpid())) for r in range(layout.world_size)]
        # SIG_IGN is the one disposition a spawned process inherits: a signal that reaches a rank
        # before its watch is up (ctrl-C reaches every process of the terminal's group) must not
        # kill it half-started. The parent ignores them only until _supervise's handlers are up.
        previous = {s: signal.signal(s, signal.SIG_IGN) for s in STOP_SIGNALS}
        try:
            for proc in procs:
                proc.start()
            print("started " + ", ".join(f"rank {r} (pid {p.pid})" for r, p in enumerate(procs)),
                  flush=True)
            threads = cpu_threads(spec.config.cluster.procs_per_node)
            if threads is not None:
                print(f"each rank computes with {threads} CPU thread(s): {len(procs)} "
                      f"ranks share this machine's {len(os.sched_getaffinity(0))} CPUs "
                      f"(OMP_NUM_THREADS sets another count)", flush=True)
            _supervise(procs, errors, run_dir)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def _local_rank_main(env: RankEnv, spec: RunSpec, run_dir: Path, meta: dict[str, Any],
                     errors: Any, parent: int) -> None:
    """Body of a process started by launch_local; reports its error to the parent."""
    _die_with_parent(parent)
    hold_dump_signal()  # before any thread starts (trainer.train.hangs)
    code = 0
    with PreemptionWatch(hard_stop=False) as watch:  # the parent does the hard stop
        try:
            run_rank(env, spec, run_dir, meta, watch)
        except Interrupted as stop:  # saved as asked; the parent prints rank 0's line
            errors.put((env.rank, str(stop), True))
            code = stop.exit_code
        except BaseException as error:  # noqa: BLE001  (every failure must reach the parent)
            expected = isinstance(error, CompactHydraException)  # said in a line: not retried
            if not expected:
                traceback.print_exc()
            errors.put((env.rank, f"{type(error).__name__}: {error}".strip(), expected))
            code = 1
    _leave(code)


def _leave(code: int) -> None:
    """End the rank without the interpreter's teardown. By now its process groups are
    destroyed, its files closed and its error (if any) written to the parent's queue (a
    SimpleQueue: written at put, no feeder thread to wait for); what teardown would
    still do is destroy torch's leftover C++ objects in no fixed order, and gloo's threads
    destroyed that way abort a rank that has finished (std::terminate, SIGABRT: seen in CI
    about once in a dozen 2-rank runs), which the parent would report as its failure."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _die_with_parent(parent: int) -> None:
    """Linux kills this process (SIGKILL) when launch.py dies, however it dies: no rank keeps a
    GPU or a port busy after its run is gone. If launch.py died before prctl took effect, this
    process is already someone else's child, and nobody would stop it: exit now."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        os._exit(1)


@dataclass
class _Stop:
    """The stop signals the parent got: it forwards them and repeats them until ranks exit."""

    signum: int | None = None  # the first stop signal
    interrupt: int | None = None  # the first SIGINT/SIGTERM
    hard: int | None = None  # the second SIGINT/SIGTERM: the ranks were killed
    forwarded: float = 0.0


def _supervise(procs: list, errors: Any, run_dir: Path) -> None:
    stop = _Stop()

    def on_dump_signal(signum: int, frame: Any) -> None:
        request_stacks(run_dir, "SIGUSR1 to launch.py")
        print(f"SIGUSR1: every rank writes its Python stacks to {stacks_folder(run_dir)}/"
              f"rank_R.txt; the run goes on", flush=True)

    def on_signal(signum: int, frame: Any) -> None:
        if signum in INTERRUPTS and stop.interrupt is not None:
            stop.hard = signum
            _signal_all(procs, signal.SIGKILL)
            return
        if signum in INTERRUPTS:
            stop.interrupt = signum
        stop.signum = stop.signum or signum
        stop.forwarded = time.monotonic()
        _signal_all(procs, signum)

    for signum in STOP_SIGNALS:
        signal.signal(signum, on_signal)  # launch_local restores the handlers from before
    previous_dump = signal.signal(DUMP_SIGNAL, on_dump_signal)
    try:
        while any(p.exitcode is None for p in procs) and stop.hard is None:
            failed = [(r, p) for r, p in enumerate(procs) if p.exitcode not in (None, *DONE_CODES)]
            if failed:
                _stop(procs)
                raise _hang(failed, run_dir) or _failure(failed, _reported(errors), len(procs))
            if stop.signum is not None and time.monotonic() - stop.forwarded > REPEAT_S:
                stop.forwarded = time.monotonic()
                _signal_all(procs, stop.interrupt or stop.signum)
            time.sleep(POLL_S)
        if stop.hard is not None:
            raise Interrupted(hard_stop_line(stop.hard), stop.hard)
        reported = _reported(errors)
        failed = [(r, p) for r, p in enumerate(procs) if p.exitcode not in DONE_CODES]
        if failed:
            raise _hang(failed, run_dir) or _failure(failed, reported, len(procs))
        codes = {p.exitcode for p in procs}
        if codes & INTERRUPTED_EXIT_CODES:
            signum = stop.interrupt or max(codes) - 128
            said = reported.get(0, (f"interrupted by {signal.Signals(signum).name}", True))
            raise Interrupted(said[0], signum)
    finally:
        signal.signal(DUMP_SIGNAL, previous_dump)
        _stop(procs)


def _hang(failed: list, run_dir: Path) -> RankFailed | None:
    """The summary a rank's hang watch wrote before it ended the run with HUNG_EXIT."""
    if not any(p.exitcode == HUNG_EXIT for _, p in failed):
        return None
    try:
        line = (stacks_folder(run_dir) / SUMMARY).read_text().strip()
    except OSError:
        return None
    return RankFailed(line + " The ranks were stopped.")


def _signal_all(procs: list, signum: int) -> None:
    for proc in procs:
        if proc.pid is not None and proc.exitcode is None:
            try:
                os.kill(proc.pid, signum)
            except ProcessLookupError:
                pass  # exited since exitcode was read


def _stop(procs: list) -> None:
    """SIGKILL what is left: a rank without its peers cannot finish a step, let alone save."""
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join()


def _reported(errors: Any) -> dict[int, tuple[str, bool]]:
    """What ranks put on the queue: (their line, whether it is an error they expected)."""
    reported: dict[int, tuple[str, bool]] = {}
    while not errors.empty():
        rank, text, expected = errors.get()
        reported.setdefault(rank, (text, expected))  # insertion order: first reported first
    return reported


def _failure(failed: list, reported: dict[int, tuple[str, bool]], world: int) -> RankFailed:
    """Name the rank that failed first: a rank killed by a signal says nothing, and the others
    then fail on their next collective ("connection closed"), so a silent death is the cause;
    otherwise the first error reported is."""
    ranks = {r for r, _ in failed}
    said = {r: said for r, said in reported.items() if r in ranks}  # not a stopped rank's line
    silent = [(r, p) for r, p in failed if r not in said]
    if silent:
        rank, proc = silent[0]
        why, expected = (f"killed by {signal.Signals(-proc.exitcode).name}" if proc.exitcode < 0
                         else f"exited with code {proc.exitcode}"), False
    else:
        rank, (why, expected) = next(iter(said.items()))
    others = sorted(r for r, _ in failed if r != rank)
    also = f" (then rank(s) {', '.join(map(str, others))} failed too)" if others else ""
    return RankFailed(f"rank {rank} of {world} failed: {why.rstrip('.')}{also}. The other "
                      f"ranks were stopped.", restartable=not expected)
