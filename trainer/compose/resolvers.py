"""The OmegaConf resolvers behind the config's derived nodes (`layout`).

The plugin in hydra_plugins/ calls register() whenever Hydra starts. The arithmetic itself is
parallel.layout's; this module only adapts it to OmegaConf and to Hydra's error printing.
"""
from __future__ import annotations

import hashlib
from dataclasses import replace
from enum import Enum
from typing import Any

import omegaconf
from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from parallel.layout import Layout, LayoutError
from trainer.auto.search import GIVEN, SEARCHED, Choice, Problem, search
from trainer.config import ModelConfig, OptimConfig, Precision
from trainer.plan.hardware import Hardware
from trainer.plan.muon import muon_plan

RESOLVER = "gtp.layout"
AUTO = "gtp.auto"


class LayoutResolutionError(InterpolationResolutionError, CompactHydraException):
    """An invalid layout. OmegaConf re-raises its own error class unwrapped, and Hydra prints a
    CompactHydraException as its message alone: one readable line, no traceback."""


def build_layout(parallel: Any, cluster: Any, train: Any) -> Layout:
    """Layout.from_config, with a rule violation turned into the one-line error."""
    try:
        return Layout.from_config(parallel, cluster, train)
    except LayoutError as error:
        raise LayoutResolutionError(f"Invalid parallel layout: {error}") from None


def layout_node(parallel: Any, cluster: Any, train: Any) -> DictConfig:
    """The config's `layout` node: Layout.derived() as a read-only DictConfig (a plain dict
    would break `--cfg job --resolve`)."""
    layout = build_layout(parallel, cluster, train)
    return OmegaConf.create(layout.derived(), flags={"readonly": True})


class AutoLayoutError(InterpolationResolutionError, CompactHydraException):
    """parallel=auto found no layout (or a key it reads is invalid): one line."""


def auto_problem(root: DictConfig) -> Problem | None:
    """The search's inputs read from the composed config, or None without parallel=auto. A
    searched key whose value is not the auto interpolation was set by the user: it is fixed."""
    fixed, free = [], []
    for path in SEARCHED:
        group, key = path.split(".")
        node = root[group]._get_node(key)
        value = node._value() if node is not None else None
        if isinstance(value, str) and value.startswith("${" + AUTO + ":"):
            free.append(path)
        else:
            fixed.append((path, _plain(root[group][key])))
    if not free:
        return None
    model: ModelConfig = OmegaConf.to_object(root.model)
    train, cluster, parallel = root.train, root.cluster, root.parallel
    given = tuple((path, parallel[path.split(".")[1]]) for path in GIVEN) + (
        ("train.compile", _plain(train.compile)),)  # compiled blocks rule out zb_h1
    world = cluster.num_nodes * cluster.procs_per_node
    optim: OptimConfig = OmegaConf.to_object(root.optim)
    peft = None if root.get("peft") is None else OmegaConf.to_object(root.peft)
    return Problem(model, Hardware.from_cluster(cluster), world, train.micro_batch_size,
                   train.global_batch_size, train.seq_length,
                   Precision(_plain(train.precision)), train.recompute_num_layers, tuple(fixed),
                   given, muon_plan(model, optim), peft,
                   train.objective == "dpo" and peft is None)


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, Enum) else value


# One search per distinct problem in this process: (the problem, its choice) by the problem's
# inputs other than its fixed keys.
_SEARCHES: dict[str, list[tuple[Problem, Choice]]] = {}


def auto_choice(root: DictConfig) -> Choice | None:
    """The search's answer for this config (None without parallel=auto); NoLayoutFits and a bad
    model become the one-line error.

    Resolving in place (`--cfg job --resolve`, OmegaConf.resolve) turns each searched key into
    its chosen value as it goes, so the next key's problem has more keys fixed, to the values
    the search chose: an earlier choice that already meets every fixed key is the best under
    them too, and is reused rather than searched again."""
    try:
        problem = auto_problem(root)
        if problem is None:
            return None
        earlier = _SEARCHES.setdefault(repr(replace(problem, fixed=())), [])
        fixed = set(problem.fixed)
        for known, choice in earlier:
            if set(known.fixed) <= fixed and all(
                    choice.chosen.values[path] == value for path, value in fixed):
                return choice
        choice = search(problem)
        earlier.append((problem, choice))
        return choice
    except ValueError as error:
        raise AutoLayoutError(str(error)) from None


def auto_value(path: str, *, _root_: DictConfig) -> Any:
    """${gtp.auto:parallel.KEY}: the chosen layout's value of one searched key."""
    choice = auto_choice(_root_)
    return choice.chosen.values[path]


def folder_name(overrides: str, limit: int = 120) -> str:
    """A run folder named by its overrides (Hydra's override_dirname) as one path component:
    slashes (data.path=/x/y) would nest folders, and a long name ends in a hash of the whole
    (file names stop at 255 bytes)."""
    if not overrides:
        return "."
    name = overrides.replace("/", "_")
    if len(name) > limit:
        name = f"{name[:limit - 11]}-{hashlib.sha1(overrides.encode()).hexdigest()[:10]}"
    return name


def register() -> None:
    """Idempotent, so re-imports in workers are harmless."""
    # omegaconf 2.4 gives register_resolver the modern semantics and deprecates
    # register_new_resolver; in 2.3 register_resolver is the legacy string-only API.
    major, minor = (int(part) for part in omegaconf.__version__.split(".")[:2])
    modern = (major, minor) >= (2, 4)
    register = OmegaConf.register_resolver if modern else OmegaConf.register_new_resolver
    register(RESOLVER, layout_node, replace=True)
    register("gtp.folder", folder_name, replace=True)
    register(AUTO, auto_value, replace=True)

