"""Functions that tests/slurm runs as SLURM jobs. submitit pickles a function by reference (module
+ name), so they live in a module the job's Python can import: test_cluster.py puts this folder
on the job's PYTHONPATH. Nothing here talks to SLURM; the job does."""
from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import submitit


def report_ranks() -> dict:
    """One task's view of the job: submitit's ranks, SLURM's variables, and an all_reduce over a
    gloo group of all tasks (each adds rank + 1, so 2 tasks sum to 3)."""
    # torch inside: the test process imports this module too, and need not pay for torch.
    import torch
    import torch.distributed as dist

    job_env = submitit.JobEnvironment()
    dist_env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        total = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(total)
        dist_rank, world_size = dist.get_rank(), dist.get_world_size()
    finally:
        dist.destroy_process_group()
    return {
        "global_rank": job_env.global_rank,
        "local_rank": job_env.local_rank,
        "num_tasks": job_env.num_tasks,
        "SLURM_PROCID": os.environ.get("SLURM_PROCID"),
        "SLURM_NTASKS": os.environ.get("SLURM_NTASKS"),
        "dist_rank": dist_rank,
        "world_size": world_size,
        "all_reduce_sum": total.item(),
        "master": f"{dist_env.master_addr}:{dist_env.master_port}",
    }


def mark_and_sleep(marker: str, seconds: float) -> str:
    """Touches `marker` (so the test knows the job runs), then sleeps: a job to cancel."""
    Path(marker).touch()
    time.sleep(seconds)
    return "slept"


def square(x: int) -> int:
    return x * x


def fail(message: str) -> None:
    raise ValueError(message)
