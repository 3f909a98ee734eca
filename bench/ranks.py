"""Run a function on N gloo ranks for a benchmark: forked processes meeting through a FileStore,
one intra-op thread each (the ranks share the cores), results returned in rank order."""
from __future__ import annotations

import multiprocessing
import os
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist


def _rank(rank: int, world: int, folder: str, fn: Callable, args: tuple) -> None:
    code = 1
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=dist.FileStore(f"{folder}/store", world),
                                rank=rank, world_size=world)
        torch.save(fn(rank, *args), f"{folder}/result{rank}.pt")
        dist.destroy_process_group()
        code = 0
    except BaseException:  # noqa: BLE001  (reported by the parent)
        Path(f"{folder}/error{rank}.txt").write_text(traceback.format_exc())
    finally:
        os._exit(code)


def run_ranks(world: int, fn: Callable, *args: Any, timeout: float = 600) -> list[Any]:
    context = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="gtp-bench-") as folder:
        procs = [context.Process(target=_rank, args=(r, world, folder, fn, args))
                 for r in range(world)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout)
        for rank, proc in enumerate(procs):
            if proc.is_alive():
                proc.kill()
            if proc.exitcode != 0:
                error = Path(f"{folder}/error{rank}.txt")
                raise RuntimeError(f"rank {rank} failed:\n"
                                   + (error.read_text() if error.exists() else "no traceback"))
        return [torch.load(f"{folder}/result{r}.pt", weights_only=False) for r in range(world)]
