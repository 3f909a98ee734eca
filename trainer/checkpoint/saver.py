"""A run's checkpoint saves, made at once or in the background (checkpoint.async_save, the idea
of torchtitan's async_mode and DCP's async_save).

In the background, each rank first stages what it writes: the optimizer's moments are gathered
(a collective of the engine's groups, as a save always does) and every rectangle the rank writes
is copied to host memory, so the next steps may change the rank's own tensors. A writer thread
then runs the same save as a blocking one (trainer.checkpoint.dcp.write: a .tmp folder, the
checksums, meta.json, the rename that makes it the latest) over a gloo group of its own, made
once for this, so its collectives never meet the training's. At most one save is in flight: the
next one waits for it first. The run waits for it before it ends, also when a signal stops it.
A rank killed during a background write leaves only the .tmp folder, which a resume ignores.
"""
from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from trainer.checkpoint.dcp import Engine, TrainState, folder_of, stage, write
from trainer.units import size


class Saver:
    """Collective to build (the writer's group). save() returns the line to print; poll() and
    wait() the line of a background save that has finished (None: none did)."""

    def __init__(self, engine: Engine, directory: Path, meta: dict[str, Any], background: bool,
                 timeout_s: float):
        self.engine, self.directory, self.meta = engine, directory, meta
        self.background = background
        self.group = None
        self.writer: ThreadPoolExecutor | None = None
        if background:
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
            self.writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
        self.pending: tuple[Future, float] | None = None
        self.staged_bytes = 0  # the last background save's host copy

    def save(self, state: TrainState) -> list[str]:
        """Collective: the checkpoint of `state`, written now or handed to the writer."""
        if not self.background:
            return [f"saved {write(stage(self.engine, state), state, self.directory, self.meta)}"]
        lines = self.wait()  # at most one in flight
        staged = stage(self.engine, state).copy()
        self.staged_bytes = staged.nbytes
        state = dataclasses.replace(state, data=dict(state.data))  # the loop moves its own on
        future = self.writer.submit(write, staged, state, self.directory, self.meta, self.group)
        self.pending = future, time.perf_counter()
        return lines + [f"saving {folder_of(self.directory, state.step)} in the background "
                        f"({size(self.staged_bytes)} staged in host memory)"]

    def poll(self) -> list[str]:
        """The finished background save's line, without waiting (raises its failure)."""
        return self.wait() if self.pending is not None and self.pending[0].done() else []

    def wait(self) -> list[str]:
        """Until the background save in flight has finished (raises its failure)."""
        if self.pending is None:
            return []
        future, began = self.pending
        self.pending = None
        path = future.result()  # CheckpointSaveFailed: the one line of trainer.checkpoint.dcp
        return [f"saved {path} (written in the background in {time.perf_counter() - began:.1f} s)"]

    def close(self) -> None:
        """After wait(): the writer thread ends."""
        if self.writer is not None:
            self.writer.shutdown(wait=True)
