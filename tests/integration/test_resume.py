"""What a resume continues, and what it refuses, from the command line with real ranks: progress
is samples under any global batch size (every sample index trained exactly once, checked from
outside the trainer by tracing the stream's fetches, and the learning rate of each consumed
count equal to an uninterrupted run's), a checkpoint folder is one run's at a time, a checkpoint
whose bytes changed is skipped, and what the checkpoint's metadata can tell is one line before
any rank starts."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
from test_launch import command, make_dataset, metrics, start
from test_safety import error_lines, wait_for_steps

from config_helpers import ROOT
from disk_helpers import tmpfs

TRACER = Path(__file__).parent / "sample_trace"
# 2 ranks of data parallel, one sample a micro-batch: global batches of 2, 4, ... all valid.
# The schedule's lengths are fixed, so every run below has the same learning rate at the same
# consumed samples, whatever its train.train_samples.
RUN = ("cluster.procs_per_node=2", "train.micro_batch_size=1", "schedule.lr_decay_samples=48",
       "schedule.lr_warmup_fraction=null", "schedule.lr_warmup_samples=6")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory)


def launch(dataset: Path, run_dir: Path, *overrides: str, trace: Path | None = None,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items()
               if k not in ("HYDRA_FULL_ERROR", "RANK", "WORLD_SIZE")}
    if trace is not None:
        environ["PYTHONPATH"] = os.pathsep.join([str(TRACER), str(ROOT)])
        environ["GTP_SAMPLE_TRACE"] = str(trace)
    args = command("train.seq_length=32", "train.eval_interval=null", "logger.log_interval=1",
                   "cluster.timeout_s=20", f"data.path={dataset}", f"hydra.run.dir={run_dir}",
                   *overrides)
    return subprocess.run(args, cwd=ROOT, env={**environ, **(env or {})}, capture_output=True,
                          text=True, timeout=300)


def traced(trace: Path) -> Counter:
    return Counter(i for line in trace.read_text().splitlines() for i in json.loads(line))


@pytest.fixture(scope="module")
def uninterrupted(dataset, tmp_path_factory) -> dict[int, float]:
    """Learning rate by the samples consumed before a step (Megatron's scheduler is stepped
    after each update), of one run of 48 samples at global batch 2."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    out = launch(dataset, run_dir, *RUN, "train.global_batch_size=2", "train.train_samples=48")
    assert out.returncode == 0, out.stderr
    return {before(m): m["lr"] for m in metrics(run_dir)}


def before(record: dict) -> int:
    """The samples consumed before the step a metrics.jsonl row logs."""
    return record["consumed_samples"] - record["global_batch_size"]


