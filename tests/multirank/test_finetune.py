"""checkpoint.finetune: a run takes only the weights of another run's checkpoint and starts at
step 0 with fresh Adam moments, schedule and sample stream, on another dataset, sequence length
and layout. A relaunch of the fine-tuning run continues from its own checkpoint, not from the
one it fine-tunes.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.data.dataset import prepare
from trainer.train.loop import Trainer

from harness import run_ranks
from test_layout_changes import GBS, assemble, job_train_and_save, settings_for, state_chunks

PRETRAIN_STEPS = 3


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, Path]:
    """Two token datasets of different text: one to pretrain on, one to fine-tune on."""
    gen = torch.Generator().manual_seed(1)
    words = {"pretrain": ["layout", "shard", "rank", "token", "gather", "scatter"],
             "finetune": ["question", "answer", "because", "therefore", "example"]}
    out = {}
    for name, vocabulary in words.items():
        src = tmp_path_factory.mktemp(name)
        for doc in range(8):
            picks = torch.randint(0, len(vocabulary), (500,), generator=gen).tolist()
            (src / f"doc{doc}.txt").write_text(" ".join(vocabulary[i] for i in picks) + "\n")
        out[name] = prepare(src, tmp_path_factory.mktemp("data") / name, valid_fraction=0.1)
    return out


def job_finetune(rank: int, spec, run_dir: Path) -> dict:
    trainer = Trainer(spec, run_dir, torch.device("cpu"))
    start = {"state": state_chunks(trainer.engine), "step": trainer.state.step,
             "optim_step": trainer.engine.optimizer.gather_moments().step}
    return {**start, "records": trainer.run(keep_records=True)}


@pytest.fixture(scope="module")
def pretrained(corpora, tmp_path_factory) -> tuple[Path, dict]:
    """Weights-sharding 2 x DP 2, 32 tokens, saved after 3 steps: (checkpoint, full tensors)."""
    run_dir = tmp_path_factory.mktemp("pretrain")
    spec = settings_for(corpora["pretrain"], run_dir, (
        "cluster.procs_per_node=4", "parallel.tensor_parallel_num_weight_shards=2"),
        f"train.train_samples={PRETRAIN_STEPS * GBS}")
    results = run_ranks(4, job_train_and_save, spec, run_dir)
    return (run_dir / "checkpoints" / f"step_{PRETRAIN_STEPS:08d}",
            assemble([r["state"] for r in results]))


FINETUNE = ("cluster.procs_per_node=2", "parallel.tensor_model_parallel_size=2",
            "parallel.sequence_parallel=true", "train.seq_length=64")


def test_finetune_takes_the_weights_only_and_starts_at_step_zero(corpora, pretrained, tmp_path):
    saved, weights = pretrained
    spec = settings_for(corpora["finetune"], tmp_path / "ft", FINETUNE,
                        f"checkpoint.load={saved}", "checkpoint.finetune=true",
                        f"train.train_samples={2 * GBS}")
    fine = run_ranks(2, job_finetune, spec, tmp_path / "ft")
    fresh_spec = settings_for(corpora["finetune"], tmp_path / "fresh", FINETUNE,
                              f"train.train_samples={2 * GBS}")
    fresh = run_ranks(2, job_finetune, fresh_spec, tmp_path / "fresh")[0]
    loaded = assemble([r["state"] for r in fine])
    for (kind, name), tensor in loaded.items():
        if kind == "param":  # the pretrained weights, bit for bit, under TP 2 + SP now
            assert torch.equal(tensor, weights[kind, name]), name
        else:  # Adam's moments start at zero, not at the pretrained run's
            assert not tensor.any(), (kind, name)
            assert weights[kind, name].any(), (kind, name)
    got = fine[0]
    assert (got["step"], got["optim_step"]) == (0, 0)
    # step 0 with a fresh schedule and stream: the same steps, samples and learning rates as a
    # run from scratch on this data, but different losses (other starting weights)
    records = got["records"]
    assert [r["step"] for r in records] == [1, 2]
    assert [r["consumed_samples"] for r in records] == [GBS, 2 * GBS]
    assert [r["lr"] for r in records] == [r["lr"] for r in fresh["records"]]
    assert records[0]["loss"] != fresh["records"][0]["loss"]


def test_a_relaunched_finetune_continues_its_own_checkpoint(corpora, pretrained, tmp_path):
    saved, _ = pretrained
    first, again = (settings_for(corpora["finetune"], tmp_path / "ft", FINETUNE,
                                 f"checkpoint.load={saved}", "checkpoint.finetune=true",
                                 f"train.train_samples={steps * GBS}") for steps in (2, 3))
    run_ranks(2, job_finetune, first, tmp_path / "ft")  # saves its step 2
    resumed = run_ranks(2, job_finetune, again, tmp_path / "ft")[0]
    assert resumed["step"] == 2 and resumed["optim_step"] == 2
    assert [r["step"] for r in resumed["records"]] == [3]
