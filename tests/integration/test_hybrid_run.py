"""docs/hybrid.md's example, run as the page shows it (its fence read from the page): the tiny
hybrid (three Gated DeltaNet blocks, one gated full-attention block, experts) trains on four
processes under CP 4 by p2p with packed documents, every step logged, its losses falling, the
context group's point-to-point messages (the relay's states, the ring's K/V) really used, a
checkpoint saved."""
from __future__ import annotations

from config_helpers import ROOT, page_command, run_logged

HEADING = "### The tiny hybrid at a CPU's size"


def test_the_page_trains_the_tiny_hybrid_under_cp4_with_documents(tmp_path):
    argv = page_command(ROOT / "docs" / "hybrid.md", HEADING)
    assert argv[:3] == ["python", "launch.py", "model=tiny_qwen3_next"], argv
    for key in ("parallel.context_parallel_size=4", "data.reset_attention_mask=true"):
        assert key in argv, key
    steps = run_logged(argv, tmp_path)
    assert [m["step"] for m in steps] == list(range(1, 17))
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5, [m["loss"] for m in steps]
    assert steps[-1]["comm_bytes"]["p2p"] > 0, steps[-1]["comm_bytes"]
    assert sorted((tmp_path / "checkpoints").glob("step_*")), "no checkpoint"
