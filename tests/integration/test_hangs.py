"""A hang explains itself (trainer/train/hangs.py), on real launch.py runs of two gloo ranks: one
rank stalls on purpose (tests/stall_helpers.py makes its train_step sleep at a chosen step), the
other waits in a collective; after cluster.timeout_s every rank's Python stacks are in
stacks/rank_R.txt and the one error line names the collective and the rank that never reached
it. SIGUSR1 to launch.py, or to a rank, writes every rank's stacks and the run goes on."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from config_helpers import ROOT, finish
from stall_helpers import stall_env

RUN = ("cluster.procs_per_node=2", "train.micro_batch_size=2", "train.seq_length=32",
       "logger.log_interval=1", "train.eval_interval=null", "schedule.lr_warmup_samples=0",
       "schedule.lr_warmup_fraction=null")



def start(run_dir: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    base = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "RANK")}
    return subprocess.Popen([sys.executable, str(ROOT / "launch.py"), f"hydra.run.dir={run_dir}",
                             *RUN, *args], text=True, cwd=ROOT, env=base | (env or {}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_a_stalled_rank_is_named_and_every_rank_leaves_its_stacks(tmp_path):
    # rank 1's second step sleeps before any of its collectives
    env = stall_env(tmp_path / "site", "trainer.train.step.train_step", call=2, rank=1)
    run_dir = tmp_path / "run"
    began = time.monotonic()
    out = finish(start(run_dir, "cluster.timeout_s=4", "train.train_samples=64", env=env))
    took = time.monotonic() - began
    assert out.returncode == 1, out.stdout + out.stderr
    # launch.py's error (the rank that found the hang printed it too, "rank 0: the run hung")
    error = next(line for line in out.stderr.splitlines() if line.startswith("the run hung"))
    # rank 0 waits in its step's first collective, over a group rank 1 belongs to
    assert re.search(r"the run hung: a collective waited over cluster.timeout_s=4 s: rank\(s\) 0 "
                     r"wait in \w+ over \w+ \(ranks 0, 1\) that rank\(s\) 1 never reached; "
                     r"rank\(s\) 1 in no collective\. Each rank's Python stacks: "
                     + re.escape(str(run_dir / "stacks")), error), error
    assert error.endswith("The ranks were stopped."), error
    assert "Traceback" not in out.stderr, out.stderr
    stacks = {r: (run_dir / "stacks" / f"rank_{r}.txt").read_text() for r in (0, 1)}
    first = {r: json.loads(text.splitlines()[0]) for r, text in stacks.items()}
    assert first[0]["waiting"]["seconds"] >= 4 and first[1]["waiting"] is None, first
    assert "in stalled" in stacks[1] and "time.sleep(" in stacks[1], stacks[1]
    assert "Thread MainThread" in stacks[0] and "in _run" in stacks[0], stacks[0]
    # Found after 4 s, not after the backend's timeout (4 + 30 s); the stalled rank was stopped.
    assert took < 60, took
    assert not re.search(r"step\s+2/", out.stdout), out.stdout


def test_sigusr1_to_launch_py_or_a_rank_writes_every_ranks_stacks_and_the_run_goes_on(tmp_path):
    run_dir, folder = tmp_path / "run", tmp_path / "run" / "stacks"
    process = start(run_dir, "train.train_samples=1024")  # 256 steps: the signals arrive mid-run
    lines = []
    for line in process.stdout:  # wait until both ranks train
        lines.append(line)
        if line.startswith("step      2/"):
            break
    pids = [int(p) for p in re.findall(r"rank \d \(pid (\d+)\)", "".join(lines))]
    assert len(pids) == 2, lines
    for target in (process.pid, pids[1]):
        asked = time.time()
        os.kill(target, signal.SIGUSR1)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(
                (folder / f"rank_{r}.txt").exists()
                and (folder / f"rank_{r}.txt").stat().st_mtime >= asked for r in (0, 1)):
            time.sleep(0.1)
        for rank in (0, 1):
            text = (folder / f"rank_{rank}.txt").read_text()
            assert (folder / f"rank_{rank}.txt").stat().st_mtime >= asked, (target, rank)
            assert text.splitlines()[1].startswith(f"rank {rank} "), text
            assert "Thread hang-watch" in text, text
    rest = finish(process)
    assert rest.returncode == 0, rest.stderr
    assert "SIGUSR1: every rank writes its Python stacks to" in "".join(lines) + rest.stdout
    assert re.search(r"step\s+256/256", rest.stdout), rest.stdout[-2000:]
