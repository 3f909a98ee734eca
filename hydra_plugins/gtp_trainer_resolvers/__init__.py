"""Hydra plugin: registers gtp-trainer's resolvers whenever Hydra starts.

Hydra imports every module under the `hydra_plugins` namespace at start (command line, compose
API, submitit and spawned workers), so the resolvers exist wherever a config is composed, not
only in launch.py's process. Hydra may import this module more than once; register() is
idempotent and the error classes live in trainer.compose.resolvers, so they keep one identity.
"""
from trainer.compose.resolvers import register

register()
