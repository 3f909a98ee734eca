"""Start a run from launch.py: check inputs, write the run directory's artifacts, and start the
ranks the way this process was launched (trainer.launcher)."""
from __future__ import annotations

import tempfile
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from parallel.layout import Layout
from trainer import checkpoint
from trainer.config import Config, ConfigError
from trainer.data import TokenDataset
from trainer.dry_run import layout_record, write_layout_json
from trainer.launcher import RankEnv, check_world, launch_local, launched_rank, run_rank
from trainer.loop import dataset_path


def check_inputs(settings: Config) -> None:
    """The dataset (prepared now if it is the built-in one) and the checkpoint to load must be
    readable before any rank starts; a problem is one line naming the key."""
    try:
        TokenDataset.open(dataset_path(settings))
        if settings.checkpoint.load is not None:
            checkpoint.resolve(Path(settings.checkpoint.load))
    except (ValueError, FileNotFoundError) as error:
        raise ConfigError(str(error)) from None


def write_run_artifacts(cfg: DictConfig, settings: Config, layout: Layout, run_dir: Path) -> None:
    """The resolved config and layout.json, so a run directory explains itself."""
    record, _ = layout_record(settings, layout)
    write_layout_json(record, run_dir)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))


def run(cfg: DictConfig, settings: Config, layout: Layout, run_dir: Path) -> None:
    meta = {"run_dir": str(run_dir)}
    env = launched_rank()
    if env is not None:  # torchrun or submitit started this process as one rank
        check_world(env, settings, layout)
        check_inputs(settings)
        if env.rank == 0:
            write_run_artifacts(cfg, settings, layout, run_dir)
        run_rank(env, settings, layout, run_dir, meta)
        return
    check_inputs(settings)
    write_run_artifacts(cfg, settings, layout, run_dir)
    if layout.world_size > 1:
        launch_local(settings, layout, run_dir, meta)
        return
    with tempfile.TemporaryDirectory(prefix="gtp-rendezvous-") as meeting:
        run_rank(RankEnv(0, 1, 0, f"file://{meeting}/store", "launch.py"), settings, layout,
                 run_dir, meta)
