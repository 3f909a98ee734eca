"""The trainer on a real SLURM cluster through hydra-submitit-launcher (hydra/launcher=slurm_cpu):
a two-point sweep of 2-rank jobs, a cancelled job that is reported rather than waited on, and a
preempted job (SIGUSR2) that saves, is requeued by submitit, and resumes where it stopped.
Every wait is bounded."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ("train.seq_length=32", "train.micro_batch_size=2", "train.eval_interval=null",
        "logger.log_interval=1", "cluster.timeout_s=60")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    sys.path.insert(0, str(ROOT))
    from trainer.data.dataset import prepare

    src = tmp_path_factory.mktemp("text")
    for doc in range(6):
        (src / f"d{doc}.txt").write_text(" ".join(f"w{(doc * 7 + i) % 50}" for i in range(800)))
    return prepare(src, tmp_path_factory.mktemp("data") / "dataset", valid_fraction=0.2)


def sweep(slurm_env: dict, partition: str, sweep_dir: Path, dataset: Path, *overrides: str,
          log: Path) -> subprocess.Popen:
    env = {**{k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}, **slurm_env}
    args = [sys.executable, str(ROOT / "launch.py"), "-m", "hydra/launcher=slurm_cpu",
            f"hydra.launcher.partition={partition}", "hydra.launcher.timeout_min=10",
            f"hydra.sweep.dir={sweep_dir}", f"data.path={dataset}", "cluster.procs_per_node=2",
            *TINY, *overrides]
    with log.open("w") as out:
        return subprocess.Popen(args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def run_folders(sweep_dir: Path) -> list[Path]:
    return sorted(p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith("."))


def steps(folder: Path) -> list[int]:
    path = folder / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] \
        if path.exists() else []


def wait_for(condition, limit: float, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert proc.poll() is None, f"launch.py exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def squeue_ids(slurm_env: dict) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i"], env={**os.environ, **slurm_env},
                         capture_output=True, text=True, timeout=10, check=True)
    return out.stdout.split()


def test_a_two_point_sweep_of_two_rank_jobs(slurm_env, slurm_partition, dataset, tmp_path):
    proc = sweep(slurm_env, slurm_partition, tmp_path / "sweep", dataset,
                 "train.train_samples=16", "train.global_batch_size=4",
                 "parallel.pipeline_model_parallel_size=1,2",
                 log=tmp_path / "log.txt")
    assert proc.wait(timeout=180) == 0, (tmp_path / "log.txt").read_text()
    folders = run_folders(tmp_path / "sweep")
    assert len(folders) == 2
    for folder in folders:
        assert steps(folder) == [1, 2, 3, 4]
        layout = json.loads((folder / "layout.json").read_text())["derived"]
        assert layout["world_size"] == 2
    assert {json.loads((f / "layout.json").read_text())["inputs"]["pipeline_model_parallel_size"]
            for f in folders} == {1, 2}


def test_a_cancelled_job_is_reported_not_waited_on(slurm_env, slurm_partition, dataset,
                                                   tmp_path):
    proc = sweep(slurm_env, slurm_partition, tmp_path / "sweep", dataset,
                 "train.train_samples=400000", log=tmp_path / "log.txt")
    wait_for(lambda: (tmp_path / "sweep").exists() and run_folders(tmp_path / "sweep")
             and len(steps(run_folders(tmp_path / "sweep")[0])) >= 2, 120, "training", proc)
    (job,) = squeue_ids(slurm_env)
    subprocess.run(["scancel", job], env={**os.environ, **slurm_env}, check=True, timeout=10)
    cancelled = time.monotonic()
    code = proc.wait(timeout=90)
    log = (tmp_path / "log.txt").read_text()
    assert code != 0, log
    assert time.monotonic() - cancelled < 60
    assert "CANCELLED" in log or "cancel" in log.lower(), log
    # scancel's SIGTERM is graceful: the ranks finish their step and save before they exit, so
    # the job may stay a moment in the queue (completing); it must then leave it on its own.
    deadline = time.monotonic() + 60
    while squeue_ids(slurm_env) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert squeue_ids(slurm_env) == [], "the cancelled job stayed in the queue"


def test_a_preempted_job_saves_requeues_and_resumes(slurm_env, slurm_partition, dataset,
                                                    tmp_path):
    proc = sweep(slurm_env, slurm_partition, tmp_path / "sweep", dataset,
                 "train.train_samples=2000", log=tmp_path / "log.txt")  # 500 steps
    wait_for(lambda: (tmp_path / "sweep").exists() and run_folders(tmp_path / "sweep")
             and len(steps(run_folders(tmp_path / "sweep")[0])) >= 3, 120, "training", proc)
    (job,) = squeue_ids(slurm_env)
    # What SLURM sends ahead of a time limit (the preset's signal); scancel sends it at once.
    subprocess.run(["scancel", "--signal=USR2", job], env={**os.environ, **slurm_env},
                   check=True, timeout=10)
    assert proc.wait(timeout=240) == 0, (tmp_path / "log.txt").read_text()
    (folder,) = run_folders(tmp_path / "sweep")
    logged = steps(folder)
    assert logged == list(range(1, 501))  # every step once: resumed exactly where it stopped
    job_output = "".join(p.read_text() for p in (tmp_path / "sweep" / ".submitit").rglob("*.out"))
    stopped = int(job_output.split("preempted at step ")[1].split(":")[0])
    assert 3 <= stopped < 500
    assert f"500 steps from step {stopped}" in job_output
    assert (folder / "checkpoints" / f"step_{stopped:08d}" / ".metadata").exists()


def task_pid(job: str, procid: int) -> int | None:
    """The pid of task `procid` of SLURM job `job` on this machine (its Python), from /proc."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if (f"SLURM_JOB_ID={job}".encode() in environ
                and f"SLURM_PROCID={procid}".encode() in environ
                and b"python" in cmdline and b"submitit" in cmdline):
            return int(entry.name)
    return None


