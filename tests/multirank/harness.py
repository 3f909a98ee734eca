"""Run a function on N gloo ranks from inside a pytest test: forked processes meeting through a
per-call FileStore (no ports), one overall deadline, the failing rank's traceback re-raised."""
from __future__ import annotations

import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["run_ranks", "RankFailure", "RankTimeout"]

_STACK_GRACE_S = 1.0  # how long a hung rank gets to dump its stacks before it is killed


class RankFailure(AssertionError):
    """One or more ranks raised or died. `ranks`: the failing ranks, likely cause first (the
    ranks that ended on their own while the others were being killed come last); `errors`:
    rank -> traceback or exit description; `exitcodes`: rank -> exit code (-N: signal N)."""

    def __init__(self, message: str, ranks: list[int], errors: dict[int, str],
                 exitcodes: dict[int, int | None]):
        super().__init__(message)
        self.ranks, self.errors, self.exitcodes = ranks, errors, exitcodes


class RankTimeout(AssertionError):
    """The deadline passed. `ranks`: the ranks that had not finished; `stacks`: rank -> the
    Python stacks each dumped just before it was killed (may be empty)."""

    def __init__(self, message: str, ranks: list[int], stacks: dict[int, str]):
        super().__init__(message)
        self.ranks, self.stacks = ranks, stacks


def _to_cpu(obj: Any) -> Any:
    """Tensors inside plain dicts, lists and tuples moved to CPU (torch.load maps the rest)."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device.type == "cpu" else obj.detach().cpu()
    if type(obj) is dict:
        return {k: _to_cpu(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _die_with_parent(parent: int) -> None:
    """Linux: have the kernel SIGKILL this rank if the test process dies (SIGKILL, os._exit)
    before it could kill the ranks itself."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the prctl
        os._exit(1)


def _child(rank: int, world_size: int, tmp: str, pg_timeout: float, parent: int,
           fn: Callable, args: tuple, kwargs: dict) -> None:
    """Body of one rank. Never returns: leaves with os._exit(0) or os._exit(1)."""
    code = 1
    try:
        _die_with_parent(parent)
        # One intra-op thread per rank: the ranks share the cores anyway, and an OpenMP pool the
        # parent already started does not survive fork (the child's first parallel op hangs).
        torch.set_num_threads(1)
        stack_file = open(os.path.join(tmp, f"stack{rank}.txt"), "w")
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
        store = dist.FileStore(os.path.join(tmp, "store"), world_size)
        dist.init_process_group(backend="gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout))
        # Every rank's mesh is whole before any fn runs: a rank whose fn needs no collective
        # could otherwise return, exit and close its sockets while a slower peer is still in
        # gloo's connectFullMesh, which then fails with "Connection closed by peer".
        dist.barrier()
        result = fn(rank, *args, **kwargs)
        out = os.path.join(tmp, f"result{rank}.pt")
        torch.save(_to_cpu(result), out + ".part")
        os.replace(out + ".part", out)
        dist.destroy_process_group()
        code = 0
    except BaseException:  # noqa: BLE001  (pytest.fail, SystemExit, KeyboardInterrupt too)
        try:  # first line: when, so the parent can tell the cause from its consequences
            stamp = time.monotonic_ns()
            with open(os.path.join(tmp, f"error{rank}.txt.part"), "w") as f:
                f.write(f"{stamp}\n{traceback.format_exc()}")
            os.replace(os.path.join(tmp, f"error{rank}.txt.part"),
                       os.path.join(tmp, f"error{rank}.txt"))
        except BaseException:  # noqa: BLE001
            pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name} (exit code {code})"
    return f"exit code {code}"


def _kill(procs: dict[int, multiprocessing.Process], sig: int = signal.SIGKILL) -> None:
    """Signal every rank not yet reaped (a reaped rank's pid may have been reused)."""
    for p in procs.values():
        if p.pid is not None and p.exitcode is None:
            try:
                os.kill(p.pid, sig)
            except OSError:
                pass


