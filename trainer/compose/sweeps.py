"""Validate every point of a sweep before any job starts.

Each point is composed on the submitting machine exactly as its job will compose it, and
settled (layout, keys, types, sample accounting, schedule). If any point is invalid the whole
sweep is refused, listing every invalid point by its overrides and the rule's message: nothing
runs half a sweep on a cluster allocation because of a typo in one point. So is a sweep whose
points share a run folder (the later job would resume the earlier one's checkpoint and train
nothing), one whose folder cannot be written, and one for SLURM on a machine without sbatch.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional, Sequence

from hydra.errors import CompactHydraException, HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.checks import check_writable
from trainer.compose.overrides import overrides_refusal
from trainer.compose.runspec import settle


class SweepRejected(CompactHydraException):
    """Some points of a sweep are invalid; no job was started."""


def check_launcher(config: DictConfig) -> None:
    """submitit's SLURM launcher submits with sbatch; without it, the sweep would end in
    submitit's traceback once the first job is submitted."""
    target = str(OmegaConf.select(config, "hydra.launcher._target_", default=""))
    if target.endswith("SlurmLauncher") and shutil.which("sbatch") is None:
        launcher = config.hydra.runtime.choices.get("hydra/launcher")
        raise SweepRejected(
            f"hydra/launcher={launcher} submits the sweep's jobs with sbatch, which is not on "
            f"PATH on this machine. Fix: run the sweep where SLURM is installed (a login node) "
            f"or put SLURM's bin folder on PATH, or use hydra/launcher=local_submitit to run "
            f"its jobs here.")


def invalid_points(compose, points: Sequence[Sequence[str]]) -> list[tuple[list[str], str]]:
    """(overrides, message) of each point that fails; `compose` maps overrides to a config."""
    return [(overrides, message) for overrides, _, message in _compose_all(compose, points)
            if message is not None]


def _compose_all(compose, points: Sequence[Sequence[str]]
                 ) -> list[tuple[list[str], Optional[DictConfig], Optional[str]]]:
    """Each point's overrides, its settled config and None, or None and why it fails."""
    found = []
    for point in points:
        overrides = list(point)
        try:
            cfg: DictConfig = compose(overrides)
            settle(cfg)
            found.append((overrides, cfg, None))
        except (HydraException, OmegaConfBaseException, ValueError) as error:
            # Hydra's composition errors are several lines, the first not saying what is
            # wrong: the override check's one line where it has one (points from
            # hydra.sweeper.params were never on the command line).
            message = (overrides_refusal(overrides, groups=False)
                       or str(error).strip().splitlines()[0])
            found.append((overrides, None, message))
    return found


def job_folder(cfg: DictConfig) -> Optional[str]:
    """The folder the point's job will run in (hydra.sweep.dir/hydra.sweep.subdir), or None
    where it is known only once the launcher numbers the jobs (${hydra.job.num})."""
    sweep_dir, subdir = _select(cfg, "hydra.sweep.dir"), _select(cfg, "hydra.sweep.subdir")
    if sweep_dir is None or subdir is None:
        return None
    return os.path.normpath(os.path.join(sweep_dir, subdir))


def _select(cfg: DictConfig, key: str) -> Optional[str]:
    try:
        return str(OmegaConf.select(cfg, key))
    except OmegaConfBaseException:
        return None


def check_sweep(compose, points: Sequence[Sequence[str]]) -> None:
    composed = _compose_all(compose, points)
    invalid = [(overrides, message) for overrides, _, message in composed if message is not None]
    if invalid:
        lines = [f"  {' '.join(overrides)}\n    {message}" for overrides, message in invalid]
        raise SweepRejected(
            f"Sweep refused before any job started; invalid points: {len(invalid)} of "
            f"{len(points)}.\n" + "\n".join(lines) + "\nFix these points or remove them from the "
            "sweep; no point was run.")
    folders: dict[str, list[list[str]]] = {}
    for overrides, cfg, _ in composed:
        folder = job_folder(cfg)
        if folder is not None:
            folders.setdefault(folder, []).append(overrides)
    check_folders(folders, len(points))
    for sweep_dir in {_select(cfg, "hydra.sweep.dir") for _, cfg, _ in composed} - {None}:
        try:
            check_writable("hydra.sweep.dir", sweep_dir, Path(sweep_dir),
                           "the sweep's job folders are made")
        except ValueError as error:
            raise SweepRejected(f"Sweep refused before any job started: {error}") from None


def check_folders(folders: dict[str, list[list[str]]], count: int) -> None:
    """Points sharing a job folder: a repeated point, or points that differ only in keys left
    out of the folder's name (hydra.job.config.override_dirname.exclude_keys)."""
    shared = {folder: group for folder, group in folders.items() if len(group) > 1}
    if not shared:
        return
    lines = [f"  {folder}\n" + "\n".join(f"    {' '.join(point) or '(no overrides)'}"
                                          for point in group) for folder, group in shared.items()]
    points = sum(len(group) for group in shared.values())
    raise SweepRejected(
        f"Sweep refused before any job started; {points} of {count} points share a run folder "
        f"(a later job would resume the earlier one's checkpoint and train nothing):\n"
        + "\n".join(lines) + "\nFix: remove the repeated points, or sweep a key that names "
        "the folder (the keys in hydra.job.config.override_dirname.exclude_keys, such as "
        "logger.log_interval and dry_run, do not); no point was run.")
