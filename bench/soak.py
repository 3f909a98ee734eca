"""Soak: a long run of 8 gloo ranks (weight shards 4 x context parallel 2, model=tiny) with a
checkpoint every 256 steps written in the background (checkpoint.async_save), watched from
outside through /proc: each rank's resident set and open file descriptors, sampled once a
second. Then the same run with one rank killed (SIGKILL) mid-way under cluster.max_restarts=1.

- rss_growth: each rank's resident set at the end over its resident set after warm-up (the
  first checkpoint written: by then every buffer, the writer thread and its gloo group exist),
  the worst rank. Goal < 1.02. worst_rank_rss_mib_by_step: that rank's resident set every 512
  steps, to tell a leak (climbs to the end) from an allocator settling (flattens out).
- fds_growth: open file descriptors at the end less after warm-up, the worst rank. Goal 0.
- left_running: processes of the run alive once launch.py has exited (the ranks, and anything
  they started). Goal 0.
- restarted: the run with a kill -9 ends with exit code 0, one restart recorded in
  restarts.jsonl, every step logged once, nothing left running.

    python bench/soak.py            # 4,096 steps, then 4,096 with a kill (~20 min here)
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

LAYOUT = ["cluster.procs_per_node=8", "parallel.tensor_parallel_num_weight_shards=4",
          "parallel.context_parallel_size=2", "train.micro_batch_size=1", "train.seq_length=64",
          "train.global_batch_size=4", "checkpoint.save_interval=256",
          "checkpoint.async_save=true", "logger.log_interval=256", "train.eval_interval=null",
          "schedule.lr_warmup_samples=0", "schedule.lr_warmup_fraction=null"]


def _status(pid: int) -> tuple[int, int] | None:
    """(resident bytes, open fds) of a live process, else None."""
    try:
        rss = next(int(line.split()[1]) * 1024 for line in
                   Path(f"/proc/{pid}/status").read_text().splitlines()
                   if line.startswith("VmRSS:"))
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, StopIteration):
        return None


def _descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc's parent links)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier}
        found |= frontier
    return found


def soak(steps: int, kill_at: int | None = None) -> dict:
    """One run of `steps` steps; kill_at: the step after which rank 3 is killed (SIGKILL)."""
    with tempfile.TemporaryDirectory(prefix="gtp-soak-") as tmp:
        run_dir = Path(tmp) / "run"
        args = [sys.executable, str(ROOT / "launch.py"), f"hydra.run.dir={run_dir}", *LAYOUT,
                f"train.train_samples={steps * 4}"]
        if kill_at is not None:
            args.append("cluster.max_restarts=1")
        env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "RANK")}
        process = subprocess.Popen(args, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT)
        ranks: dict[int, int] = {}  # rank -> pid, the newest start's
        warm: dict[int, tuple[int, int]] = {}
        last: dict[int, tuple[int, int]] = {}
        by_step: dict[int, dict[int, int]] = {}  # logged step -> rank -> largest RSS since
        state = {"warm": False, "restarted": False, "pids": set(), "step": 0}

        def sample() -> None:
            while process.poll() is None:
                for rank, pid in list(ranks.items()):
                    got = _status(pid)
                    if got is not None:
                        last[rank] = got
                        if state["warm"] and rank not in warm:
                            warm[rank] = got
                        seen = by_step.setdefault(state["step"], {})
                        seen[rank] = max(seen.get(rank, 0), got[0])
                time.sleep(1.0)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        began = time.perf_counter()
        lines = []
        for line in process.stdout:
            lines.append(line)
            if line.startswith("started "):
                ranks = {int(r): int(p) for r, p in re.findall(r"rank (\d+) \(pid (\d+)\)", line)}
                state["pids"] |= set(ranks.values())
                warm.clear()
                state["warm"] = False
            if line.startswith("saved ") and "in the background" in line:
                state["warm"] = True  # the writer thread and its group exist
            step = re.match(r"step\s+(\d+)/", line)
            if step:
                state["step"] = int(step.group(1))
            if step and int(step.group(1)) % 1024 == 0:
                print(f"  soak{'' if kill_at is None else ' with a kill'}: step "
                      f"{step.group(1)}/{steps} ({time.perf_counter() - began:.0f} s)", flush=True)
            if kill_at is not None and step and int(step.group(1)) >= kill_at and \
                    not state["restarted"]:
                state["restarted"] = True
                os.kill(ranks[3], signal.SIGKILL)
        code = process.wait()
        seconds = time.perf_counter() - began
        sampler.join()
        time.sleep(1.0)
        alive = [pid for pid in state["pids"] if _status(pid) is not None]
        alive += sorted(_descendants(process.pid))
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
        logged = [m["step"] for m in metrics if "loss" in m]
        restarts = (run_dir / "restarts.jsonl").read_text().splitlines() \
            if (run_dir / "restarts.jsonl").exists() else []
        worst = max(warm, key=lambda r: last[r][0] / warm[r][0])
        out = {"exit_code": code, "steps": steps, "seconds": round(seconds, 1),
               "rss_growth": last[worst][0] / warm[worst][0],
               # the worst rank's largest resident set between logged steps: a leak climbs
               # to the end, an allocator that settles flattens out
               "worst_rank": worst,
               "worst_rank_rss_mib_by_step": {step: round(seen[worst] / 2**20, 1)
                                              for step, seen in sorted(by_step.items())
                                              if worst in seen and step % 512 == 0},
               "fds_growth": max(last[r][1] - warm[r][1] for r in warm),
               "rss_after_warmup_mib": {r: round(warm[r][0] / 2**20, 1) for r in sorted(warm)},
               "left_running": len(alive), "restarts": len(restarts),
               "steps_logged_once": logged == sorted(set(logged)) and len(logged) > 0,
               "tail": "".join(lines[-3:])}
        return out


def measure(quick: bool = True) -> dict:
    """4,096 steps in either mode: a leak shows over a long run, not a short one."""
    steps = 4096
    return {"plain": soak(steps), "killed_once": soak(steps, kill_at=steps // 2)}


if __name__ == "__main__":
    print(json.dumps(measure("--full" not in sys.argv), indent=1))
