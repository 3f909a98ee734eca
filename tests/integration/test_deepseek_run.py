"""The README's DeepSeek-V3-class example, run as the README shows it (its fence read from the
page): tiny_deepseek (multi-latent attention, DeepSeek's router, multi-token prediction) trains
on eight processes under TP with SP, CP, EP and PP at once, every step logged, its losses
falling, and each axis's collectives really used."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

from config_helpers import ROOT

HEADING = "## A DeepSeek-V3-class model on every axis"


def readme_command() -> list[str]:
    section = (ROOT / "README.md").read_text().split(HEADING, 1)[1]
    fence = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return shlex.split(fence.replace("\\\n", " "))


def test_the_readme_trains_tiny_deepseek_under_tp_sp_cp_ep_and_pp(tmp_path):
    argv = readme_command()
    assert argv[:3] == ["python", "launch.py", "model=tiny_deepseek"], argv
    for axis in ("tensor_model_parallel_size=2", "sequence_parallel=true",
                 "context_parallel_size=2", "expert_model_parallel_size=2",
                 "pipeline_model_parallel_size=2"):
        assert f"parallel.{axis}" in argv, axis
    done = subprocess.run([sys.executable, *argv[1:], f"hydra.run.dir={tmp_path}",
                           "logger.log_interval=1"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "loss" in m]
    assert [m["step"] for m in steps] == list(range(1, 17))
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5, [m["loss"] for m in steps]
    moved = steps[-1]["comm_bytes"]
    assert moved["all_to_all"] > 0 and moved["p2p"] > 0 and moved["all_gather"] > 0, moved
    # block 0 is dense; the multi-token prediction depth's block reports as block 4
    assert set(steps[-1]["moe_imbalance_per_layer"]) == {"1", "2", "3", "4"}
    assert all(m["mtp_1_loss"] > 0 for m in steps)  # its depth trained and was logged
    assert steps[-1]["mtp_1_loss"] < steps[0]["mtp_1_loss"]
