"""launch.py trains from the command line as a user runs it: the run directory's artifacts,
checkpoints, resuming (the latest of a folder, and bitwise from a mid-run checkpoint), bad input
failing in one line before training, and logger=wandb offline. Each launch pays the torch import
(~4 s), so the runs are shared: run A is launched once and read by several tests, and the
bad-input cases run side by side.

Every launch gets HOME (and the wandb folders) inside tmp_path, so no test reads or writes the
real home directory; the dataset is prepared from generated text files.
"""
from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainer.data.dataset import prepare

from config_helpers import ROOT, finish

MICRO, STEPS = 4, 8  # one process: global batch = micro_batch_size = 4
SMALL_RUN = ("train.micro_batch_size=4", "train.seq_length=32", "logger.log_interval=1",
             "train.eval_interval=4", "train.eval_samples=8", "schedule.lr_warmup_samples=8",
             "schedule.lr_warmup_fraction=null")
WORDS = "the quick brown fox jumps over a lazy dog while seven bold wizards hum".split()
STEP_KEYS = ("step", "consumed_samples", "loss", "lr", "grad_norm", "tokens_per_s")


def start(home: Path, *args: str, env_extra: dict | None = None) -> subprocess.Popen:
    home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update({"HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"),
                "XDG_CONFIG_HOME": str(home / ".config")}, **(env_extra or {}))
    return subprocess.Popen([sys.executable, str(ROOT / "launch.py"), *args], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)


def train_run(home: Path, data: Path, run_dir: Path, *overrides: str,
              env_extra: dict | None = None) -> subprocess.CompletedProcess:
    return finish(start_train(home, data, run_dir, *overrides, env_extra=env_extra), 120)


def start_train(home: Path, data: Path, run_dir: Path, *overrides: str,
                env_extra: dict | None = None) -> subprocess.Popen:
    return start(home, f"data.path={data}", f"hydra.run.dir={run_dir}", *SMALL_RUN, *overrides,
                 env_extra=env_extra)


