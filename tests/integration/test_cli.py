"""launch.py from the command line: --cfg job --resolve, invalid layouts, and the dry run."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from parallel.layout import AXES, DERIVED_KEYS, GROUP_NAMES, Layout

from config_helpers import ROOT


def launch(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, str(ROOT / "launch.py"), *args], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=120)


def test_cfg_job_resolve_prints_the_layout():
    out = launch("cluster.procs_per_node=8", "experiment=seed_review", "--cfg", "job",
                 "--resolve")
    assert out.returncode == 0, out.stderr
    layout = yaml.safe_load(out.stdout)["layout"]
    assert list(layout) == list(DERIVED_KEYS)
    assert layout["runtime_context_parallel_size"] == 2 and layout["batch_parallel_size"] == 4


@pytest.mark.parametrize("mode", [["--cfg", "job", "--resolve"], ["dry_run=true"], []])
def test_invalid_layout_exits_nonzero_with_the_rule_message(mode):
    out = launch("cluster.procs_per_node=8", "parallel.tensor_model_parallel_size=2",
                 "parallel.tensor_parallel_num_weight_shards=8",
                 "parallel.tensor_parallel_num_sequence_shards=2", *mode)
    assert out.returncode != 0
    assert "requires sequence_parallel" in out.stderr
    assert "Fix: set parallel.sequence_parallel=true" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.splitlines()) < 12


def test_unknown_key_added_with_plus_exits_nonzero():
    out = launch("+parallel.context_paralel_size=2", "dry_run=true")
    assert out.returncode != 0 and "parallel.context_paralel_size" in out.stderr


def test_dry_run_writes_layout_json_and_warns_about_nvlink(tmp_path):
    out = launch("experiment=seed_128rank_cp2", "cluster.gpus_per_nvlink_domain=8",
                 "dry_run=true", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    record = json.loads((tmp_path / "layout.json").read_text())
    layout = Layout(128, tensor_parallel_num_weight_shards=64,
                    tensor_parallel_num_sequence_shards=64, context_parallel_size=2,
                    seq_length=131072)
    assert record["derived"] == layout.derived()
    assert set(record["groups"]) == set(GROUP_NAMES)
    assert record["groups"]["context"] == [list(range(128))]
    assert len(record["ranks"]) == 128
    assert {axis: record["ranks"][70][axis] for axis in AXES} == layout.coords(70)._asdict()
    assert "span more than one NVLink domain" in out.stdout + out.stderr
    assert record["warnings"] and "gpus_per_nvlink_domain=8" in record["warnings"][0]
    assert "memory per rank: model=llama, 32 layers x hidden 4096" in out.stdout


def test_dry_run_of_the_default_prints_a_per_rank_table(tmp_path):
    out = launch("cluster.procs_per_node=4", "parallel.tensor_parallel_num_weight_shards=2",
                 "parallel.tensor_parallel_num_sequence_shards=2", "dry_run=true",
                 f"hydra.run.dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    assert "per rank:" in out.stdout and "runtime_cp_rank" in out.stdout
    assert "WARNING" not in out.stdout + out.stderr
    record = json.loads((tmp_path / "layout.json").read_text())
    assert record["groups"]["context"] == [[0, 1], [2, 3]]
    assert [r["runtime_cp_rank"] for r in record["ranks"]] == [0, 1, 0, 1]


def test_runs_print_no_deprecation_warning_from_project_code(tmp_path):
    """A short run (2 ranks, weight shards) and a measured dry run, every DeprecationWarning and
    FutureWarning shown (Python hides some by default): none is attributed to a file of this
    project (a deprecated torch call of ours is, by the warning's stack level). The test suite
    itself turns them into errors (pyproject's filterwarnings)."""
    show = {"PYTHONWARNINGS": "always::DeprecationWarning,always::FutureWarning"}
    runs = [launch("cluster.procs_per_node=2", "parallel.tensor_parallel_num_weight_shards=2",
                   "train.train_samples=32", f"hydra.run.dir={tmp_path / 'run'}", env_extra=show),
            launch("cluster.procs_per_node=2", "parallel.tensor_parallel_num_weight_shards=2",
                   "dry_run=true", "dry_run_rank=0", "train.precision=fp32",
                   f"hydra.run.dir={tmp_path / 'dry'}", env_extra=show)]
    ours = re.compile(rf"^{re.escape(str(ROOT))}/(?!\.venv/)\S+:\d+: "
                      rf"\w*(Deprecation|Future)Warning", re.MULTILINE)
    for out, ended in zip(runs, ("checkpoints/step_00000002", "measured (rank 0 of a simulated")):
        assert out.returncode == 0 and ended in out.stdout, out.stderr
        assert not ours.findall(out.stdout + out.stderr), out.stderr
