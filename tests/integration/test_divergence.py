"""A run whose loss or gradient norm stops being finite ends with one line naming the step, the
step is not applied, and no checkpoint of the non-finite state is written: the last good one
stays the one a resume uses (Megatron's check_for_nan_in_loss_and_grad)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from config_helpers import ROOT

# lr 1e30 from the first step (no warmup, which would start it at lr_warmup_init): the first
# update makes every weight ~1e30, so the second step's attention overflows.
DIVERGING = ("schedule.lr=1e30", "schedule.min_lr=0", "schedule.lr_warmup_fraction=0",
             "train.train_samples=64",
             "train.eval_interval=null", "checkpoint.save_interval=1", "logger.log_interval=1")


@pytest.mark.parametrize("ranks", [(), ("cluster.procs_per_node=2",
                                          "parallel.tensor_parallel_num_weight_shards=2")])
def test_a_non_finite_step_stops_the_run_and_saves_nothing_of_it(ranks, tmp_path):
    """Every rank sees the same global loss and norm, so all refuse the step together."""
    out = subprocess.run([sys.executable, str(ROOT / "launch.py"), *DIVERGING, *ranks,
                          f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    [line] = [x for x in out.stderr.splitlines() if "Training diverged" in x]
    assert "Training diverged at step 2:" in line and "nan" in line and "Fix:" in line
    assert str(tmp_path / "checkpoints" / "step_00000001") in line
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000001"]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]  # the refused step is not logged as trained
