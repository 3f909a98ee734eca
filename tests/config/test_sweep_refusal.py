"""A sweep with one bad point starts nothing: the validating sweeper settles every point first
(hydra_plugins/gtp_trainer_sweeper), names each bad point and its rule, and creates no job
folder. So does a sweep whose points share a job folder, one for SLURM without sbatch, and one
whose sweep folder cannot be written. Validation costs no torch import: these sweeps run with
torch made unimportable.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from config_helpers import ROOT


def sweep(no_torch: Path, sweep_dir: Path, *overrides: str,
          env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = os.pathsep.join([str(no_torch), str(ROOT)])
    env.update(env_extra or {})
    return subprocess.run([sys.executable, str(ROOT / "launch.py"), "-m", *overrides,
                           f"hydra.sweep.dir={sweep_dir}"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)


@pytest.mark.parametrize("overrides,bad_point,rule", [
    # the model against the layout: num_heads=2 cannot be split over TP 4, num_heads=4 can
    (["model.num_heads=2,4", "parallel.tensor_model_parallel_size=4", "cluster.procs_per_node=4"],
     "model.num_heads=2 parallel.tensor_model_parallel_size=4",
     "model.num_heads=2 is not divisible by parallel.tensor_model_parallel_size=4"),
    (["model.vocab_size=256,257", "model.make_vocab_size_divisible_by=1",
      "parallel.tensor_model_parallel_size=2",
      "cluster.procs_per_node=2"], "model.vocab_size=257", "model.vocab_size=257"),
    (["schedule.lr=1e-3,nan"], "schedule.lr=nan", "schedule.lr=nan"),
    (["data.path=null,/nonexistent"], "data.path=/nonexistent", "data.path=/nonexistent"),
])
def test_a_sweep_with_a_bad_point_is_refused_before_any_job(no_torch, tmp_path, overrides,
                                                             bad_point, rule):
    sweep_dir = tmp_path / "sweep"
    out = sweep(no_torch, sweep_dir, *overrides)
    assert out.returncode != 0, out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr and "torch imported" not in out.stderr
    assert "Sweep refused before any job started; invalid points: 1 of 2." in out.stderr
    assert bad_point in out.stderr and rule in out.stderr, out.stderr
    assert not sweep_dir.exists(), "a job folder was created"
    assert "Launching" not in out.stdout  # Hydra's launcher never ran a job


def test_every_bad_point_is_listed(no_torch, tmp_path):
    out = sweep(no_torch, tmp_path / "sweep", "optim.clip_grad=0,-1,1.0")
    assert "invalid points: 2 of 3." in out.stderr
    assert "optim.clip_grad=0\n" in out.stderr and "optim.clip_grad=-1\n" in out.stderr
    assert not (tmp_path / "sweep").exists()


def test_a_bad_value_on_the_command_line_is_one_line_before_the_sweep(no_torch, tmp_path):
    """launch.py checks each choice of the command line before Hydra (trainer/compose/overrides)."""
    out = sweep(no_torch, tmp_path / "sweep", "train.seq_length=128,abc")
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 1 and len(lines) == 1, out.stderr
    assert lines[0].startswith("train.seq_length=abc (a point of the sweep "
                               "train.seq_length=128,abc): ") and "Fix:" in lines[0]
    assert not (tmp_path / "sweep").exists()


@pytest.mark.parametrize("overrides,shared", [
    (["train.seed=1,1"], [("train.seed=1", ["train.seed=1", "train.seed=1"])]),
    # logger.* stays out of the folder's name (override_dirname.exclude_keys)
    (["logger.log_interval=1,2", "train.seed=3,4"],
     [(f"train.seed={seed}", [f"logger.log_interval={n} train.seed={seed}" for n in (1, 2)])
      for seed in (3, 4)]),
])
def test_points_sharing_a_job_folder_are_refused(no_torch, tmp_path, overrides, shared):
    sweep_dir = tmp_path / "sweep"
    out = sweep(no_torch, sweep_dir, *overrides)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    count = sum(len(points) for _, points in shared)
    assert f"Sweep refused before any job started; {count} of {count} points share a run " \
           f"folder" in out.stderr and "Fix: remove the repeated points" in out.stderr
    for folder, points in shared:
        block = "\n".join([f"  {sweep_dir / folder}"] + [f"    {p}" for p in points])
        assert block in out.stderr, out.stderr
    assert not sweep_dir.exists() and "Launching" not in out.stdout


def test_points_in_their_own_folders_run(tmp_path):
    """The folder check refuses only a real collision: distinct points run (dry runs, torch)."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    out = subprocess.run([sys.executable, str(ROOT / "launch.py"), "-m", "train.seed=1,2",
                          "logger.log_interval=5", "dry_run=true",
                          f"hydra.sweep.dir={tmp_path}"], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "train.seed=1" / "layout.json").exists()
    assert (tmp_path / "train.seed=2" / "layout.json").exists()


def path_without_sbatch(tmp_path: Path) -> str:
    """This interpreter's folder and an empty one: never SLURM's bin (CI may put a real
    cluster's on PATH through GTP_SLURM_DIR)."""
    empty = tmp_path / "bin"
    empty.mkdir()
    folders = [str(Path(sys.executable).parent), str(empty)]
    assert not any((Path(folder) / "sbatch").exists() for folder in folders)
    return os.pathsep.join(folders)


@pytest.mark.parametrize("launcher", ["slurm", "slurm_cpu"])
def test_a_slurm_sweep_without_sbatch_is_one_line(no_torch, tmp_path, launcher):
    sweep_dir = tmp_path / "sweep"
    out = sweep(no_torch, sweep_dir, f"hydra/launcher={launcher}", "train.seed=1,2",
                env_extra={"PATH": path_without_sbatch(tmp_path)})
    lines = [line for line in out.stderr.splitlines()
             if line.strip() and not line.startswith("Set the environment variable")]
    assert out.returncode == 1 and len(lines) == 1, out.stderr
    assert f"hydra/launcher={launcher} submits the sweep's jobs with sbatch" in lines[0]
    assert "Fix:" in lines[0] and "hydra/launcher=local_submitit" in lines[0]
    assert not sweep_dir.exists()


def test_local_submitit_needs_no_sbatch(tmp_path, monkeypatch):
    from trainer.compose.sweeps import check_launcher

    from config_helpers import compose_config

    monkeypatch.setenv("PATH", path_without_sbatch(tmp_path))
    check_launcher(compose_config("hydra/launcher=local_submitit", hydra_node=True))


def test_a_sweep_folder_that_cannot_be_written_is_refused(no_torch):
    out = sweep(no_torch, Path("/proc/forbidden/sweep"), "train.seed=1,2")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "hydra.sweep.dir=/proc/forbidden/sweep" in out.stderr and "Fix:" in out.stderr


def test_settling_a_valid_config_imports_no_torch():
    code = (
        "import sys\n"
        "from hydra import compose, initialize_config_dir\n"
        "import trainer.config\n"
        "from trainer.compose.runspec import settle\n"
        f"with initialize_config_dir(config_dir={str(ROOT / 'conf')!r}, version_base='1.3'):\n"
        "    cfg = compose(config_name='config', overrides=['cluster.procs_per_node=4',\n"
        "        'parallel.tensor_model_parallel_size=2', 'parallel.sequence_parallel=true'])\n"
        "spec = settle(cfg)\n"
        "assert spec.layout.tp_size == 2 and spec.plan.train_steps > 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