@pytest.mark.parametrize("first,then", [(4, 2), (2, 4)])
def test_a_resume_under_another_global_batch_trains_every_sample_once_to_the_end(
        dataset, tmp_path, uninterrupted, first, then):
    run_dir, trace = tmp_path / "run", tmp_path / "trace.jsonl"
    out = launch(dataset, run_dir, *RUN, f"train.global_batch_size={first}",
                 "train.train_samples=32", trace=trace)
    assert out.returncode == 0, out.stderr
    out = launch(dataset, run_dir, *RUN, f"train.global_batch_size={then}",
                 "train.train_samples=48", trace=trace)
    assert out.returncode == 0, out.stderr
    resumed_at = 32 // first
    assert (f"global batch {then} samples, {resumed_at + 16 // then} steps from step "
            f"{resumed_at} (samples 32 to 48)") in out.stdout
    assert traced(trace) == Counter(range(48))  # each stream index fetched once, none past 48
    logged = metrics(run_dir)
    assert [m["consumed_samples"] for m in logged] == (
        list(range(first, 33, first)) + list(range(32 + then, 49, then)))
    assert [m["step"] for m in logged] == list(range(1, resumed_at + 16 // then + 1))
    assert all(m["lr"] == uninterrupted[before(m)] for m in logged)


def test_a_resume_from_a_count_off_the_new_batch_ends_with_the_smaller_step_or_is_refused(
        dataset, tmp_path, uninterrupted):
    run_dir, trace = tmp_path / "run", tmp_path / "trace.jsonl"
    out = launch(dataset, run_dir, *RUN, "train.global_batch_size=2", "train.train_samples=6",
                 trace=trace)
    assert out.returncode == 0, out.stderr
    # 6 consumed, then global batches of 4 up to 48: ten of them and a last one of 2 samples.
    out = launch(dataset, run_dir, *RUN, "train.global_batch_size=4", "train.train_samples=48",
                 trace=trace)
    assert out.returncode == 0, out.stderr
    assert traced(trace) == Counter(range(48))
    logged = metrics(run_dir)
    assert [m["consumed_samples"] for m in logged] == [2, 4, 6, *range(10, 47, 4), 48]
    assert all(m["lr"] == uninterrupted[before(m)] for m in logged)
    # From 6 at a global batch of 8 with micro-batches of 2 (4 samples a step across the two
    # lanes at least): the last step would hold 2, which is no global batch. Before any rank.
    again = tmp_path / "again"
    out = launch(dataset, again, *RUN, "train.global_batch_size=2", "train.train_samples=6")
    assert out.returncode == 0, out.stderr
    out = launch(dataset, again, *RUN, "train.global_batch_size=8", "train.micro_batch_size=2",
                 "train.train_samples=48")
    (line,) = error_lines(out.stderr)
    assert out.returncode != 0 and "started rank" not in out.stdout, out.stdout
    assert line.startswith(f"this run's latest checkpoint {again / 'checkpoints'}") and (
        "has consumed 6 samples: the 42 left to train.train_samples=48 are 5 step(s) of "
        "train.global_batch_size=8 and a last one of 2 sample(s), which is no global batch of "
        "this layout") in line and "Fix: resume with " in line, line


def test_one_checkpoint_folder_is_one_runs_at_a_time(dataset, tmp_path):
    shared = tmp_path / "shared_checkpoints"
    first = start(dataset, tmp_path / "a", "train.train_samples=400000",
                  f"checkpoint.dir={shared}")
    wait_for_steps(tmp_path / "a", 2, first)
    second = launch(dataset, tmp_path / "b", "train.train_samples=64", f"checkpoint.dir={shared}",
                    "train.seed=7")
    first.proc.kill()
    first.proc.wait(timeout=60)
    assert second.returncode != 0
    (line,) = error_lines(second.stderr)
    assert line.startswith(f"checkpoint folder {shared} is in use by pid {first.proc.pid} on "
                           f"host ") and "Fix: " in line and "checkpoint.dir" in line, line
    assert not (tmp_path / "b").exists()  # the refused run left no folder


def test_changed_bytes_are_skipped_and_another_model_or_stream_is_one_line_before_the_ranks(
        dataset, tmp_path):
    run_dir, four = tmp_path / "run", "train.micro_batch_size=4"
    out = launch(dataset, run_dir, four, "train.train_samples=32", "checkpoint.save_interval=2")
    assert out.returncode == 0, out.stderr
    ckpts = run_dir / "checkpoints"
    data = max((ckpts / "step_00000008").glob("*.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one bit, the size unchanged: only the checksum can tell
    data.write_bytes(bytes(raw))
    load = tmp_path / "load"
    for folder, overrides, named in (
            (run_dir, ("model.hidden_size=128",),
             "weight 'embed.weight' has shape (256, 64), this model's is (256, 128)"),
            (run_dir, ("train.seq_length=16",), "was trained on the sample stream"),
            (run_dir, ("optim=muon",), "holds AdamW's moments for "
                                       "'layers.0.attn.qkv.weight', where this run's optimizer "
                                       "(optim=muon) keeps a momentum"),
            (run_dir, ("train.train_samples=24",),
             "has consumed 32 samples, past train.train_samples=24"),
            (load, (f"checkpoint.load={ckpts / 'step_00000002'}", "train.train_samples=8"),
             "has consumed 8 samples, equal to train.train_samples=8")):
        out = launch(dataset, folder, four, *overrides)
        assert out.returncode != 0 and "steps from step" not in out.stdout, out.stdout
        (line,) = error_lines(out.stderr)
        assert named in line and "Fix:" in line, line
    assert not load.exists()  # refused before anything of a run was written
    out = launch(dataset, run_dir, four, "train.train_samples=48")
    assert out.returncode == 0, out.stderr
    assert (f"warning: skipped checkpoint {ckpts / 'step_00000008'}: its file {data.name} does "
            f"not match the checksum recorded at save") in out.stdout
    assert "12 steps from step 6" in out.stdout


def test_a_full_disk_during_a_save_is_one_line_with_the_os_words_and_leaves_no_tmp(
        dataset, tmp_path):
    with tmpfs(tmp_path / "small_disk", "size=600k") as disk:
        # A checkpoint of the tiny model with its Adam moments is about 1.6 MB.
        out = launch(dataset, tmp_path / "run", "cluster.procs_per_node=2",
                     "train.train_samples=16", f"checkpoint.dir={disk / 'ckpts'}")
        assert out.returncode != 0
        lines = error_lines(out.stderr)
        assert len(lines) == 1, out.stderr
        (line,) = lines
        # Both ranks fail alike; the launcher names the first whose report reached it.
        saved = re.escape(str(disk / "ckpts" / "step_00000001"))
        assert re.match(rf"rank [01] of 2 failed: CheckpointSaveFailed: saving checkpoint "
                        rf"{saved} failed on rank [01]: ", line) and (
            "No space left on device" in line and "Fix: free space on its disk" in line), line
        assert "Traceback" not in out.stderr and list((disk / "ckpts").iterdir()) == []


def test_rank_variables_left_in_the_shell_are_one_line(dataset, tmp_path):
    for stale in ({"RANK": "1", "WORLD_SIZE": "2"}, {"WORLD_SIZE": "2"}):
        out = launch(dataset, tmp_path / "run", "train.train_samples=16", env=stale)
        assert out.returncode != 0
        (line,) = error_lines(out.stderr)
        assert " without " in line and "MASTER_ADDR, MASTER_PORT" in line, line
        assert f"Fix: `unset {' '.join(stale)}`" in line, line
        assert not (tmp_path / "run").exists()
    # All four of a torchrun rank's, but no rank 0 (it waited 102 s for one, then a 68-line
    # traceback): a line after 5 s saying what it waits for, one line at cluster.timeout_s;
    # a RANK past WORLD_SIZE: one line at once.
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    every = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for rank, named in (("1", "nothing listened at MASTER_ADDR:MASTER_PORT within "
                              "cluster.timeout_s=8 s"), ("2", "RANK must be below WORLD_SIZE")):
        began = time.monotonic()
        out = launch(dataset, tmp_path / "run", "train.train_samples=16",
                     "cluster.procs_per_node=2", "cluster.timeout_s=8",
                     env={"RANK": rank, **every})
        took = time.monotonic() - began
        assert out.returncode != 0
        waiting = [x for x in out.stderr.splitlines() if "waiting up to" in x]
        assert len(waiting) == (rank == "1"), out.stderr
        (line,) = [x for x in error_lines(out.stderr) if "waiting up to" not in x]
        assert line.startswith(f"RANK={rank} WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT="
                               f"{port} in the environment") and named in line, line
        assert "Fix: `unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT`" in line, line
        assert took < 25, took  # cluster.timeout_s of trying the port, the interpreter's start
        assert not (tmp_path / "run").exists()


def test_ranks_started_by_hand_wait_for_a_slow_rank_0(dataset, tmp_path):
    """Not torchrun (a PyTorchJob, an srun wrapper, by hand): rank 1 starts first and says after
    5 s what it waits for; rank 0 comes 8 s later and the run trains to the end."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    every = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    args = command("train.seq_length=32", "train.eval_interval=null", "cluster.timeout_s=60",
                   "cluster.procs_per_node=2", "train.train_samples=32", "logger.log_interval=1",
                   f"data.path={dataset}",
                   f"hydra.run.dir={tmp_path / 'run'}")
    environ = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    started = []
    for rank in ("1", "0"):
        started.append(subprocess.Popen(args, cwd=ROOT, env={**environ, **every, "RANK": rank},
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True))
        if rank == "1":
            time.sleep(8)
    outs = [process.communicate(timeout=240) for process in started]
    assert [process.returncode for process in started] == [0, 0], outs
    assert "waiting up to cluster.timeout_s=60 s for rank 0" in outs[0][1]
    assert [m["step"] for m in metrics(tmp_path / "run")] == [1, 2]
