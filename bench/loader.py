"""loader_headroom: samples per second the data path delivers to a rank (sample stream, batch
lane and context chunks, as the trainer fetches them) over the samples per second the trainer
consumes in a launch.py run of the same configuration. blend_loader_headroom: the same through
data.blend of three Megatron indexed datasets (weights 0.5/0.3/0.2; uint16, int32 and uint16
tokens), written from the built-in corpus's documents by the tests' independent writer."""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "unit")]  # the test writer

from parallel.layout import Layout  # noqa: E402
from trainer.data.dataset import TokenDataset, builtin_corpus  # noqa: E402
from trainer.data.megatron import open_indexed  # noqa: E402
from trainer.data.stream import BlendedStream, SampleStream  # noqa: E402
from trainer.train.batch import rank_micro_batches  # noqa: E402

from test_megatron_data import write_indexed  # noqa: E402

BLEND = ((0.5, np.uint16), (0.3, np.int32), (0.2, np.uint16))


def builtin_stream(seq: int):
    return SampleStream(TokenDataset.open(builtin_corpus(None, 0.01)), "train", seq, 1234, True)


def blended_stream(seq: int, folder: Path):
    """Three Megatron datasets, each a third of the built-in corpus's documents, blended."""
    corpus = TokenDataset.open(builtin_corpus(None, 0.01))
    tokens, starts = np.asarray(corpus.tokens), list(corpus.meta["doc_starts"])
    documents = [tokens[a:b].tolist() for a, b in zip(starts, starts[1:] + [len(tokens)])]
    streams = []
    for part, (_, dtype) in enumerate(BLEND):
        prefix = folder / f"part{part}"
        write_indexed(prefix, [[doc] for doc in documents[part::len(BLEND)]], dtype)
        streams.append(SampleStream(open_indexed(prefix, 0.01), "train", seq, 1234, True))
    return BlendedStream(streams, [weight for weight, _ in BLEND])


def loader_samples_per_s(micro: int, seq: int, steps: int, stream=None) -> float:
    layout = Layout(1, micro_batch_size=micro, seq_length=seq)
    stream = stream or builtin_stream(seq)
    started = time.perf_counter()
    for step in range(steps):
        consumed = step * layout.global_batch_size
        rank_micro_batches(lambda idx, at=consumed: stream.get([at + i for i in idx]), layout, 0)
    return steps * layout.global_batch_size / (time.perf_counter() - started)


def measure(trainer_step_s: float, micro: int, seq: int, quick: bool = True) -> dict:
    steps = 2000 if quick else 20000
    rates = [loader_samples_per_s(micro, seq, steps) for _ in range(3)]
    with tempfile.TemporaryDirectory() as folder:
        blend = blended_stream(seq, Path(folder))
        blended = [loader_samples_per_s(micro, seq, steps, blend) for _ in range(3)]
    consumed = micro / trainer_step_s
    return {
        "loader_headroom": round(statistics.median(rates) / consumed, 1),
        "loader_samples_per_s": round(statistics.median(rates)),
        "trainer_samples_per_s": round(consumed, 1),
        "loader_spread": [round(min(rates)), round(max(rates))],
        "blend_loader_headroom": round(statistics.median(blended) / consumed, 1),
        "blend_samples_per_s": round(statistics.median(blended)),
        "blend_setup": "3 Megatron .bin/.idx datasets, weights 0.5/0.3/0.2, data.blend's stream",
    }
