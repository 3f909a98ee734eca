"""Run a function on N gloo ranks for a benchmark: fresh forked processes meeting through a
FileStore (no ports), one intra-op thread each (the ranks share the cores, and an OpenMP pool
inherited through fork would hang), results returned in rank order. The first failing rank
stops the rest; its traceback is raised in the parent."""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist


def _rank(rank: int, world: int, folder: str, fn: Callable, args: tuple) -> None:
    code = 1
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=dist.FileStore(f"{folder}/store", world),
                                rank=rank, world_size=world, timeout=timedelta(seconds=120))
        torch.save(fn(rank, *args), f"{folder}/result{rank}.pt")
        dist.destroy_process_group()
        code = 0
    except BaseException:  # noqa: BLE001  (reported by the parent)
        Path(f"{folder}/error{rank}.txt").write_text(traceback.format_exc())
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # never run the parent's atexit handlers in a child


def run_ranks(world: int, fn: Callable, *args: Any, timeout: float = 600) -> list[Any]:
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("run_ranks forks its ranks: call it without a process group")
    context = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="gtp-bench-") as folder:
        procs = [context.Process(target=_rank, args=(r, world, folder, fn, args))
                 for r in range(world)]
        for proc in procs:
            proc.start()
        deadline, running = time.monotonic() + timeout, list(procs)
        try:  # until all end, one fails (its peers would wait for gloo's timeout) or time is up
            while running and time.monotonic() < deadline:
                multiprocessing.connection.wait([p.sentinel for p in running],
                                                deadline - time.monotonic())
                running = [p for p in running if p.exitcode is None]
                if any(p.exitcode for p in procs if p.exitcode is not None):
                    break
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join()
        failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
        if failed:
            errors = [Path(folder, f"error{r}.txt") for r, _ in failed]
            detail = "\n".join(e.read_text() for e in errors if e.exists())
            raise RuntimeError(f"ranks failed (rank, exit code): {failed}\n{detail}")
        return [torch.load(f"{folder}/result{r}.pt", weights_only=False) for r in range(world)]
