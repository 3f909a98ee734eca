"""Launching many ranks from the command line: processes started by launch.py, torchrun, rank
failures that end the run within a bound, preemption and resume, and validated sweeps."""
from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.data.dataset import prepare

from config_helpers import ROOT

TINY_RUN = ("train.seq_length=32", "train.micro_batch_size=2", "train.eval_interval=null",
            "logger.log_interval=1", "cluster.timeout_s=20")


def make_dataset(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("text")
    for doc in range(6):
        words = (f"word{(doc * 7 + i) % 50}" for i in range(800))
        (src / f"doc{doc}.txt").write_text(" ".join(words))
    return prepare(src, tmp_path_factory.mktemp("data") / "dataset", valid_fraction=0.2)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory)


def command(*args: str, torchrun: int = 0) -> list[str]:
    if torchrun:
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={torchrun}",
                str(ROOT / "launch.py"), *args]
    return [sys.executable, str(ROOT / "launch.py"), *args]


class Run:
    """A launch.py process whose output goes to files (a pipe nobody reads would block it)."""

    def __init__(self, args: list[str], log_dir: Path, own_group: bool = False):
        log_dir.mkdir(parents=True, exist_ok=True)
        self.out_path, self.err_path = log_dir / "stdout.txt", log_dir / "stderr.txt"
        env = {k: v for k, v in os.environ.items()
               if k not in ("HYDRA_FULL_ERROR", "RANK", "WORLD_SIZE")}
        with self.out_path.open("w") as out, self.err_path.open("w") as err:
            # own_group: a process group of its own, as a terminal gives a command, so a test
            # can send it a ctrl-C (os.killpg) without sending one to pytest.
            self.proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=out, stderr=err,
                                         start_new_session=own_group)

    def poll(self):
        return self.proc.poll()

    def send_signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def stdout(self) -> str:
        return self.out_path.read_text()

    def finish(self, timeout: float = 180) -> tuple[int, str, str]:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        return self.proc.returncode, self.stdout(), self.err_path.read_text()


def start(dataset: Path, run_dir: Path, *overrides: str, torchrun: int = 0,
          own_group: bool = False) -> Run:
    args = command(*TINY_RUN, f"data.path={dataset}", f"hydra.run.dir={run_dir}", *overrides,
                   torchrun=torchrun)
    return Run(args, run_dir.parent / f"{run_dir.name}-logs-{time.monotonic_ns()}", own_group)


def finish(run: Run, timeout: float = 180) -> tuple[int, str, str]:
    return run.finish(timeout)


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for_steps(run_dir: Path, steps: int, run: Run, limit: float = 180) -> None:
    deadline = time.monotonic() + limit
    while len(metrics(run_dir)) < steps:
        assert run.poll() is None, run.finish()
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.2)


def started_line(out: str) -> str | None:
    """The parent's 'started rank 0 (pid N), rank 1 (pid M)' line, once it is whole."""
    return next((line for line in out.splitlines(keepends=True)
                 if line.startswith("started ") and line.endswith("\n")), None)


def rank_pids(run: Run, limit: float = 120) -> dict[int, int]:
    """The rank processes' pids, which the parent prints before training."""
    deadline = time.monotonic() + limit
    while started_line(run.stdout()) is None:
        assert run.poll() is None and time.monotonic() < deadline, run.finish()
        time.sleep(0.1)
    line = started_line(run.stdout()).strip()
    parts = [p.split(" (pid ") for p in line.removeprefix("started ").split(", ")]
    return {int(rank.split()[1]): int(pid.rstrip(")")) for rank, pid in parts}


def test_launch_py_starts_the_configured_ranks(dataset, tmp_path):
    proc = start(dataset, tmp_path, "cluster.procs_per_node=2",
                 "parallel.tensor_parallel_num_weight_shards=2", "train.train_samples=16")
    code, out, err = finish(proc)
    assert code == 0, err
    line = started_line(out) or ""
    assert line.startswith("started rank 0 (pid ") and ", rank 1 (pid " in line
    assert "2 rank(s), global batch 4 samples, 4 steps" in out
    cpus = len(os.sched_getaffinity(0))
    assert f"each rank computes with {max(1, cpus // 2)} CPU thread(s): 2 ranks share this " \
           f"machine's {cpus} CPUs" in out
    assert [m["consumed_samples"] for m in metrics(tmp_path)] == [4, 8, 12, 16]
    assert (tmp_path / "checkpoints" / "step_00000004" / ".metadata").exists()


def test_each_local_rank_takes_its_share_of_the_cpus(monkeypatch):
    """torch starts a thread per core in every process: 8 ranks on 2 cores ran 9x slower
    than with one thread each (bench/soak.py's layout, 1.2 s a step against 0.13 s)."""
    from trainer.launch.ranks import cpu_threads

    for name in ("OMP_NUM_THREADS", "SLURM_CPUS_PER_TASK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert [cpu_threads(n) for n in (1, 2, 8, 32)] == [None, 8, 2, 1]
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "6")  # SLURM gave each task its own CPUs
    assert cpu_threads(8) == 6
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # a person's choice stands
    assert cpu_threads(8) is None


