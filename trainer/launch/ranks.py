"""Who a rank is and how it trains: torchrun or a submitit job (SLURM or local) started this
process, or launch.py did (trainer.launch.local). Every rank trains with the same typed config in
one run directory. A rank that dies or raises takes the others down within a bounded time: for
local ranks by launch.py, elsewhere by the process-group timeout (cluster.timeout_s) and the
launcher.
"""
from __future__ import annotations

import os
import socket
import sys
import time
import zlib
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from trainer.checkpoint.resume import Decided
from trainer.compose.runspec import RunSpec
from trainer.config import ConfigError
from trainer.launch.folder import StrayRank
from trainer.launch.requeue import requeue_after_failure, wait_to_be_stopped
from trainer.train.hangs import backend_timeout_s, hold_dump_signal
from trainer.train.signals import PreemptionWatch

# What env:// initialisation needs; torchrun (and a Kubernetes PyTorchJob) sets them all.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
QUIET_RANKS_WAIT_S = 30  # how long the ranks other than 0 let rank 0 say a wrong world
PEER_NOTICE_S = 5.0  # a rank other than 0 that reaches no store by then says what it waits for


@dataclass(frozen=True)
class RankEnv:
    """Who this process is in the run, and where the ranks meet."""

    rank: int
    world_size: int
    local_rank: int
    init_method: str  # "env://" (torchrun, submitit) or "file://..." (started here)
    launcher: str


def launched_rank(wait_s: float) -> RankEnv | None:
    """The rank this process already is, if torchrun or submitit started it. wait_s
    (cluster.timeout_s): how long a rank other than 0 waits for the ranks' store to listen."""
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
    found = {name: os.environ[name] for name in TORCHRUN_VARIABLES if name in os.environ}
    if "RANK" not in found and "WORLD_SIZE" not in found:
        return None
    missing = [name for name in TORCHRUN_VARIABLES if name not in found]
    if missing:
        raise ConfigError(
            f"{', '.join(f'{k}={v}' for k, v in found.items())} set in the environment without "
            f"{', '.join(missing)}: a torchrun rank has all of {', '.join(TORCHRUN_VARIABLES)}, "
            f"so these look left over from another job (this process would wait for peers that "
            f"never come). Fix: `unset {' '.join(k for k in found if k in ('RANK', 'WORLD_SIZE'))}`"
            f" to let launch.py start the ranks (cluster.procs_per_node), or start it with "
            f"torchrun.")
    for name in ("RANK", "WORLD_SIZE"):
        if not found[name].isdigit():
            raise ConfigError(f"{name}={found[name]!r} in the environment is not a rank count. "
                              f"Fix: unset it, or start launch.py with torchrun.")
    rank, world_size = int(found["RANK"]), int(found["WORLD_SIZE"])
    said = " ".join(f"{k}={v}" for k, v in found.items())
    names = [*found, *(["LOCAL_RANK"] if "LOCAL_RANK" in os.environ else [])]
    unset = f"`unset {' '.join(names)}` to let launch.py start the ranks (cluster.procs_per_node)"
    if rank >= world_size:
        raise StrayRank(f"{said} in the environment: RANK must be below WORLD_SIZE, so these "
                        f"look left over from another job. Fix: {unset}, or start it with "
                        f"torchrun.")
    if rank != 0 and "TORCHELASTIC_RUN_ID" not in os.environ:
        # Not torchrun (its agent starts every rank): ranks started by hand, a PyTorchJob, or
        # variables left in a shell. Rank 0 opens the store once its inputs are checked, which
        # may take a while; a stale shell would wait for nothing until the process group's
        # timeout and end in a traceback. So: say what this rank waits for after
        # PEER_NOTICE_S, and end in one line after cluster.timeout_s (torch's own bound).
        where = (found["MASTER_ADDR"], found["MASTER_PORT"])
        if not _listens(*where, PEER_NOTICE_S):
            print(f"{said} in the environment: this is rank {rank} of a world started "
                  f"elsewhere, waiting up to cluster.timeout_s={wait_s:g} s for rank 0 at "
                  f"{where[0]}:{where[1]}, where nothing listens yet. If these are left over "
                  f"from another job, stop this and {unset}.", file=sys.stderr, flush=True)
            if not _listens(*where, wait_s - PEER_NOTICE_S):
                raise StrayRank(
                    f"{said} in the environment, but nothing listened at MASTER_ADDR:"
                    f"MASTER_PORT within cluster.timeout_s={wait_s:g} s: no rank 0 to join, so "
                    f"these look left over from another job. Fix: {unset}, or start rank 0 "
                    f"(torchrun starts every rank).")
    return RankEnv(rank, world_size, int(os.environ.get("LOCAL_RANK", 0)), "env://", "torchrun")