def test_a_killed_rank_requeues_the_job_and_it_resumes(slurm_env, slurm_partition, dataset,
                                                      tmp_path):
    """cluster.max_restarts=1: rank 1 killed (SIGKILL) mid-run; rank 0 finds the run failed,
    requeues the job and records it in restarts.jsonl; the job's next start resumes from the
    latest checkpoint and ends; every step is logged once."""
    proc = sweep(slurm_env, slurm_partition, tmp_path / "sweep", dataset,
                 "train.train_samples=800", "checkpoint.save_interval=20",
                 "cluster.max_restarts=1", log=tmp_path / "log.txt")  # 200 steps
    wait_for(lambda: (tmp_path / "sweep").exists() and run_folders(tmp_path / "sweep")
             and len(steps(run_folders(tmp_path / "sweep")[0])) >= 30, 120, "training", proc)
    (job,) = squeue_ids(slurm_env)
    pid = task_pid(job, 1)
    assert pid is not None, f"no task 1 of job {job} found in /proc"
    os.kill(pid, signal.SIGKILL)
    assert proc.wait(timeout=240) == 0, (tmp_path / "log.txt").read_text()
    (folder,) = run_folders(tmp_path / "sweep")
    assert steps(folder) == list(range(1, 201))  # every step once
    (row,) = [json.loads(line) for line in (folder / "restarts.jsonl").read_text().splitlines()]
    assert row["restart"] == 1 and row["slurm_job"] == job and row["resumed_from_step"] >= 20
    assert "rank 0 of 2 found the run failed" in row["failure"]
    job_output = "".join(p.read_text() for p in (tmp_path / "sweep" / ".submitit").rglob("*.out"))
    assert "requeue 1 of cluster.max_restarts=1" in job_output
    assert f"200 steps from step {row['resumed_from_step']}" in job_output