def run_ranks(world_size: int, fn: Callable, *args, timeout: float = 120.0,
              pg_timeout: float | None = None, **kwargs) -> list:
    """Run fn(rank, *args, **kwargs) on `world_size` forked gloo ranks; their results in rank order.

    Each rank gets a default process group (gloo, FileStore, collective timeout `pg_timeout`,
    by default max(timeout - 10, timeout / 2) s, below `timeout` so that a hung collective
    surfaces as an error inside a rank). fn, args and kwargs reach the ranks through fork, so
    they need not be picklable; results come back by torch.save (tensors moved to CPU). As soon
    as a rank fails the others are killed and RankFailure is raised; at the deadline (`timeout`
    s for the whole call) RankTimeout, with the hung ranks' stacks. Both are AssertionErrors.
    """
    __tracebackhide__ = True  # pytest: show the test's line and the ranks' tracebacks only
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    if pg_timeout is None:
        pg_timeout = max(timeout - 10.0, timeout / 2)
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("run_ranks: the calling process already has a default process "
                           "group; the forked ranks would inherit it")

    deadline = time.monotonic() + timeout
    ctx = multiprocessing.get_context("fork")
    tmp = tempfile.mkdtemp(prefix="run_ranks-")
    procs: dict[int, multiprocessing.Process] = {}
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        for rank in range(world_size):
            p = ctx.Process(target=_child, name=f"rank{rank}",
                            args=(rank, world_size, tmp, pg_timeout, os.getpid(), fn, args,
                                  kwargs))
            p.start()
            procs[rank] = p

        running = dict(procs)
        while running:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                _raise_timeout(procs, running, tmp, timeout)
            by_sentinel = {p.sentinel: r for r, p in running.items()}
            ready = multiprocessing.connection.wait(list(by_sentinel), timeout=remaining)
            failed = []
            for s in ready:
                rank = by_sentinel[s]
                p = running.pop(rank)
                p.join()
                if p.exitcode != 0 or not os.path.exists(os.path.join(tmp, f"result{rank}.pt")):
                    failed.append(rank)
            if failed:
                _raise_failure(procs, running, failed, tmp)

        return [torch.load(os.path.join(tmp, f"result{r}.pt"), map_location="cpu",
                           weights_only=False) for r in range(world_size)]
    finally:
        _kill(procs)
        for p in procs.values():
            if p.pid is not None:
                p.join()
        shutil.rmtree(tmp, ignore_errors=True)


def _read_error(tmp: str, rank: int) -> tuple[float, str | None]:
    """(when the rank failed, its traceback) from its error file; (inf, None) without one."""
    text = _read(os.path.join(tmp, f"error{rank}.txt"))
    if text is None:
        return float("inf"), None
    stamp, _, tb = text.partition("\n")
    try:
        return int(stamp), tb
    except ValueError:
        return float("inf"), text


def _trim_stacks(text: str) -> str:
    """A faulthandler dump without the frames below _child (inherited from the forking parent)."""
    out, skipping = [], False
    for line in text.splitlines():
        if line.startswith(("Current thread", "Thread ")) or not line.strip():
            skipping = False
        if not skipping:
            out.append(line)
        if line.endswith(" in _child") and __file__ in line:
            skipping = True
    return "\n".join(out)


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _raise_failure(procs, running, failed, tmp) -> None:
    __tracebackhide__ = True
    _kill(running)
    for p in running.values():
        p.join()
    # A rank may have ended on its own between the first failure and the kill (typically gloo's
    # "Connection closed by peer", or "reset", after the failed rank's exit): report it too,
    # after the first.
    killed = [r for r in sorted(running) if procs[r].exitcode == -signal.SIGKILL]
    later = [r for r in sorted(running) if r not in killed and (
        procs[r].exitcode != 0 or not os.path.exists(os.path.join(tmp, f"result{r}.pt")))]
    reported = {r: _read_error(tmp, r) for r in failed + later}

    # First the likely cause: a rank that died without a traceback (a signal, os._exit) rarely
    # dies as a consequence of another, whereas its peers' collectives fail with "Connection
    # closed by peer" right after. Then the ranks that raised, earliest first.
    def order(ranks):
        return sorted(ranks, key=lambda r: (reported[r][1] is not None, reported[r][0], r))

    failed, later = order(failed), order(later)
    errors, sections = {}, []
    for rank in failed + later:
        code = procs[rank].exitcode
        text = reported[rank][1]
        if text is None:
            text = (f"rank {rank} exited without a traceback ({_describe_exit(code)})"
                    + (", and without writing a result" if code == 0 else ""))
        errors[rank] = text
        sections.append(f"----- rank {rank} ({_describe_exit(code)}) -----\n{text.rstrip()}")
    head = f"{_ranks(failed)} of {len(procs)} failed"
    if later:
        head += f", then {_ranks(later)}"
    if killed:
        head += f"; killed the still-running {_ranks(killed)}"
    raise RankFailure(head + "\n" + "\n".join(sections), failed + later, errors,
                      {r: p.exitcode for r, p in procs.items()})


def _raise_timeout(procs, running, tmp, timeout) -> None:
    __tracebackhide__ = True
    hung = sorted(running)
    _kill(running, signal.SIGUSR1)  # faulthandler in each rank dumps its stacks
    grace = time.monotonic() + _STACK_GRACE_S
    stacks: dict[int, str] = {}
    while time.monotonic() < grace:
        stacks = {r: _read(os.path.join(tmp, f"stack{r}.txt")) or "" for r in hung}
        if all(stacks.values()):
            time.sleep(0.05)  # let the dumps finish
            stacks = {r: _read(os.path.join(tmp, f"stack{r}.txt")) or "" for r in hung}
            break
        time.sleep(0.02)
    stacks = {r: _trim_stacks(text) for r, text in stacks.items()}
    _kill(running)
    for p in running.values():
        p.join()
    done = sorted(set(procs) - set(hung))
    msg = (f"timed out after {timeout:g} s: {_ranks(hung)} of {len(procs)} had not finished"
           + (f" (finished: {', '.join(map(str, done))})" if done else "") + "; killed them")
    for r in hung:
        if stacks.get(r):
            msg += f"\n----- rank {r} stacks -----\n{stacks[r].rstrip()}"
    raise RankTimeout(msg, hung, stacks)