def _listens(host: str, port: str, within_s: float) -> bool:
    """Whether a TCP connection to host:port opens within `within_s` seconds."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return True
        except (OSError, ValueError):  # refused, unreachable, no such host; a port not a number
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


def cpu_threads(procs_per_node: int) -> int | None:
    """Intra-op CPU threads for each of this machine's ranks, or None to keep torch's choice.
    torch gives every process a thread per core, so N ranks on one machine run N times as many
    threads as there are cores, and on CPU they spend the step waking one another (8 gloo
    ranks on 2 cores: 9x slower). torchrun sets OMP_NUM_THREADS=1 for the same reason; here
    each rank gets its share of the CPUs it may use (SLURM's cpus per task where set). A
    person's OMP_NUM_THREADS wins."""
    if "OMP_NUM_THREADS" in os.environ or procs_per_node <= 1:
        return None
    per_task = int(os.environ.get("SLURM_CPUS_PER_TASK", "0") or 0)
    return max(1, per_task or len(os.sched_getaffinity(0)) // procs_per_node)


def check_world(env: RankEnv, spec: RunSpec) -> None:
    """The launcher started the config's world. Every rank finds a mismatch; rank 0 says it, the
    others exit quietly with the same failure (one line, not one a rank). They wait first:
    torchrun stops every rank when one fails, and a rank that failed at once stopped rank 0
    before it had said why (rank 0 also takes the run's locks first); rank 0's failure ends
    the wait, as torchrun then stops them."""
    layout = spec.layout
    restarts = spec.config.cluster.max_restarts
    if env.launcher == "torchrun" and restarts != int(os.environ.get("TORCHELASTIC_MAX_RESTARTS",
                                                                     0)):
        raise ConfigError(
            f"cluster.max_restarts={restarts} but torchrun was started with --max-restarts="
            f"{os.environ.get('TORCHELASTIC_MAX_RESTARTS', 0)}: under torchrun its agent restarts "
            f"the ranks (each resumes from the latest checkpoint). Fix: pass --max-restarts="
            f"{restarts} to torchrun, or set cluster.max_restarts to its value.")
    if env.launcher == "submitit" and restarts and "SLURM_JOB_ID" not in os.environ:
        raise ConfigError(
            f"cluster.max_restarts={restarts} with submitit's local executor: only a SLURM job "
            f"is requeued on a failed rank. Fix: cluster.max_restarts=0, or "
            f"hydra/launcher=slurm.")
    if env.world_size != layout.world_size and env.rank != 0:
        time.sleep(QUIET_RANKS_WAIT_S)
        raise SystemExit(1)
    if env.world_size != layout.world_size:
        cluster = spec.config.cluster
        raise ConfigError(
            f"{env.launcher} started {env.world_size} processes (WORLD_SIZE={env.world_size}) "
            f"but the config's world size is cluster.num_nodes x cluster.procs_per_node = "
            f"{cluster.num_nodes} x {cluster.procs_per_node} = {layout.world_size}. Fix: make "
            f"them agree (e.g. cluster.procs_per_node={env.world_size // cluster.num_nodes}).")


def run_rank(env: RankEnv, spec: RunSpec, run_dir: Path, meta: dict[str, Any],
             watch: PreemptionWatch | None = None, decided: Decided | None = None) -> None:
    """Train as one rank: join the process group, train, leave (cleanly on preemption; an
    interrupt raises Interrupted after its checkpoint). `watch`: one the caller already set up
    (launch.py's ranks), else this rank watches its own signals. `decided`: the checkpoint this
    process's launcher found and checked (trainer.checkpoint.resume.Decided)."""
    import torch
    import torch.distributed as dist

    from trainer.train.loop import Preempted, Trainer

    threads = cpu_threads(spec.config.cluster.procs_per_node)
    if threads is not None:
        torch.set_num_threads(threads)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", env.local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=env.init_method,
                            rank=env.rank, world_size=env.world_size,
                            timeout=timedelta(
                                seconds=backend_timeout_s(spec.config.cluster.timeout_s)))
    try:
        if watch is None:  # the first thread: the block reaches every thread started later
            hold_dump_signal()
        requeued = False
        with PreemptionWatch() if watch is None else nullcontext(watch) as watch:
            try:
                Trainer(spec, run_dir, device, meta, watch, decided).run()
            except Preempted:
                watch.hand_over()  # submitit requeues the job from rank 0; elsewhere nothing
            except Exception as error:  # noqa: BLE001 (re-raised unless the job is requeued)
                requeued = env.launcher == "submitit" and requeue_after_failure(
                    env.rank, env.world_size, spec, run_dir, error)
                if not requeued:
                    raise
        if requeued:  # outside the watch: SLURM's stop must not start a save
            wait_to_be_stopped()
    finally:
        dist.destroy_process_group()
