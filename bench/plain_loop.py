"""The minimal hand-written PyTorch loop that launch.py's step time is compared with: the same
model, data stream, batch, loss and AdamW, one process, nothing else. Prints one JSON line of
per-step seconds. Usage: python bench/plain_loop.py STEPS MICRO_BATCH SEQ"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.config import ModelConfig  # noqa: E402
from trainer.data.dataset import TokenDataset, builtin_corpus  # noqa: E402
from trainer.data.stream import SampleStream  # noqa: E402
from trainer.model.transformer import Transformer  # noqa: E402

TINY = ModelConfig(name="llama", vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
                   ffn_hidden_size=176, rope_theta=10000.0, norm_eps=1e-5, init_std=0.02)


def main(steps: int, micro: int, seq: int) -> None:
    stream = SampleStream(TokenDataset.open(builtin_corpus(None, 0.01)), "train", seq, 1234, True)
    model = Transformer(TINY)
    model.init_weights(1234)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.95))
    times = []
    for step in range(steps):
        started = time.perf_counter()
        batch = torch.from_numpy(stream.get(range(step * micro, (step + 1) * micro)))
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss.item()
        times.append(time.perf_counter() - started)
    print(json.dumps({"step_s": times}))


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
