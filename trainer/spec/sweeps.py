"""Validate every point of a sweep before any job starts.

Each point is composed on the submitting machine exactly as its job will compose it, and
settled (layout, keys, types, sample accounting, schedule). If any point is invalid the whole
sweep is refused, listing every invalid point by its overrides and the rule's message: nothing
runs half a sweep on a cluster allocation because of a typo in one point.
"""
from __future__ import annotations

from typing import Sequence

from hydra.errors import CompactHydraException, HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from trainer.spec.runspec import settle


class SweepRejected(CompactHydraException):
    """Some points of a sweep are invalid; no job was started."""


def invalid_points(compose, points: Sequence[Sequence[str]]) -> list[tuple[list[str], str]]:
    """(overrides, message) of each point that fails; `compose` maps overrides to a config."""
    found = []
    for overrides in points:
        try:
            cfg: DictConfig = compose(list(overrides))
            settle(cfg)
        except (HydraException, OmegaConfBaseException, ValueError) as error:
            message = str(error).strip().splitlines()[0]
            found.append((list(overrides), message))
    return found


def check_sweep(compose, points: Sequence[Sequence[str]]) -> None:
    invalid = invalid_points(compose, points)
    if invalid:
        lines = [f"  {' '.join(overrides)}\n    {message}" for overrides, message in invalid]
        raise SweepRejected(
            f"Sweep refused before any job started; invalid points: {len(invalid)} of "
            f"{len(points)}.\n" + "\n".join(lines) + "\nFix these points or remove them from the "
            "sweep; no point was run.")
