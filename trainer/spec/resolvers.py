"""The OmegaConf resolvers behind the config's derived nodes (`layout`).

The plugin in hydra_plugins/ calls register() whenever Hydra starts. The arithmetic itself is
parallel.layout's; this module only adapts it to OmegaConf and to Hydra's error printing.
"""
from __future__ import annotations

import hashlib
from typing import Any

import omegaconf
from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from parallel.layout import Layout, LayoutError

RESOLVER = "gtp.layout"


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