def step_records(run_dir: Path) -> list[dict]:
    """metrics.jsonl's training-step lines (evaluation lines carry eval_loss instead)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def exact(record: dict) -> tuple:
    return tuple(record[k] for k in ("step", "consumed_samples", "loss", "grad_norm", "lr"))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("train_cli")


@pytest.fixture(scope="module")
def dataset(base: Path) -> Path:
    """A few generated text documents prepared into a byte-token dataset (~25k tokens)."""
    rng, src = random.Random(0), base / "text"
    src.mkdir()
    for i in range(6):
        (src / f"doc{i}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(900)))
    return prepare(src, base / "dataset", valid_fraction=0.2)


@pytest.fixture(scope="module")
def run_a(base: Path, dataset: Path) -> tuple[Path, subprocess.CompletedProcess]:
    """8 steps of 4 samples, a checkpoint every 4 steps."""
    run_dir = base / "run_a"
    out = train_run(base / "home", dataset, run_dir, f"train.train_samples={STEPS * MICRO}",
                    "checkpoint.save_interval=4")
    assert out.returncode == 0, out.stderr
    return run_dir, out


# ----------------------------------------------------------------------------- a training run

def test_a_run_writes_metrics_config_layout_and_progress(run_a):
    run_dir, out = run_a
    records = step_records(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert set(STEP_KEYS) <= set(r), r
        assert r["consumed_samples"] == r["step"] * MICRO  # one global batch per step
        assert r["loss"] > 0 and r["grad_norm"] > 0 and r["tokens_per_s"] > 0
    # Megatron's warmup: the first step trains at lr_warmup_init (0), the next ones above it.
    assert records[0]["lr"] == 0 and all(r["lr"] > 0 for r in records[1:])
    assert records[0]["loss"] > records[-1]["loss"]  # it learns something
    evals = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
             if "eval_loss" in r]
    assert [e["step"] for e in evals] == [4, 8]

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    layout = json.loads((run_dir / "layout.json").read_text())
    assert "${" not in (run_dir / "config.yaml").read_text()  # resolved
    assert config["layout"] == layout["derived"]
    assert config["layout"]["global_batch_size"] == MICRO
    assert config["layout"]["world_size"] == 1
    assert config["train"]["train_samples"] == STEPS * MICRO

    progress = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert len(progress) == STEPS
    assert re.match(rf"step\s+1/{STEPS} \| samples\s+4 \| loss \d", progress[0]), progress[0]
    assert "Traceback" not in out.stderr


def test_a_run_leaves_finished_checkpoints_and_no_tmp_folder(run_a):
    run_dir, _ = run_a
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000004", "step_00000008"]
    for folder in checkpoints.iterdir():
        assert (folder / ".metadata").is_file()
        meta = json.loads((folder / "meta.json").read_text())
        assert meta["consumed_samples"] == int(folder.name[len("step_"):]) * MICRO
    assert not list(run_dir.rglob("*.tmp"))


# ----------------------------------------------------------------------------------- resuming

def test_resuming_from_a_folder_of_checkpoints_continues_after_the_latest(base, dataset, run_a):
    run_a_dir, _ = run_a
    run_dir = base / "resume_latest"
    out = train_run(base / "home", dataset, run_dir, f"train.train_samples={10 * MICRO}",
                    f"checkpoint.load={run_a_dir / 'checkpoints'}")
    assert out.returncode == 0, out.stderr
    records = step_records(run_dir)
    assert [r["step"] for r in records] == [9, 10]  # after step_00000008, the latest
    assert [r["consumed_samples"] for r in records] == [36, 40]
    assert "from step 8" in out.stdout
    assert (run_dir / "checkpoints" / "step_00000010" / ".metadata").is_file()


def test_resuming_mid_run_reproduces_the_uninterrupted_run_bitwise(base, dataset, run_a):
    run_a_dir, _ = run_a
    run_dir = base / "resume_mid"
    out = train_run(base / "home", dataset, run_dir, f"train.train_samples={STEPS * MICRO}",
                    f"checkpoint.load={run_a_dir / 'checkpoints' / 'step_00000004'}")
    assert out.returncode == 0, out.stderr
    resumed = step_records(run_dir)
    assert [r["step"] for r in resumed] == [5, 6, 7, 8]
    uninterrupted = [r for r in step_records(run_a_dir) if r["step"] > 4]
    assert [exact(r) for r in resumed] == [exact(r) for r in uninterrupted]


# ---------------------------------------------------------------------------- compiled blocks

def test_compiled_blocks_train_as_eager_and_a_resume_finds_their_kernels(base, dataset, run_a):
    """train.compile=blocks: the first step's line says what it compiled, no later step
    recompiles and nothing but collectives breaks a graph (one process: none); the losses are
    run A's (eager) to fp32 rounding; started again from its step 4 in its folder, it finds
    every kernel in the folder's compile_cache and compiles none."""
    run_dir = base / "compiled"
    first = train_run(base / "home", dataset, run_dir, "train.compile=blocks",
                      f"train.train_samples={STEPS * MICRO}", "checkpoint.save_interval=4")
    assert first.returncode == 0, first.stderr
    assert "; train.compile=blocks: the first step compiles the blocks\n" in first.stdout
    line = re.search(r"step 1 compiled [1-9]\d* graph\(s\) in ([\d.]+) s of its ([\d.]+) s; "
                     r"inductor: 0 found in the cache, [1-9]", first.stdout)
    assert line and 0 < float(line[1]) <= float(line[2]), first.stdout  # compiling is in the step
    assert re.search(r"0 recompile\(s\) after the first step; [\d.]+ s compiling in training "
                     r"steps; graph breaks at none", first.stdout), first.stdout
    # Again from its step 4, in the same folder (as a relaunch after a failure would be).
    again = train_run(base / "home", dataset, run_dir, "train.compile=blocks",
                      f"train.train_samples={STEPS * MICRO}", "checkpoint.save_interval=4",
                      "checkpoint.resume=false",
                      f"checkpoint.load={run_dir / 'checkpoints' / 'step_00000004'}")
    assert again.returncode == 0, again.stderr
    found = re.search(r"step 5 compiled \d+ graph\(s\) .*inductor: (\d+) found in the cache, "
                      r"(\d+) compiled", again.stdout)
    assert found and int(found[1]) > 0 and int(found[2]) == 0, again.stdout
    assert "0 recompile(s) after the first step" in again.stdout
    compiled, eager = step_records(run_dir), step_records(run_a[0])
    assert [r["step"] for r in compiled] == [r["step"] for r in eager]
    for got, want in zip(compiled, eager):
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * want["loss"], (got, want)
        assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-5 * want["grad_norm"]


