"""cluster.max_restarts under SLURM: a failed rank puts the job back in the queue.

Under submitit every rank is a task of one SLURM job and no process of ours supervises them. When
a rank dies, its peers fail in their next collective (gloo and NCCL report a closed connection);
the first of them to get here asks SLURM to requeue the job (`scontrol requeue`, as submitit
does on preemption), records the restart in the run folder's restarts.jsonl, and every surviving
rank then waits for SLURM to stop it: exiting with the error would let submitit report the job
failed before the requeue shows. The job's next start resumes from the latest checkpoint, like
any relaunch. Up to cluster.max_restarts requeues over the run (the rows of restarts.jsonl);
the failure after the last ends the job with its error and the count.

What is not requeued: an error a rank explains in one line (a bad config, a full disk, a
diverged step: running it again fails the same way), and a hang, which ends every rank by the
hang watch's exit (trainer.train.hangs) before any of them gets here.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from hydra.errors import CompactHydraException

from trainer.checkpoint import resume
from trainer.checkpoint.integrity import META, verify
from trainer.compose.runspec import RunSpec

RESTARTS = "restarts.jsonl"  # the run folder's record of cluster.max_restarts' restarts
WAIT_FOR_STOP_S = 600  # a rank waits this long for SLURM to stop it after the requeue


def restarts_so_far(run_dir: Path, but: str) -> int:
    """Rows of the run folder's restarts.jsonl, those of SLURM start `but` (this one) excepted:
    a peer of this start may have written its row already."""
    path = run_dir / RESTARTS
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return sum(1 for row in rows if row.get("slurm_start") != but)


def record_restart(run_dir: Path, row: dict[str, Any]) -> None:
    with (run_dir / RESTARTS).open("a") as f:
        f.write(json.dumps({**row, "time": time.time()}) + "\n")


def resume_step(spec: RunSpec, run_dir: Path) -> int | None:
    """The step of the checkpoint a restarted run resumes from (None: none yet)."""
    folder = resume.save_folder(spec.config.checkpoint, run_dir)
    point = resume.find(spec.config.checkpoint, folder, None, lambda p: verify(p, None))
    if point is None or point.weights_only:
        return None
    return int(json.loads((point.path / META).read_text())["step"])


def requeue_after_failure(rank: int, world: int, spec: RunSpec, run_dir: Path,
                          error: BaseException) -> bool:
    """Under SLURM with restarts left: the job is requeued (by this rank or a peer) and this
    rank should wait to be stopped (True); otherwise the error ends the rank (False)."""
    most, job = spec.config.cluster.max_restarts, os.environ.get("SLURM_JOB_ID")
    if not most or job is None or isinstance(error, CompactHydraException):
        return False
    start = os.environ.get("SLURM_RESTART_COUNT", "0")  # this start of the job
    used = restarts_so_far(run_dir, but=start)
    if used >= most:
        if rank == 0:
            print(f"not requeued: that was failure {used + 1} of the run, and all "
                  f"cluster.max_restarts={most} requeue(s) were used", flush=True)
        return False
    try:  # one rank of this start asks; the others only wait
        os.close(os.open(run_dir / f".requeue-{job}-{start}", os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return True
    step = resume_step(spec, run_dir)
    where = f"step {step}" if step is not None else "the start (no checkpoint yet)"
    failure = f"rank {rank} of {world} found the run failed: {type(error).__name__}: {error}"
    print(f"requeue {used + 1} of cluster.max_restarts={most}: {failure} Requeuing SLURM job "
          f"{job}; it resumes from {where}.", flush=True)
    record_restart(run_dir, {"restart": used + 1, "failure": failure, "slurm_job": job,
                             "slurm_start": start, "resumed_from_step": step or 0})
    subprocess.run(["scontrol", "requeue", job], check=True, capture_output=True, timeout=60)
    return True


def wait_to_be_stopped() -> None:
    """After a requeue: SLURM stops every task of the job (SIGTERM, then SIGKILL)."""
    deadline = time.monotonic() + WAIT_FOR_STOP_S
    while time.monotonic() < deadline:
        time.sleep(1.0)
    raise TimeoutError(f"the job was requeued but not stopped within {WAIT_FOR_STOP_S} s")
