"""How the ranks of a run start and meet: processes started here (one machine), torchrun, or a
submitit job (SLURM or local). Every rank trains with the same typed config in one run
directory. A rank that dies or raises takes the others down within a bounded time: here by the
parent, elsewhere by the process-group timeout (cluster.timeout_s) and the launcher.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import tempfile
import time
import traceback
import zlib
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from hydra.errors import CompactHydraException

from trainer.config import ConfigError
from trainer.spec.runspec import RunSpec

GRACE_S = 5.0  # how long a rank gets to exit after SIGTERM before SIGKILL


class RankFailed(CompactHydraException):
    """A rank of a run started here failed; the message names it and its error."""


@dataclass(frozen=True)
class RankEnv:
    """Who this process is in the run, and where the ranks meet."""

    rank: int
    world_size: int
    local_rank: int
    init_method: str  # "env://" (torchrun, submitit) or "file://..." (started here)
    launcher: str


def launched_rank() -> RankEnv | None:
    """The rank this process already is, if torchrun or submitit started it."""
    if os.environ.get("SUBMITIT_EXECUTOR"):  # a submitit task, on SLURM or local
        import submitit
        from submitit.helpers import TorchDistributedEnvironment

        # Every task of the job derives the same port from the job id, below Linux's ephemeral
        # range (32768-60999): submitit's own choice can collide with a port another job's
        # connections already hold. Set here, it also replaces a stale MASTER_PORT that sbatch
        # copied from the submitting shell (as overwrite does for RANK and the others).
        job_id = submitit.JobEnvironment().job_id
        os.environ["MASTER_PORT"] = str(20000 + zlib.crc32(job_id.encode()) % 12000)
        env = TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        return RankEnv(env.rank, env.world_size, env.local_rank, "env://", "submitit")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return RankEnv(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                       int(os.environ.get("LOCAL_RANK", 0)), "env://", "torchrun")
    return None


def check_world(env: RankEnv, spec: RunSpec) -> None:
    layout = spec.layout
    if env.world_size != layout.world_size:
        cluster = spec.config.cluster
        raise ConfigError(
            f"{env.launcher} started {env.world_size} processes (WORLD_SIZE={env.world_size}) "
            f"but the config's world size is cluster.num_nodes x cluster.procs_per_node = "
            f"{cluster.num_nodes} x {cluster.procs_per_node} = {layout.world_size}. Fix: make "
            f"them agree (e.g. cluster.procs_per_node={env.world_size // cluster.num_nodes}).")


def run_rank(env: RankEnv, spec: RunSpec, run_dir: Path, meta: dict[str, Any]) -> None:
    """Train as one rank: join the process group, train, leave (cleanly on preemption)."""
    import torch
    import torch.distributed as dist

    from trainer.train.loop import Preempted, Trainer
    from trainer.launch.signals import PreemptionWatch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", env.local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=env.init_method,
                            rank=env.rank, world_size=env.world_size,
                            timeout=timedelta(seconds=spec.config.cluster.timeout_s))
    try:
        with PreemptionWatch() as watch:
            try:
                Trainer(spec, run_dir, device, meta, watch).run()
            except Preempted:
                watch.hand_over()  # submitit requeues the job from rank 0; elsewhere nothing
    finally:
        dist.destroy_process_group()


def _local_rank_main(env: RankEnv, spec: RunSpec, run_dir: Path, meta: dict[str, Any],
                     errors: Any) -> None:
    """Body of a process started by launch_local; reports its error to the parent."""
    try:
        run_rank(env, spec, run_dir, meta)
    except BaseException as error:  # noqa: BLE001  (every failure must reach the parent)
        traceback.print_exc()
        errors.put((env.rank, f"{type(error).__name__}: {error}".strip()))
        sys.exit(1)


def launch_local(spec: RunSpec, run_dir: Path, meta: dict[str, Any]) -> None:
    """Start every rank on this machine and supervise them."""
    layout = spec.layout
    if spec.config.cluster.num_nodes != 1:
        raise ConfigError(
            f"cluster.num_nodes={spec.config.cluster.num_nodes}: launch.py starts processes on this "
            f"machine only. Fix: set cluster.num_nodes=1, or start the ranks with torchrun on "
            f"each node, or with SLURM (-m hydra/launcher=slurm).")
    context = multiprocessing.get_context("spawn")
    errors = context.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="gtp-rendezvous-") as meeting:
        init = f"file://{meeting}/store"
        procs = [context.Process(
            target=_local_rank_main, name=f"rank{r}",
            args=(RankEnv(r, layout.world_size, r, init, "launch.py"), spec, run_dir, meta,
                  errors)) for r in range(layout.world_size)]
        for proc in procs:
            proc.start()
        print("started " + ", ".join(f"rank {r} (pid {p.pid})" for r, p in enumerate(procs)),
              flush=True)
        _supervise(procs, errors)


def _supervise(procs: list, errors: Any) -> None:
    forward = lambda signum, frame: [os.kill(p.pid, signum) for p in procs if p.is_alive()]
    previous = {s: signal.signal(s, forward) for s in (signal.SIGUSR2, signal.SIGTERM)}
    try:
        while any(p.exitcode is None for p in procs):
            failed = [(r, p) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed:
                _stop(procs)
                raise RankFailed(_failure_message(failed, errors, len(procs)))
            time.sleep(0.05)
        failed = [(r, p) for r, p in enumerate(procs) if p.exitcode != 0]
        if failed:
            raise RankFailed(_failure_message(failed, errors, len(procs)))
    finally:
        _stop(procs)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _stop(procs: list) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + GRACE_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def _failure_message(failed: list, errors: Any, world: int) -> str:
    """Name the rank that failed first: a rank killed by a signal says nothing, and the others
    then fail on their next collective ("connection closed"), so a silent death is the cause;
    otherwise the first error reported is."""
    reported = {}
    while not errors.empty():
        rank, text = errors.get()
        reported.setdefault(rank, text)  # dicts keep insertion order: first reported first
    silent = [(r, p) for r, p in failed if r not in reported]
    if silent:
        rank, proc = silent[0]
        why = (f"killed by {signal.Signals(-proc.exitcode).name}" if proc.exitcode < 0
               else f"exited with code {proc.exitcode}")
    else:
        rank, why = next(iter(reported.items()))
    others = sorted(r for r, _ in failed if r != rank)
    also = f" (then rank(s) {', '.join(map(str, others))} failed too)" if others else ""
    return f"rank {rank} of {world} failed: {why}{also}. The other ranks were stopped."
