"""A sweep with one bad point starts nothing: the validating sweeper settles every point first
(hydra_plugins/gtp_trainer_sweeper), names each bad point and its rule, and creates no job
folder. Validation costs no torch import: these sweeps run with torch made unimportable.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from config_helpers import ROOT


@pytest.fixture(scope="module")
def no_torch(tmp_path_factory) -> Path:
    """A folder to put first on PYTHONPATH: `import torch` there fails loudly."""
    folder = tmp_path_factory.mktemp("no_torch")
    (folder / "torch").mkdir()
    (folder / "torch" / "__init__.py").write_text("raise ImportError('torch imported')\n")
    return folder


def sweep(no_torch: Path, sweep_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHONPATH"] = os.pathsep.join([str(no_torch), str(ROOT)])
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
    (["train.seq_length=128,abc"], "train.seq_length=abc", "train.seq_length"),
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


def test_settling_a_valid_config_imports_no_torch():
    code = (
        "import sys\n"
        "from hydra import compose, initialize_config_dir\n"
        "import trainer.config\n"
        "from trainer.spec.runspec import settle\n"
        f"with initialize_config_dir(config_dir={str(ROOT / 'conf')!r}, version_base='1.3'):\n"
        "    cfg = compose(config_name='config', overrides=['cluster.procs_per_node=4',\n"
        "        'parallel.tensor_model_parallel_size=2', 'parallel.sequence_parallel=true'])\n"
        "spec = settle(cfg)\n"
        "assert spec.layout.tp_size == 2 and spec.plan.train_steps > 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
