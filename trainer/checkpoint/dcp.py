"""Checkpoints with torch.distributed.checkpoint (DCP), loadable under any layout.

Every value is saved at its place in the single-device tensor (global offsets), so a checkpoint
does not know the layout that wrote it: DCP reads, for each rank, just the overlap with what the
rank now holds. Parameters and Adam moments come back bit-exactly. A checkpoint is written into
`step_XXXXXXXX.tmp` and renamed when every rank has finished, so a crash mid-save leaves the
last good checkpoint untouched; one damaged later (a full disk, a truncated copy) fails
verify() and a resume skips it.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from trainer.train.engine import Engine

PREFIX, TMP_SUFFIX = "step_", ".tmp"


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
    model, out = engine.model, {}
    for name, param in model.module.named_parameters():
        shape = model.global_shape(name)
        out[f"model.{name}"] = Chunked(shape, model.global_chunks(name, param.data))
        if name in model.stage_copies:  # the same values as its owner's; no moments here
            continue
        avg, avg_sq = moments_views[name]
        out[f"optim.exp_avg.{name}"] = Chunked(shape, model.global_chunks(name, avg))
        out[f"optim.exp_avg_sq.{name}"] = Chunked(shape, model.global_chunks(name, avg_sq))
    return out


def save(engine: Engine, state: TrainState, directory: Path, meta: dict[str, Any]) -> Path:
    """Collective. Returns the finished checkpoint folder."""
    final = directory / f"{PREFIX}{state.step:08d}"
    tmp = final.with_name(final.name + TMP_SUFFIX)
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier attempt at this step
        tmp.mkdir(parents=True)
    dist.barrier()
    moments = engine.optimizer.gather_moments()
    tensors = _tensors(engine, engine.optimizer.moment_views(moments))
    # The trainer draws no random numbers after initialisation (the sample order is a function of
    # data.seed and the sample index), so every rank's generator state is the same; it is kept
    # so that anything random added later (dropout) resumes exactly.
    objects = {"train_state": json.dumps(asdict(state)), "optim_step": moments.step,
               "rng": torch.get_rng_state()}
    dcp.save(objects, checkpoint_id=tmp, planner=ChunkSavePlanner(tensors))
    dist.barrier()
    if dist.get_rank() == 0:
        (tmp / "meta.json").write_text(json.dumps({**meta, **asdict(state)}, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    dist.barrier()
    return final


def latest(directory: Path, warn: Callable[[str], None] | None = None) -> Path | None:
    """The newest good finished checkpoint in a folder of them (unfinished .tmp ones never
    count). A newer one that is corrupt or incomplete is skipped, with a line to `warn`: a run
    killed while a disk filled up must still resume from the checkpoint before."""
    found = sorted(p for p in directory.glob(f"{PREFIX}*") if p.is_dir()
                   and not p.name.endswith(TMP_SUFFIX))
    for path in reversed(found):
        problem = verify(path)
        if problem is None:
            return path
        if warn is not None:
            warn(f"warning: skipped checkpoint {path}: {problem}")
    return None


def resolve(path: Path, warn: Callable[[str], None] | None = None) -> Path:
    """A checkpoint folder, or a folder of them (the latest good one)."""
    if (path / ".metadata").exists():
        problem = verify(path)
        if problem is not None:
            raise ValueError(f"checkpoint.load={path}: {problem}. Fix: point checkpoint.load at "
                             f"a good checkpoint (or at its folder, for the latest good one).")
        return path
    skipped: list[str] = []

    def skip(line: str) -> None:
        skipped.append(line)
        if warn is not None:
            warn(line)

    found = latest(path, skip)
    if found is None:
        bad = f"; {len(skipped)} there are corrupt or incomplete" if skipped else ""
        raise FileNotFoundError(
            f"checkpoint.load={path}: no checkpoint there (a folder with .metadata, or a folder "
            f"of {PREFIX}* checkpoints){bad}. Fix: point checkpoint.load at one, or set it to "
            f"null.")
    return found


def verify(path: Path) -> str | None:
    """What is wrong with a checkpoint folder, or None: cheap, with no process group. Reads
    DCP's .metadata and checks that every stored item's bytes are there; meta.json, which rank
    0 writes last, says the save finished."""
    if not (path / ".metadata").is_file():
        return "it has no .metadata (the save did not finish)"
    try:
        storage = dcp.FileSystemReader(str(path)).read_metadata().storage_data
    except Exception as error:  # noqa: BLE001  (unpickling garbage can raise anything)
        why = (str(error).splitlines() or [""])[0][:80]
        return f"its .metadata is unreadable ({type(error).__name__}: {why})"
    if not isinstance(storage, dict):
        return "its .metadata lists no stored data"
    sizes: dict[str, int | None] = {}  # each data file holds many items: stat it once
    for info in storage.values():
        name, end = info.relative_path, info.offset + info.length
        if name not in sizes:
            sizes[name] = (path / name).stat().st_size if (path / name).is_file() else None
        size = sizes[name]
        if size is None:
            return f"its data file {name} is missing"
        if size < end:
            return f"its data file {name} is truncated ({size} of at least {end} bytes)"
    if not (path / "meta.json").is_file():
        return "its meta.json is missing (the save did not finish)"
    return None


def check_loadable(path: Path, shapes: dict[str, tuple[int, ...]], finetune: bool) -> None:
    """Before any rank starts: the checkpoint has every parameter of this model at its shape
    (`shapes`: the single-device ones), and a train state unless only weights are wanted."""
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for name, shape in shapes.items():
        entry = saved.get(f"model.{name}")
        if not isinstance(entry, TensorStorageMetadata):
            raise ValueError(f"checkpoint.load={path} has no weight {name!r}: another model wrote "
                             f"it. Fix: use the model config it was saved with (its meta.json "
                             f"records it).")
        if tuple(entry.size) != shape:
            raise ValueError(f"checkpoint.load={path}: weight {name!r} has shape "
                             f"{tuple(entry.size)}, this model's is {shape}. Fix: use the model "
                             f"config it was saved with (its meta.json records it).")
    if not finetune and "train_state" not in saved:
        raise ValueError(f"checkpoint.load={path} holds weights only (no optimizer state, step or "
                         f"data position; e.g. a Hugging Face import). Fix: set "
                         f"checkpoint.finetune=true.")


def load_weights(engine: Engine, path: Path) -> None:
    """Collective. Fills this rank's parameters only (checkpoint.finetune): the optimizer's
    moments and step, the train state and the random generators stay as built."""
    path = resolve(path)
    model, tensors = engine.model, {}
    for name, param in model.module.named_parameters():
        tensors[f"model.{name}"] = Chunked(model.global_shape(name),
                                          model.global_chunks(name, param.data))
    with torch.no_grad():
        dcp.load({}, checkpoint_id=path, planner=_ChunkLoadPlanner(tensors))


def load(engine: Engine, path: Path) -> TrainState:
    """Collective. Fills this rank's parameters and Adam moments, whatever the saving layout."""
    path = resolve(path)
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
