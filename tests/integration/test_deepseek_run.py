"""The README's DeepSeek-V3-class example, run as the README shows it (its fence read from the
page): tiny_deepseek (multi-latent attention, DeepSeek's router, multi-token prediction) trains
on eight processes under TP with SP, CP, EP and PP at once, every step logged, its losses
falling, and each axis's collectives really used."""
from __future__ import annotations

from config_helpers import ROOT, page_command, run_logged

HEADING = "## A DeepSeek-V3-class model on every axis"


def test_the_readme_trains_tiny_deepseek_under_tp_sp_cp_ep_and_pp(tmp_path):
    argv = page_command(ROOT / "README.md", HEADING)
    assert argv[:3] == ["python", "launch.py", "model=tiny_deepseek"], argv
    for axis in ("tensor_model_parallel_size=2", "sequence_parallel=true",
                 "context_parallel_size=2", "expert_model_parallel_size=2",
                 "pipeline_model_parallel_size=2"):
        assert f"parallel.{axis}" in argv, axis
    steps = run_logged(argv, tmp_path)
    assert [m["step"] for m in steps] == list(range(1, 17))
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5, [m["loss"] for m in steps]
    moved = steps[-1]["comm_bytes"]
    assert moved["all_to_all"] > 0 and moved["p2p"] > 0 and moved["all_gather"] > 0, moved
    # block 0 is dense; the multi-token prediction depth's block reports as block 4
    assert set(steps[-1]["moe_imbalance_per_layer"]) == {"1", "2", "3", "4"}
    assert all(m["mtp_1_loss"] > 0 for m in steps)  # its depth trained and was logged
    assert steps[-1]["mtp_1_loss"] < steps[0]["mtp_1_loss"]
