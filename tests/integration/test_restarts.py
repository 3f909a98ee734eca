"""cluster.max_restarts on real launch.py runs of two gloo ranks: a rank killed with SIGKILL,
or hung (SIGSTOP), stops every rank and the run starts again from the latest checkpoint, one
line a restart (also in restarts.jsonl); every step is logged once and the last checkpoint
equals, value for value, that of a run never stopped. One failure more than the restarts ends
the run with the count."""
from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from config_helpers import ROOT, finish

RUN = ("cluster.procs_per_node=2", "train.micro_batch_size=2", "train.seq_length=32",
       "logger.log_interval=1", "train.eval_interval=null", "schedule.lr_warmup_samples=0",
       "schedule.lr_warmup_fraction=null", "train.train_samples=256", "checkpoint.save_interval=8")
STEPS = 64


def start(run_dir: Path, *args: str, torchrun: list[str] | None = None,
          env: dict | None = None) -> subprocess.Popen:
    base = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "RANK")}
    runner = ["-m", "torch.distributed.run", *torchrun] if torchrun is not None else []
    return subprocess.Popen([sys.executable, *runner, str(ROOT / "launch.py"),
                             f"hydra.run.dir={run_dir}", *RUN, *args], text=True, cwd=ROOT,
                            env=base | (env or {}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def kill_rank_1_at(process: subprocess.Popen, steps: list[int],
                   signum: int = signal.SIGKILL) -> list[str]:
    """Read the console; at each of `steps` (counted in the current start's own steps) send
    the newest rank 1 `signum` (SIGSTOP: it hangs, holding its place in every collective).
    Returns the lines read."""
    lines, pid, left = [], None, list(steps)
    for line in process.stdout:
        lines.append(line)
        found = re.search(r"rank 1 \(pid (\d+)\)", line)
        if found:
            pid = int(found.group(1))
        step = re.match(r"step\s+(\d+)/", line)
        if left and step and pid is not None and int(step.group(1)) >= left[0]:
            os.kill(pid, signum)
            left.pop(0)
            pid = None  # the next start's rank 1
        if not left:
            break
    return lines


def contents(checkpoint: Path, out: Path) -> dict:
    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def never_stopped(tmp_path_factory) -> Iterator[Callable[[], Path]]:
    """The last checkpoint of the run never stopped: started at once, beside the test's own
    run; calling the fixture's value waits for it."""
    run_dir = tmp_path_factory.mktemp("never_stopped")
    process = start(run_dir)

    @functools.cache
    def last() -> Path:
        out = finish(process)
        assert out.returncode == 0, out.stderr
        return run_dir / "checkpoints" / f"step_{STEPS:08d}"
    yield last
    if process.poll() is None:
        process.kill()
        process.wait()


def same_as_never_stopped(run_dir: Path, never_stopped: Callable[[], Path], tmp_path: Path):
    """Every step logged once, and the last checkpoint equal, value for value, to the run's
    never stopped."""
    steps = [json.loads(line)["step"] for line in
             (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))  # each step logged once
    got = contents(run_dir / "checkpoints" / f"step_{STEPS:08d}", tmp_path / "got.pt")
    want = contents(never_stopped(), tmp_path / "never_stopped.pt")
    assert got.keys() == want.keys()
    # "rng" differs between two plain runs of the same command too (nothing draws from it)
    assert [k for k in got if k != "rng" and not (
        torch.equal(got[k], want[k]) if isinstance(got[k], torch.Tensor) else got[k] == want[k])
    ] == []


def test_two_killed_ranks_restart_from_the_latest_checkpoint_to_the_same_weights(
        tmp_path, never_stopped):
    restarted = start(tmp_path / "killed", "cluster.max_restarts=2")
    lines = kill_rank_1_at(restarted, [12, 30])
    out = finish(restarted)
    assert out.returncode == 0, out.stderr
    text = "".join(lines) + out.stdout
    # rank 0 may fail in its collective before launch.py has stopped it: then the line says so
    restarts = re.findall(r"restart (\d) of cluster.max_restarts=2: rank 1 of 2 failed: killed by "
                          r"SIGKILL(?: \(then rank\(s\) 0 failed too\))?\. The other ranks were "
                          r"stopped\. Resuming from step (\d+)\.", text)
    assert [n for n, _ in restarts] == ["1", "2"], text
    resumed = [int(step) for _, step in restarts]
    # the checkpoint before each kill (the ranks may run a few steps while rank 1 is killed)
    assert resumed[0] in (8, 16) and resumed[1] in (24, 32, 40), resumed
    rows = [json.loads(line) for line in (tmp_path / "killed" / "restarts.jsonl").open()]
    assert [(r["restart"], r["resumed_from_step"]) for r in rows] == [(1, resumed[0]),
                                                                       (2, resumed[1])]
    same_as_never_stopped(tmp_path / "killed", never_stopped, tmp_path)


def test_a_hung_rank_is_stopped_and_restarted_to_the_same_weights(tmp_path, never_stopped):
    """Rank 1 stopped (SIGSTOP) mid-run: alive, in no collective, not even its hang watch
    runs. Rank 0's watch ends the run after cluster.timeout_s (and GATHER_S waiting for rank
    1's stacks), launch.py stops both and starts them again from the latest checkpoint."""
    run_dir = tmp_path / "hung"
    restarted = start(run_dir, "cluster.max_restarts=1", "cluster.timeout_s=5")
    lines = kill_rank_1_at(restarted, [12], signal.SIGSTOP)
    out = finish(restarted)
    assert out.returncode == 0, out.stderr
    text = "".join(lines) + out.stdout
    (restart,) = re.findall(r"restart 1 of cluster.max_restarts=1: the run hung: a collective "
                            r"waited over cluster.timeout_s=5 s: .*rank\(s\) 1 wrote no stacks "
                            r"\(stuck outside Python, or gone\)\..* The ranks were stopped\. "
                            r"Resuming from step (\d+)\.", text)
    assert int(restart) in (8, 16), restart  # the checkpoint before the hang
    rows = [json.loads(line) for line in (run_dir / "restarts.jsonl").open()]
    assert [(r["restart"], r["resumed_from_step"]) for r in rows] == [(1, int(restart))]
    same_as_never_stopped(run_dir, never_stopped, tmp_path)


def test_a_failure_past_max_restarts_ends_the_run_with_the_count(tmp_path):
    process = start(tmp_path / "run", "cluster.max_restarts=1")
    kill_rank_1_at(process, [2, 2])
    out = finish(process)
    assert out.returncode == 1
    assert re.search(r"rank 1 of 2 failed: killed by SIGKILL(?: \(then rank\(s\) 0 failed "
                     r"too\))?\. The other ranks were stopped\. That was failure 2 of the run: all "
                     r"cluster\.max_restarts=1 restart\(s\) were used\.", out.stderr), out.stderr



def test_under_torchrun_its_max_restarts_must_be_the_configs(tmp_path):
    """torchrun's agent restarts its ranks (--max-restarts); each resumes from the latest
    checkpoint as a relaunch does. The two counts must agree: one line before training."""
    out = finish(start(tmp_path / "other", "cluster.max_restarts=2",
                       torchrun=["--nproc-per-node=2", "--max-restarts=1"]))
    assert out.returncode != 0
    assert ("cluster.max_restarts=2 but torchrun was started with --max-restarts=1"
            in out.stderr), out.stderr
    assert not (tmp_path / "other" / "metrics.jsonl").exists()
