"""The fine-tuning page's DPO commands as a person runs them: preference pairs prepared with
`python -m trainer.prepare --preference`, then `launch.py peft=lora train.objective=dpo` on them.
The first step's loss is ln 2 (the adapters start at zero: policy = reference), metrics.jsonl
logs TRL's rewards, and the chosen responses pull ahead. A bad line is one line naming it.
"""
from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
from test_hf import cli

from config_helpers import ROOT

RUN = ("peft=lora", "train.objective=dpo", "data.pack=true", "data.reset_attention_mask=true",
       "data.reset_position_ids=true", "train.seq_length=63", "train.micro_batch_size=4",
       "train.eval_interval=null", "logger.log_interval=1", "schedule.lr=1e-2")


def write_pairs(path: Path, count: int = 300) -> Path:
    """Sums with the right answer chosen and a wrong one rejected."""
    rng = random.Random(0)
    lines = []
    for _ in range(count):
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        lines.append(json.dumps({"prompt": f"What is {a} + {b}? ", "chosen": f"{a + b}.",
                                 "rejected": f"{a + b + rng.randint(1, 9)}."}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_prepared_pairs_train_with_dpo_from_ln2(tmp_path):
    src = write_pairs(tmp_path / "pairs.jsonl")
    out = cli("-m", "trainer.prepare", str(src), str(tmp_path / "pairs"), "--preference",
              "--seq-length", "63")
    assert "0 example(s) longer than a sample truncated" in out.stdout
    meta = json.loads((tmp_path / "pairs" / "meta.json").read_text())
    assert meta["preference"] and meta["pairs"] == 300 and len(meta["doc_starts"]) == 600
    cli("launch.py", *RUN, f"data.path={tmp_path / 'pairs'}", "train.train_samples=256",
        f"hydra.run.dir={tmp_path / 'run'}")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    assert rows[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert rows[0]["rewards/margins"] == 0.0
    late = rows[-8:]  # the right sums pull ahead of the wrong ones
    print(f"\nDPO: loss {rows[0]['loss']:.4f} -> {late[-1]['loss']:.4f}, reward accuracy "
          f"{sum(r['rewards/accuracies'] for r in late) / len(late):.2f} over the last 8 steps")
    assert sum(r["loss"] for r in late) / len(late) < math.log(2)
    assert sum(r["rewards/margins"] for r in late) > 0


@pytest.mark.parametrize("line,message", [
    ({"prompt": "a", "chosen": "b"}, "no 'rejected'"),
    ({"prompt": "a", "chosen": "b", "rejected": ["c"]}, "three strings, or three lists"),
    ({"prompt": "a", "chosen": "", "rejected": "c"}, "the chosen response has no token"),
])
def test_a_bad_preference_line_is_one_line(line, message, tmp_path):
    src = write_pairs(tmp_path / "pairs.jsonl", 4)
    src.write_text(src.read_text() + json.dumps(line) + "\n")
    out = subprocess.run([sys.executable, "-m", "trainer.prepare", str(src),
                          str(tmp_path / "out"), "--preference"], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and f"{src}:5" in out.stderr
    assert not (tmp_path / "out").exists()


def test_dpo_on_a_dataset_of_documents_or_with_a_pair_past_a_sample_is_one_line(tmp_path):
    (tmp_path / "text.txt").write_text("a document, not a pair of answers. " * 40)
    cli("-m", "trainer.prepare", str(tmp_path / "text.txt"), str(tmp_path / "docs"),
        "--valid-fraction", "0")
    pairs = tmp_path / "pairs"
    cli("-m", "trainer.prepare", str(write_pairs(tmp_path / "pairs.jsonl")), str(pairs),
        "--preference")
    for data, seq, message in ((tmp_path / "docs", 63, "a dataset of documents, not preference "
                                "pairs"), (pairs, 15, "its longest preference pair is")):
        out = subprocess.run([sys.executable, "launch.py", *RUN, f"data.path={data}",
                              f"train.seq_length={seq}", "dry_run=true"],
                             capture_output=True, text=True, cwd=ROOT)
        lines = [line for line in out.stderr.splitlines()
                 if line and not line.startswith(("Error executing job", "Set the environment"))]
        assert out.returncode != 0 and len(lines) == 1 and message in lines[0], out.stderr
