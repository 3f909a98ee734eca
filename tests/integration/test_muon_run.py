"""docs/optimizers.md's Muon example, run as the page shows it: tiny_deepseek trains with
optim=muon under TP 2 with SP, four weight shards and EP 2 on four processes, its loss
falling, and its checkpoint holding Muon's momentum for the matrices and AdamW's moments for
the rest."""
from __future__ import annotations

from trainer.checkpoint.dcp import saved_entries

from config_helpers import ROOT, page_command, run_logged

HEADING = "## Muon on every axis"


def test_the_docs_train_tiny_deepseek_with_muon_under_tp_weight_shards_and_ep(tmp_path):
    argv = page_command(ROOT / "docs" / "optimizers.md", HEADING)
    assert argv[:4] == ["python", "launch.py", "optim=muon", "model=tiny_deepseek"], argv
    for axis in ("tensor_model_parallel_size=2", "tensor_parallel_num_weight_shards=4",
                 "expert_model_parallel_size=2"):
        assert f"parallel.{axis}" in argv, axis
    steps = run_logged(argv, tmp_path)
    assert [m["step"] for m in steps] == list(range(1, 9))
    # 5.57 to 5.31 in 8 steps (AdamW reaches 5.10 on these first steps at this lr)
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.2, [m["loss"] for m in steps]
    (last,) = sorted((tmp_path / "checkpoints").glob("step_*"))[-1:]
    saved = saved_entries(last)
    assert "optim.momentum_buffer.layers.0.attn.q_down.weight" in saved  # whole on every rank
    assert "optim.momentum_buffer.layers.1.mlp.experts.gate_up" in saved
    assert "optim.exp_avg_sq.layers.1.mlp.router.weight" in saved
    assert "optim.exp_avg.layers.1.mlp.experts.gate_up" not in saved
