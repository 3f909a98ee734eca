"""A crash while saving never damages the last good checkpoint, and loading finds it."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from trainer.checkpoint import dcp as checkpoint
from trainer.checkpoint.integrity import resolve
from trainer.train.loop import Trainer

from harness import RankFailure, run_ranks
from test_layout_changes import GBS, dataset, settings_for  # noqa: F401  (dataset: a fixture)

OVERRIDES = ("cluster.procs_per_node=2", "parallel.tensor_parallel_num_weight_shards=2")


def job_crash_in_second_save(rank, spec, run_dir):
    trainer = Trainer(spec, run_dir, torch.device("cpu"))
    real_save = checkpoint.dcp.save

    def dying_save(state_dict, storage_writer, planner, process_group=None):
        folder = Path(storage_writer.path)
        if folder.name.startswith("step_00000004"):
            (folder / f"__{rank}_0.distcp").write_bytes(b"half a file")
            # DCP's failure is collective: every rank's write ends before any rank raises (a
            # rank still writing while rank 0 removes the folder would leave it half removed)
            torch.distributed.barrier(group=process_group)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder))
        return real_save(state_dict, storage_writer=storage_writer, planner=planner,
                         process_group=process_group)

    checkpoint.dcp.save = dying_save
    trainer.run()


def job_load(rank, spec, path):
    trainer = Trainer(spec, path.parent.parent, torch.device("cpu"))
    return trainer.state


def test_a_crash_during_save_keeps_the_last_good_checkpoint(dataset, tmp_path):  # noqa: F811  (the imported fixture)
    spec = settings_for(dataset, tmp_path, OVERRIDES, f"train.train_samples={4 * GBS}",
                        "checkpoint.save_interval=2")
    ckpt_dir = tmp_path / "checkpoints"
    with pytest.raises(RankFailure, match=(
            f"CheckpointSaveFailed: saving checkpoint {ckpt_dir / 'step_00000004'} failed: No "
            f"space left on device: {ckpt_dir / 'step_00000004.tmp'}. Nothing of it was kept; "
            f"the latest checkpoint is {ckpt_dir / 'step_00000002'}. Fix: free space")):
        run_ranks(2, job_crash_in_second_save, spec, tmp_path)
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step_00000002"]  # no .tmp left
    assert resolve(ckpt_dir).name == "step_00000002"
    resumed = settings_for(dataset, tmp_path, OVERRIDES, f"train.train_samples={4 * GBS}",
                           f"checkpoint.load={ckpt_dir}")
    state = run_ranks(2, job_load, resumed, ckpt_dir / "step_00000002")[0]
    assert (state.step, state.consumed_samples) == (2, 2 * GBS)


def test_loading_from_a_folder_without_checkpoints_names_the_key(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint.load=.*no checkpoint there"):
        resolve(tmp_path)


def job_rng_round_trip(rank, spec, run_dir):
    trainer = Trainer(spec, run_dir, torch.device("cpu"))
    torch.manual_seed(99)
    saved = torch.get_rng_state()
    path = checkpoint.save(trainer.engine, trainer.state, run_dir / "rng", {})
    torch.manual_seed(7)
    checkpoint.load(trainer.engine, path)
    return torch.equal(torch.get_rng_state(), saved)


def test_the_random_generator_state_comes_back(dataset, tmp_path):  # noqa: F811  (the imported fixture)
    spec = settings_for(dataset, tmp_path, OVERRIDES, f"train.train_samples={GBS}")
    assert run_ranks(2, job_rng_round_trip, spec, tmp_path) == [True, True]
