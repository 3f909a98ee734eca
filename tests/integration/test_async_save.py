"""checkpoint.async_save on real launch.py runs of two gloo ranks: training goes on while a
checkpoint is written; kill -9 during a background write leaves the previous checkpoint as the
latest, and the same command resumes from it to the same final checkpoint, byte for byte, as a
run that saved each checkpoint at once and was never stopped. A full disk during a background
write stops the run with the one line a blocking save gives, and keeps the last good one."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from test_safety import error_lines

from config_helpers import ROOT, finish
from disk_helpers import tmpfs
from stall_helpers import stall_env

RUN = ("cluster.procs_per_node=2", "train.micro_batch_size=2", "train.seq_length=32",
       "logger.log_interval=1", "train.eval_interval=null", "schedule.lr_warmup_samples=0",
       "schedule.lr_warmup_fraction=null", "train.train_samples=64", "checkpoint.save_interval=4")


def start(run_dir: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    base = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "RANK")}
    return subprocess.Popen([sys.executable, str(ROOT / "launch.py"), f"hydra.run.dir={run_dir}",
                             *RUN, *args], text=True, cwd=ROOT, env=base | (env or {}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def contents(checkpoint: Path, out: Path) -> dict:
    """Every value a checkpoint holds (DCP's own reader, into one torch.save file)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=False)


def same(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def test_a_kill_during_a_background_write_resumes_from_the_one_before_bitwise(tmp_path):
    reference = finish(start(tmp_path / "at_once"))  # 16 steps, saved at once every 4
    assert reference.returncode == 0, reference.stderr
    # The second save (step 8) sleeps in its writer thread on both ranks: training goes on.
    env = stall_env(tmp_path / "site", "trainer.checkpoint.dcp.write", call=2)
    run_dir = tmp_path / "async"
    process = start(run_dir, "checkpoint.async_save=true", env=env)
    seen = []
    for line in process.stdout:
        seen.append(line)
        if line.startswith("step     10/16"):  # two steps past the save in flight
            break
    text = "".join(seen)
    assert re.search(r"saving .*step_00000008 in the background \([\d.]+ MiB staged", text), text
    assert re.search(r"saved .*step_00000004 \(written in the background in", text), text
    os.kill(process.pid, signal.SIGKILL)  # launch.py; its ranks die with it
    process.wait()
    time.sleep(1)  # the kernel's SIGKILL of the ranks (their parent died) lands
    folder = run_dir / "checkpoints"
    # step 8 never became a checkpoint (at most its .tmp folder, which a resume ignores)
    assert sorted(p.name for p in folder.iterdir() if not p.name.endswith(".tmp")) == [
        "step_00000004"]
    resumed = finish(start(run_dir, "checkpoint.async_save=true"))  # the same command again
    assert resumed.returncode == 0, resumed.stderr
    assert "16 steps from step 4" in resumed.stdout, resumed.stdout
    assert sorted(p.name for p in folder.iterdir()) == [
        f"step_{s:08d}" for s in (4, 8, 12, 16)]
    final = contents(folder / "step_00000016", tmp_path / "resumed.pt")
    expected = contents(tmp_path / "at_once" / "checkpoints" / "step_00000016",
                        tmp_path / "expected.pt")
    assert final.keys() == expected.keys()
    assert len([k for k in final if k.startswith("optim.exp_avg_sq.")]) > 0
    # "rng", torch's generator state, differs between two plain runs of the same command too
    # (the trainer draws nothing from it; a resume restores it): every other value is equal.
    assert [k for k in final if not same(final[k], expected[k])] in ([], ["rng"])
    steps = [json.loads(line)["step"] for line in
             (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 17))  # each step logged once


def test_a_full_disk_during_a_background_save_is_one_line_and_keeps_the_last_good_one(tmp_path):
    """The disk holds one checkpoint of the tiny model (about 1.5 MiB) but not two: the save at
    step 8 fails in the writer threads while training goes on. The run stops with the one line
    a blocking save gives (trainer.checkpoint.dcp.CheckpointSaveFailed), and step 4 stays the
    latest, whole."""
    from trainer.checkpoint.integrity import verify

    with tmpfs(tmp_path / "small_disk", "size=2500k") as disk:
        folder = disk / "ckpts"
        out = finish(start(tmp_path / "run", "checkpoint.async_save=true",
                           f"checkpoint.dir={folder}"))
        assert out.returncode == 1, out.stdout + out.stderr
        assert "Traceback" not in out.stderr, out.stderr
        (line,) = error_lines(out.stderr)
        failed, good = folder / "step_00000008", folder / "step_00000004"
        assert re.fullmatch(
            rf"rank [01] of 2 failed: CheckpointSaveFailed: saving checkpoint "
            rf"{re.escape(str(failed))} failed on rank [01]: No space left on device\. Nothing "
            rf"of it was kept; the latest checkpoint is {re.escape(str(good))}\. Fix: free space "
            rf"on its disk \(or set checkpoint.dir to another disk\), then run the same command "
            rf"again to resume( \(then rank\(s\) [01] failed too\))?\. The other ranks were "
            rf"stopped\.", line), line
        assert re.search(r"saving .*step_00000008 in the background", out.stdout), out.stdout
        assert sorted(p.name for p in folder.iterdir()) == [good.name]
        assert verify(good) is None  # whole: every file's checksum as recorded
