"""Training curves as a PNG: train and eval loss, learning rate and gradient norm against
consumed samples, from one or more run folders' metrics.jsonl."""
from __future__ import annotations

from pathlib import Path


def write_curves(run_dir: Path) -> Path | None:
    return None  # (issue 9, item 6)
