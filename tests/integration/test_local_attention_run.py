"""docs/attention.md's gpt-oss example, run as the page shows it (its fence read from the page):
tiny_gpt_oss (windows, sinks, biases, experts) trains on four processes under CP 4 by p2p with
packed documents, every step logged, its losses falling, the context group's point-to-point
messages really used, a checkpoint saved."""
from __future__ import annotations

from config_helpers import ROOT, page_command, run_logged

HEADING = "### gpt-oss's block at a CPU's size"


def test_the_page_trains_tiny_gpt_oss_under_cp4_with_documents_and_sinks(tmp_path):
    argv = page_command(ROOT / "docs" / "attention.md", HEADING)
    assert argv[:3] == ["python", "launch.py", "model=tiny_gpt_oss"], argv
    for key in ("parallel.context_parallel_size=4", "data.reset_attention_mask=true"):
        assert key in argv, key
    steps = run_logged(argv, tmp_path)
    assert [m["step"] for m in steps] == list(range(1, 17))
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5, [m["loss"] for m in steps]
    assert steps[-1]["comm_bytes"]["p2p"] > 0, steps[-1]["comm_bytes"]
    assert sorted((tmp_path / "checkpoints").glob("step_*")), "no checkpoint"
