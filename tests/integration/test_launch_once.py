"""What a launch does once: layout.json's memory plan is the one settle made, and in a process
that is launcher and rank at once (world size 1 here) resume's find, check and load each run
once. Calls are counted by wrapping the functions, so a second call fails the test."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_launch import TINY_RUN, make_dataset

from trainer.compose.runspec import settle
from trainer.plan import stage_plan
from trainer.plan.options import EngineOptions

from config_helpers import ROOT, compose_config

# launch.py in this process, with resume's steps counted; the counts are its last line.
COUNTED_LAUNCH = """
import atexit, collections, json, runpy, sys
from trainer.checkpoint import dcp, resume
counts = collections.Counter()
def count(module, name):
    call = getattr(module, name)
    def counted(*args, **kwargs):
        counts[name] += 1
        return call(*args, **kwargs)
    setattr(module, name, counted)
for module, name in ((resume, "find"), (resume, "check"), (dcp, "load")):
    count(module, name)
atexit.register(lambda: print("counts " + json.dumps(counts), flush=True))
sys.argv = ["launch.py", *sys.argv[1:]]
runpy.run_path("launch.py", run_name="__main__")
"""


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory)


def test_layout_json_holds_the_memory_plan_settle_made(monkeypatch, tmp_path):
    from trainer.launch.run import write_run_artifacts

    plans = []
    unsharded = stage_plan.unsharded_memory  # called once a memory plan
    monkeypatch.setattr(stage_plan, "unsharded_memory",
                        lambda *a: plans.append(a) or unsharded(*a))
    cfg = compose_config("model=tiny_moe", "parallel.pipeline_model_parallel_size=2",
                         "cluster.procs_per_node=2")
    spec = settle(cfg)
    write_run_artifacts(cfg, spec, tmp_path)
    assert len(plans) == 1  # settle's; writing layout.json planned nothing again
    planned = stage_plan.memory_plan(spec.config.model, spec.layout,
                                     EngineOptions.from_config(spec.config))
    written = json.loads((tmp_path / "layout.json").read_text())["memory"]
    assert written == json.loads(json.dumps(planned)) and len(written["per_stage"]) == 2


def counted_launch(dataset: Path, run_dir: Path, *overrides: str) -> dict[str, int]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("HYDRA_FULL_ERROR", "RANK", "WORLD_SIZE")}
    out = subprocess.run([sys.executable, "-c", COUNTED_LAUNCH, *TINY_RUN, f"data.path={dataset}",
                          f"hydra.run.dir={run_dir}", *overrides], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1].removeprefix("counts "))


def test_a_resume_in_one_process_finds_checks_and_loads_once(dataset, tmp_path):
    run_dir = tmp_path / "run"
    first = counted_launch(dataset, run_dir, "train.train_samples=8", "data.pack=true")
    assert first == {"find": 1}  # nothing to check or load
    again = counted_launch(dataset, run_dir, "train.train_samples=16", "data.pack=true")
    assert again == {"find": 1, "check": 1, "load": 1}
    assert "steps from step 4 (samples 8 to 16)" in (run_dir / "launch.log").read_text()
