"""Start training from launch.py: the run directory's artifacts, the process group, the loop.

This version runs one process (the quickstart and single-GPU runs); the launchers for many
processes (local, torchrun, SLURM) build on the same entry.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from parallel.layout import Layout
from trainer import checkpoint
from trainer.config import Config, ConfigError
from trainer.data import TokenDataset
from trainer.dry_run import layout_record, write_layout_json
from trainer.loop import dataset_path, train


def write_run_artifacts(cfg: DictConfig, settings: Config, layout: Layout, run_dir: Path) -> None:
    """The resolved config and layout.json, so a run directory explains itself."""
    record, _ = layout_record(settings, layout)
    write_layout_json(record, run_dir)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))


def check_inputs(settings: Config) -> None:
    """The dataset (prepared now if it is the built-in one) and the checkpoint to load must be
    readable before any process starts; a problem is one line naming the key."""
    try:
        TokenDataset.open(dataset_path(settings))
        if settings.checkpoint.load is not None:
            checkpoint.resolve(Path(settings.checkpoint.load))
    except (ValueError, FileNotFoundError) as error:
        raise ConfigError(str(error)) from None


def run_single_process(cfg: DictConfig, settings: Config, layout: Layout, run_dir: Path) -> None:
    if layout.world_size != 1:
        raise ValueError(
            f"world_size={layout.world_size}: this entry trains in one process; multi-process "
            f"launching (local, torchrun, SLURM) is not built yet. Fix: use "
            f"cluster.num_nodes=1 cluster.procs_per_node=1, or dry_run=true to inspect the layout.")
    check_inputs(settings)
    write_run_artifacts(cfg, settings, layout, run_dir)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    try:
        train(settings, layout, run_dir, device, meta={"run_dir": str(run_dir)})
    finally:
        dist.destroy_process_group()
