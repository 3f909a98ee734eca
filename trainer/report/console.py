"""Console output of a run, also written to the run folder's launch.log."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def console_log(run_dir: Path, writer: bool) -> Iterator[None]:
    yield  # (issue 9, item 6: tee this process's and its children's output into launch.log)
