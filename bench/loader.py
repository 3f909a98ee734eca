"""loader_headroom: samples per second the data path delivers to a rank (sample stream, batch
lane and context chunks, as the trainer fetches them) over the samples per second the trainer
consumes in a launch.py run of the same configuration."""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from parallel.layout import Layout  # noqa: E402
from trainer.data.batch import rank_micro_batches  # noqa: E402
from trainer.data.dataset import TokenDataset, builtin_corpus  # noqa: E402
from trainer.data.stream import SampleStream  # noqa: E402


def loader_samples_per_s(micro: int, seq: int, steps: int) -> float:
    layout = Layout(1, micro_batch_size=micro, seq_length=seq)
    stream = SampleStream(TokenDataset.open(builtin_corpus(None, 0.01)), "train", seq, 1234, True)
    started = time.perf_counter()
    for step in range(steps):
        consumed = step * layout.global_batch_size
        rank_micro_batches(lambda idx, at=consumed: stream.get([at + i for i in idx]), layout, 0)
    return steps * layout.global_batch_size / (time.perf_counter() - started)


def measure(trainer_step_s: float, micro: int, seq: int, quick: bool = True) -> dict:
    steps = 2000 if quick else 20000
    rates = [loader_samples_per_s(micro, seq, steps) for _ in range(3)]
    consumed = micro / trainer_step_s
    return {
        "loader_headroom": round(statistics.median(rates) / consumed, 1),
        "loader_samples_per_s": round(statistics.median(rates)),
        "trainer_samples_per_s": round(consumed, 1),
        "loader_spread": [round(min(rates)), round(max(rates))],
    }