def test_torchrun_ranks_train_and_a_wrong_world_is_named(dataset, tmp_path):
    # Two pipeline stages with tied embeddings: the loss is reported once, from the last stage
    code, out, err = finish(start(dataset, tmp_path / "ok", "cluster.procs_per_node=2",
                                  "parallel.pipeline_model_parallel_size=2",
                                  "model.tie_word_embeddings=true", "train.global_batch_size=8",
                                  "train.train_samples=32", torchrun=2))
    assert code == 0, err
    logged = metrics(tmp_path / "ok")
    assert [m["step"] for m in logged] == [1, 2, 3, 4]
    assert all(math.isfinite(m["loss"]) and m["loss"] > 0 for m in logged)
    assert out.count("step      1/4") == 1
    code, out, err = finish(start(dataset, tmp_path / "bad", "cluster.procs_per_node=4",
                                  "train.train_samples=16", torchrun=2))
    assert code != 0
    said = ("torchrun started 2 processes (WORLD_SIZE=2) but the config's world size is "
            "cluster.num_nodes x cluster.procs_per_node = 1 x 4 = 4")
    assert err.count(said) == 1, err  # rank 0 says it; torchrun's own report follows
    assert not metrics(tmp_path / "bad")


def test_a_killed_rank_ends_the_run_and_is_named(dataset, tmp_path):
    proc = start(dataset, tmp_path, "cluster.procs_per_node=2", "train.train_samples=100000")
    pids = rank_pids(proc)
    wait_for_steps(tmp_path, 2, proc)
    killed = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    code, _, err = finish(proc, timeout=60)
    assert code != 0 and time.monotonic() - killed < 30
    assert "rank 1 of 2 failed: killed by SIGKILL" in err
    assert "Traceback" not in err.split("rank 1 of 2 failed")[1]


def test_a_hung_rank_ends_the_run_within_the_timeout(dataset, tmp_path):
    """Across pipeline stages: the first stage waits for the second's activations' gradients
    in a point-to-point receive on the pp group, which must time out like a collective. The
    stopped rank cannot write its stacks: the line says so (trainer/train/hangs.py)."""
    proc = start(dataset, tmp_path, "cluster.procs_per_node=2", "train.train_samples=100000",
                 "parallel.pipeline_model_parallel_size=2", "train.global_batch_size=8",
                 "cluster.timeout_s=5")
    pids = rank_pids(proc)
    wait_for_steps(tmp_path, 2, proc)
    stopped = time.monotonic()
    os.kill(pids[1], signal.SIGSTOP)  # alive but silent: only the timeout can tell
    code, _, err = finish(proc, timeout=90)
    assert code != 0 and time.monotonic() - stopped < 5 + 30
    # rank 0 waits in whichever collective rank 1 was stopped before (a p2p over pp, or
    # an all_reduce of the step's counts over the world)
    assert re.search(r"rank\(s\) 0 wait in \w+ over \w+ \(ranks 0, 1\) that rank\(s\) 1 never "
                     r"reached; rank\(s\) 1 wrote no stacks \(stuck outside Python, or gone\)",
                     err), err
    assert "The ranks were stopped." in err


def test_preemption_saves_and_a_relaunch_resumes(dataset, tmp_path):
    # 300 steps; the preemption's save is written in the background, and waited for
    overrides = ("cluster.procs_per_node=2", "train.train_samples=1200",
                 "checkpoint.async_save=true")
    proc = start(dataset, tmp_path, *overrides)
    wait_for_steps(tmp_path, 3, proc)
    proc.send_signal(signal.SIGUSR2)
    code, out, err = finish(proc)
    assert code == 0, err
    stopped_at = metrics(tmp_path)[-1]["step"]
    assert f"preempted at step {stopped_at}: saved" in out and stopped_at < 300
    assert re.search(rf"saved \S+step_{stopped_at:08d} \(written in the background", out), out
    assert (tmp_path / "checkpoints" / f"step_{stopped_at:08d}" / ".metadata").exists()
    code, out, err = finish(start(dataset, tmp_path, *overrides))  # the same command again
    assert code == 0, err
    steps = [m["step"] for m in metrics(tmp_path)]
    assert steps == list(range(1, 301))  # no step lost, none repeated
    assert f"300 steps from step {stopped_at}" in out


def test_a_sweep_runs_every_point_in_its_own_folder(dataset, tmp_path):
    code, out, err = Run(command(
        "-m", *TINY_RUN, f"data.path={dataset}", f"hydra.sweep.dir={tmp_path / 'sweep'}",
        "cluster.procs_per_node=2", "train.train_samples=8", "train.global_batch_size=4",
        "parallel.tensor_parallel_num_sequence_shards=1,2",
        "parallel.tensor_parallel_num_weight_shards=2"), tmp_path / "logs").finish()
    assert code == 0, err
    folders = sorted(p for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert len(folders) == 2
    for folder in folders:
        assert [m["consumed_samples"] for m in metrics(folder)] == [4, 8]


def test_a_sweep_with_an_invalid_point_starts_nothing(dataset, tmp_path):
    code, out, err = Run(command(
        "-m", *TINY_RUN, f"data.path={dataset}", f"hydra.sweep.dir={tmp_path / 'sweep'}",
        "cluster.procs_per_node=4", "train.train_samples=8",
        "parallel.tensor_parallel_num_sequence_shards=1,3",
        "parallel.tensor_parallel_num_weight_shards=4"), tmp_path / "logs").finish()
    assert code != 0
    assert "Sweep refused before any job started; invalid points: 1 of 2." in err
    assert "parallel.tensor_parallel_num_sequence_shards=3" in err
    assert "does not divide GTP_remat size 4" in err and "Traceback" not in err
    assert not (tmp_path / "sweep").exists()
