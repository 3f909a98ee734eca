"""What a launch does once: layout.json's memory plan is the one settle made. Calls are counted
by wrapping the functions, so a second call fails the test."""
from __future__ import annotations

import json

from trainer.compose.runspec import settle
from trainer.plan import memory
from trainer.plan.options import EngineOptions

from config_helpers import compose_config


def test_layout_json_holds_the_memory_plan_settle_made(monkeypatch, tmp_path):
    from trainer.launch.run import write_run_artifacts

    plans = []
    unsharded = memory.unsharded_memory  # called once a memory plan
    monkeypatch.setattr(memory, "unsharded_memory", lambda *a: plans.append(a) or unsharded(*a))
    cfg = compose_config("model=tiny_moe", "parallel.pipeline_model_parallel_size=2",
                         "cluster.procs_per_node=2")
    spec = settle(cfg)
    write_run_artifacts(cfg, spec, tmp_path)
    assert len(plans) == 1  # settle's; writing layout.json planned nothing again
    planned = memory.memory_plan(spec.config.model, spec.layout,
                                 EngineOptions.from_config(spec.config))
    written = json.loads((tmp_path / "layout.json").read_text())["memory"]
    assert written == json.loads(json.dumps(planned)) and len(written["per_stage"]) == 2
