"""docs/attention.md's gpt-oss example, run as the page shows it (its fence read from the page):
tiny_gpt_oss (windows, sinks, biases, experts) trains on four processes under CP 4 by p2p with
packed documents, every step logged, its losses falling, the context group's point-to-point
messages really used, a checkpoint saved."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

from config_helpers import ROOT

HEADING = "### gpt-oss's block at a CPU's size"


def page_command() -> list[str]:
    section = (ROOT / "docs" / "attention.md").read_text().split(HEADING, 1)[1]
    fence = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return shlex.split(fence.replace("\\\n", " "))


def test_the_page_trains_tiny_gpt_oss_under_cp4_with_documents_and_sinks(tmp_path):
    argv = page_command()
    assert argv[:3] == ["python", "launch.py", "model=tiny_gpt_oss"], argv
    for key in ("parallel.context_parallel_size=4", "data.reset_attention_mask=true"):
        assert key in argv, key
    done = subprocess.run([sys.executable, *argv[1:], f"hydra.run.dir={tmp_path}",
                           "logger.log_interval=1"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "loss" in m]
    assert [m["step"] for m in steps] == list(range(1, 17))
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5, [m["loss"] for m in steps]
    assert steps[-1]["comm_bytes"]["p2p"] > 0, steps[-1]["comm_bytes"]
    assert sorted((tmp_path / "checkpoints").glob("step_*")), "no checkpoint"