# ------------------------------------------------------------------------------ bad input

# name -> (overrides, texts stderr must hold)
BAD_INPUT = {
    "train_samples": (["train.train_samples=66"],
                      ["train.train_samples=66", "global batch size 4", "64 or 68"]),
    "warmup": (["train.train_samples=64", "schedule.lr_warmup_samples=64",
                "schedule.lr_warmup_fraction=null"],
               ["schedule.lr_warmup_samples=64", "schedule.lr_decay_samples"]),
    "empty_checkpoint": (["train.train_samples=64", "checkpoint.load={empty}"],
                         ["checkpoint.load=", "no checkpoint there"]),
    "unprepared_data": (["train.train_samples=64", "data.path={text}"],
                        ["meta.json", "python -m trainer.prepare"]),
}


@pytest.fixture(scope="module")
def bad_runs(base: Path, dataset: Path) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Each bad-input case launched once, all at the same time (each waits on its torch import
    or less); two tests read the results."""
    (base / "empty").mkdir()
    started = {}
    for name, (overrides, _) in BAD_INPUT.items():
        overrides = [o.format(empty=base / "empty", text=base / "text") for o in overrides]
        run_dir = base / f"bad_{name}"
        # data.path comes first in start_train; a later data.path override wins.
        started[name] = run_dir, start_train(base / "home", dataset, run_dir, *overrides)
    return {name: (run_dir, finish(process)) for name, (run_dir, process) in started.items()}


@pytest.mark.parametrize("name", list(BAD_INPUT))
def test_bad_input_fails_with_a_message_before_training(bad_runs, name):
    run_dir, out = bad_runs[name]
    _, texts = BAD_INPUT[name]
    assert out.returncode != 0
    assert any(all(t in line for t in texts) for line in out.stderr.splitlines()), out.stderr
    assert not any(line.startswith("step ") for line in out.stdout.splitlines())
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()
    # Nothing started: not even the run directory's artifacts.
    assert not (run_dir / "layout.json").exists() and not (run_dir / "config.yaml").exists()


@pytest.mark.parametrize("name", list(BAD_INPUT))
def test_bad_input_prints_no_traceback(bad_runs, name):
    _, out = bad_runs[name]
    assert "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) <= 4, out.stderr  # Hydra's header, message, hint


# --------------------------------------------------------------------------------- logger

def test_wandb_logger_disabled_runs_offline_and_writes_metrics(tmp_path, dataset):
    home, wandb_dir = tmp_path / "home", tmp_path / "wandb"
    env = {"WANDB_MODE": "disabled", "WANDB_DIR": str(wandb_dir),
           "WANDB_CACHE_DIR": str(wandb_dir / "cache"),
           "WANDB_CONFIG_DIR": str(wandb_dir / "config"), "WANDB_SILENT": "true"}
    run_dir = tmp_path / "run"
    out = train_run(home, dataset, run_dir, "logger=wandb", "logger.log_interval=1",
                    "train.train_samples=16", "train.eval_interval=null", env_extra=env)
    assert out.returncode == 0, out.stderr
    assert [r["step"] for r in step_records(run_dir)] == [1, 2, 3, 4]
    # wandb writes nothing under HOME; matplotlib (curves.png) keeps its font cache there.
    written = [p for p in home.rglob("*") if p.is_file() and "matplotlib" not in p.parts]
    assert not written, f"the run wrote under HOME: {written}"
