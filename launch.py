"""The single entry point: compose the config, settle it into a RunSpec, then dry-run or train.

    python launch.py [overrides] [dry_run=true]         # cluster.procs_per_node=N: N processes
    torchrun --nproc-per-node N launch.py [overrides]     # one rank per process torchrun starts
    python launch.py -m [sweep] hydra/launcher=slurm      # SLURM jobs through submitit
    python launch.py [overrides] --cfg job --resolve      # print the config with `layout`
    python launch.py --help                               # the config groups and their options

Heavy imports (torch) wait until the config is known to be valid, so a bad config fails fast.
"""
from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import trainer.config  # noqa: F401  (registers the schemas with Hydra's ConfigStore)
from trainer.compose.overrides import refuse_bad_command_line
from trainer.compose.runspec import settle
from trainer.launch.folder import run_folder


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    with run_folder(run_dir):  # a command that fails before training leaves no empty folder
        spec = settle(cfg)
        if spec.config.dry_run:
            from trainer.report.dry_run import dry_run

            dry_run(spec, run_dir)
            return
        from trainer.launch.run import run

        run(cfg, spec, run_dir)


if __name__ == "__main__":
    # Before Hydra: a wrong type, key or option would be its 4-11 line message, ours is one.
    refuse_bad_command_line(sys.argv[1:])
    main()
