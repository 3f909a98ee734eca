"""Checkpoints with torch.distributed.checkpoint (DCP), loadable under any layout.

Every value is saved at its place in the single-device tensor (global offsets), so a checkpoint
does not know the layout that wrote it: DCP reads, for each rank, just the overlap with what the
rank now holds. Parameters and Adam moments come back bit-exactly. A checkpoint is written into
`step_XXXXXXXX.tmp` and renamed when every rank has finished and meta.json records every
file's checksum, so a crash mid-save leaves the last good checkpoint untouched; one damaged
later (a truncated copy, changed bytes) fails trainer.checkpoint.integrity's checks and a resume
skips it.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hydra.errors import CompactHydraException
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from parallel.groups import Groups
from parallel.parallelize import ParallelModel
from trainer.checkpoint.integrity import (
    CHECKSUMS,
    META,
    METADATA,
    PREFIX,
    TMP_SUFFIX,
    file_checksum,
    latest,
    verify,
)
from trainer.checkpoint.match import EMBEDDING_WEIGHT, HEAD_WEIGHT
from trainer.parts.lora import is_adapter


class Engine(Protocol):
    """What a checkpoint saves and fills of a rank's engine (trainer.train.engine.Engine): the
    parallel model's parameters at their global places, and the optimizer's Adam moments."""

    groups: Groups  # its world group agrees on a checkpoint's checksums
    model: ParallelModel
    optimizer: Any  # gather_moments, moment_views, empty_moments, load_moments


@dataclass
class TrainState:
    """Where the run stands; the data position is consumed_samples (the stream is stateless)."""

    step: int = 0
    consumed_samples: int = 0
    data: dict[str, Any] = dataclasses.field(default_factory=dict)  # the sample stream's identity


@dataclass
class Chunked:
    """A global tensor of which this rank holds some rectangles: (offsets, view) pairs."""

    shape: tuple[int, ...]
    chunks: list[tuple[tuple[int, ...], torch.Tensor]]


class ChunkSavePlanner(DefaultSavePlanner):
    """Writes each rank's rectangles at their global offsets. Replicas write the same
    rectangles; DCP's dedup keeps one copy of each."""

    def __init__(self, tensors: dict[str, Chunked]):
        super().__init__()
        self.tensors = tensors

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = [
            WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(
                          chunk=ChunkStorageMetadata(torch.Size(offsets), view.shape),
                          properties=TensorProperties.create_from_tensor(view),
                          size=torch.Size(chunked.shape)))
            for fqn, chunked in self.tensors.items() for offsets, view in chunked.chunks]
        self.plan = dataclasses.replace(plan, items=plan.items + items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        chunked = self.tensors.get(write_item.index.fqn)
        if chunked is None:
            return super().resolve_data(write_item)
        offsets = tuple(write_item.index.offset)
        return next(view for o, view in chunked.chunks if o == offsets).contiguous()


class _ChunkLoadPlanner(DefaultLoadPlanner):
    """Reads into each rank's rectangles whatever overlaps them in the checkpoint."""

    def __init__(self, tensors: dict[str, Chunked]):
        super().__init__()
        self.tensors = tensors

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = []
        for fqn, chunked in self.tensors.items():
            saved = self.metadata.state_dict_metadata.get(fqn)
            if not isinstance(saved, TensorStorageMetadata):
                raise ValueError(f"checkpoint has no tensor {fqn!r}: it was written by another "
                                 f"model. Fix: load a checkpoint of this model config.")
            if tuple(saved.size) != tuple(chunked.shape):
                raise ValueError(f"checkpoint tensor {fqn!r} has shape {tuple(saved.size)}, this "
                                 f"model's is {chunked.shape}. Fix: use the model config the "
                                 f"checkpoint was saved with.")
            local = [ChunkStorageMetadata(torch.Size(o), v.shape) for o, v in chunked.chunks]
            items += create_read_items_for_chunk_list(fqn, saved, local)
        return dataclasses.replace(plan, items=plan.items + items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        chunked = self.tensors.get(index.fqn)
        if chunked is None:
            return super().lookup_tensor(index)
        return chunked.chunks[index.index][1]


def _tensors(engine: Engine, moments_views: dict) -> dict[str, Chunked]:
    model, out = engine.model, _buffers(engine)
    for name, param in model.module.named_parameters():
        if not param.requires_grad:  # frozen (peft=lora's base): its base checkpoint holds it
            continue
        shape = model.global_shape(name)
        out[f"model.{name}"] = Chunked(shape, model.global_chunks(name, param.data))
        if name in model.stage_copies:  # the same values as its owner's; no moments here
            continue
        # AdamW's moments or Muon's momentum (none for a frozen parameter: LoRA's base)
        for kind, view in moments_views.get(name, {}).items():
            out[f"optim.{kind}.{name}"] = Chunked(shape, model.global_chunks(name, view))
    return out


def _buffers(engine: Engine, saved: set[str] | None = None) -> dict[str, Chunked]:
    """The model's buffers (a router's expert bias), whole on every rank; `saved`: only those a
    checkpoint holds (an import from Hugging Face has none, and keeps them at their start)."""
    out = {}
    for name, buffer in engine.model.module.named_buffers():
        if saved is None or f"model.{name}" in saved:
            out[f"model.{name}"] = Chunked(tuple(buffer.shape),
                                           [((0,) * buffer.ndim, buffer)])
    return out


class CheckpointSaveFailed(CompactHydraException):
    """A save failed (a full disk, say): one line with the operating system's words and the
    path; the checkpoint before it is still the latest, and nothing of this one is left."""


class _RecordingWriter(dcp.FileSystemWriter):
    """DCP's file writer, remembering the files this rank wrote (their checksums are its part
    of meta.json)."""

    def __init__(self, path: Path):
        super().__init__(path)
        self.written: list[str] = []

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        self.written = sorted({result.storage_data.relative_path for result in future.value()})
        return future


@dataclass
class Staged:
    """What one rank writes of a checkpoint: DCP's objects and this rank's rectangles."""

    objects: dict[str, Any]
    tensors: dict[str, Chunked]

    @property
    def nbytes(self) -> int:
        """The bytes of its rectangles (an asynchronous save's staging copy)."""
        return sum(view.numel() * view.element_size()
                   for chunked in self.tensors.values() for _, view in chunked.chunks)

    def copy(self) -> Staged:
        """A copy in host memory, so training can change the rank's own tensors meanwhile."""
        return Staged(self.objects, {
            fqn: Chunked(c.shape, [(o, view.detach().to("cpu", copy=True)) for o, view in c.chunks])
            for fqn, c in self.tensors.items()})


def stage(engine: Engine, state: TrainState) -> Staged:
    """Collective over the engine's groups (the optimizer's moments are gathered): the views of
    what this rank writes."""
    moments = engine.optimizer.gather_moments()
    tensors = _tensors(engine, engine.optimizer.moment_views(moments))
    # The trainer draws no random numbers after initialisation (the sample order is a function
    # of data.seed and the sample index), so every rank's generator state is the same; it is
    # kept so that anything random added later (dropout) resumes exactly.
    objects = {"train_state": json.dumps(asdict(state)), "optim_step": moments.step,
               "rng": torch.get_rng_state()}
    return Staged(objects, tensors)


def folder_of(directory: Path, step: int) -> Path:
    return directory / f"{PREFIX}{step:08d}"


def save(engine: Engine, state: TrainState, directory: Path, meta: dict[str, Any]) -> Path:
    """Collective. Returns the finished checkpoint folder (see write)."""
    return write(stage(engine, state), state, directory, meta)


def write(staged: Staged, state: TrainState, directory: Path, meta: dict[str, Any],
          group: dist.ProcessGroup | None = None) -> Path:
    """Collective over `group` (None: the world), whose ranks are the world's in order.
    Returns the finished checkpoint folder. It is written as a .tmp folder and renamed once
    meta.json, with every file's checksum, is in it; a failure removes the .tmp."""
    final = folder_of(directory, state.step)
    tmp = final.with_name(final.name + TMP_SUFFIX)
    rank = dist.get_rank()
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier attempt at this step
            tmp.mkdir(parents=True)
        dist.barrier(group=group)
        writer = _RecordingWriter(tmp)
        dcp.save(staged.objects, storage_writer=writer,
                 planner=ChunkSavePlanner(staged.tensors), process_group=group)
        # Each rank checksums the files it wrote (still in its page cache), rank 0 also DCP's
        # .metadata; rank 0 records them all in meta.json, the file that marks the save done.
        mine = {name: file_checksum(tmp / name)
                for name in writer.written + ([METADATA] if rank == 0 else [])}
        everyone: list[dict | None] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine, group=group)
        if rank == 0:
            checksums = {name: value for part in everyone for name, value in part.items()}
            write_meta(tmp, {**meta, **asdict(state), CHECKSUMS: checksums})
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
        dist.barrier(group=group)
    except (OSError, CheckpointException) as error:  # CheckpointException: any rank's failure
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointSaveFailed(_save_failure(final, error)) from None
    return final


def write_meta(folder: Path, record: dict[str, Any]) -> None:
    """meta.json, flushed to the disk before the folder is renamed into place."""
    with open(folder / META, "w") as f:
        json.dump(record, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _save_failure(final: Path, error: BaseException) -> str:
    """One line from a failed save: the first rank's operating-system error (DCP wraps each
    rank's in a CheckpointException with its traceback) and what is left."""
    where = ""
    if isinstance(error, CheckpointException) and error.failures:
        failed, (error, _) = min(error.failures.items())
        where = f" on rank {failed}"
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        cause = _probe(final.parent)  # torch.save's writer reports a short write as its own
    if isinstance(cause, OSError) and cause.strerror:
        what = cause.strerror + (f": {cause.filename}" if cause.filename else "")
    else:
        what = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
    good = latest(final.parent, check=lambda path: verify(path, None))
    fix = ("free space on its disk" if isinstance(cause, OSError) and cause.errno == errno.ENOSPC
           else "make it writable")
    return (f"saving checkpoint {final} failed{where}: {what}. Nothing of it was kept; the "
            f"latest checkpoint is {good or 'none'}. Fix: {fix} (or set checkpoint.dir to "
            f"another disk), then run the same command again to resume")


def _probe(folder: Path, size: int = 1 << 20) -> OSError | None:
    """The operating system's own error for writing into `folder` now (before the failed
    save's files are removed, so a full disk is still full), or None if a write succeeds."""
    probe = folder / f".write-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            data = memoryview(bytes(size))
            while data:  # a nearly full disk takes part of a write; the next one fails
                data = data[os.write(fd, data):]
            os.fsync(fd)
        finally:
            os.close(fd)
        return None
    except OSError as error:
        return error
    finally:
        probe.unlink(missing_ok=True)


def saved_entries(path: Path) -> dict[str, Any]:
    """What a checkpoint holds, by name (DCP's .metadata: tensors' sizes, objects)."""
    return dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata


def check_loadable(path: Path, shapes: dict[str, tuple[int, ...]], finetune: bool,
                   where: str | None = None, fix: str = "use the model config it was saved with "
                   "(its meta.json records it)", saved: dict[str, Any] | None = None) -> None:
    """Before any rank starts: the checkpoint has every parameter of this model at its shape
    (`shapes`: the single-device ones), and a train state unless only weights are wanted.
    `where` names the checkpoint in the message (default: checkpoint.load=PATH); `saved`: its
    saved_entries, if read already."""
    where = where or f"checkpoint.load={path}"
    saved = saved_entries(path) if saved is None else saved
    for name, shape in shapes.items():
        entry = saved.get(f"model.{name}")
        if entry is None and finetune and is_adapter(name):
            continue  # peft=lora from a base: the adapters start fresh
        if not isinstance(entry, TensorStorageMetadata):
            raise ValueError(f"{where} has no weight {name!r}: another model wrote it. "
                             f"Fix: {fix}.")
        if tuple(entry.size) != shape:
            raise ValueError(f"{where}: weight {name!r} has shape {tuple(entry.size)}, this "
                             f"model's is {shape}. Fix: {fix}.")
    if not finetune and "train_state" not in saved:
        raise ValueError(f"{where} holds weights only (no optimizer state, step or data "
                         f"position; e.g. a Hugging Face import). Fix: set "
                         f"checkpoint.finetune=true.")


def load_weights(engine: Engine, path: Path) -> None:
    """Collective. Fills this rank's parameters only (checkpoint.finetune): the optimizer's
    moments and step, the train state and the random generators stay as built. `path` is a
    checkpoint folder the ranks verified (trainer.checkpoint.resume). A checkpoint of tied
    embeddings has no head: an untied model's head starts as its embedding (the function the
    checkpoint computed; trainer.checkpoint.match allows it to a fine-tune only)."""
    saved = set(saved_entries(path))
    model, tensors, head = engine.model, _buffers(engine, saved), {}
    for name, param in model.module.named_parameters():
        chunked = Chunked(model.global_shape(name), model.global_chunks(name, param.data))
        if f"model.{name}" not in saved and name == HEAD_WEIGHT:
            head[f"model.{EMBEDDING_WEIGHT}"] = chunked
        elif f"model.{name}" not in saved and is_adapter(name):
            continue  # peft=lora on a base checkpoint: the adapters start as initialised
        elif f"model.{name}" not in saved and not param.requires_grad:
            continue  # a LoRA checkpoint: the frozen base came from its base (adapters.py)
        else:
            tensors[f"model.{name}"] = chunked
    with torch.no_grad():
        dcp.load({}, checkpoint_id=path, planner=_ChunkLoadPlanner(tensors))
        # Every rank reads again (a collective), also one that holds no head (another stage's).
        if f"model.{HEAD_WEIGHT}" not in saved and not model.module.cfg.tie_word_embeddings:
            dcp.load({}, checkpoint_id=path, planner=_ChunkLoadPlanner(head))


def load(engine: Engine, path: Path) -> TrainState:
    """Collective. Fills this rank's parameters and Adam moments, whatever the saving layout.
    `path` is a checkpoint folder the ranks verified (trainer.checkpoint.resume)."""
    moments = engine.optimizer.empty_moments()
    tensors = _tensors(engine, engine.optimizer.moment_views(moments))
    objects: dict[str, Any] = {"train_state": "", "optim_step": 0,
                               "rng": torch.empty_like(torch.get_rng_state())}
    with torch.no_grad():
        dcp.load(objects, checkpoint_id=path, planner=_ChunkLoadPlanner(tensors))
    torch.set_rng_state(objects["rng"])
    moments.step = int(objects["optim_step"])
    engine.optimizer.load_moments(moments)
    return TrainState(**json.loads(objects["train_state"]))
