"""What a run starts from, decided in one place: its own latest checkpoint (a relaunch continues
where it stopped), checkpoint.load, or nothing. launch.py asks before any rank starts, with a
quick look at each checkpoint, and checks what the config can tell against the checkpoint's
metadata (the model's shapes, the weights it holds and the model settings its run recorded:
trainer.checkpoint.match; the sample stream, the samples left to train), so a mismatch is
one line before anything is built; the ranks then ask again in start_state, verifying every
file's checksum between them (an older checkpoint is taken when the newest turns out to be
damaged), and load it into their built engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from parallel.layout import Layout
from trainer.checkpoint import match
from trainer.checkpoint.integrity import Verifier, agreed, latest, read_meta, resolve
from trainer.config import RUN_CHECKPOINTS, CheckpointConfig, ConfigError, ModelConfig
from trainer.plan.accounting import RunPlan

if TYPE_CHECKING:
    from trainer.checkpoint import dcp

OTHER_FOLDER = "give this run its own folder (hydra.run.dir) or checkpoint.dir"


def save_folder(ckpt: CheckpointConfig, run_dir: Path) -> Path:
    """Where a run writes (and auto-resumes) its checkpoints."""
    return Path(ckpt.dir) if ckpt.dir else run_dir / RUN_CHECKPOINTS


@dataclass(frozen=True)
class ResumePoint:
    path: Path
    weights_only: bool  # checkpoint.finetune: weights from checkpoint.load, then step 0
    own: bool  # the run's own latest checkpoint: a relaunch after the end has nothing to do

    @property
    def where(self) -> str:
        """How a message names it."""
        return (f"this run's latest checkpoint {self.path}" if self.own
                else f"checkpoint.load={self.path}")


def find(ckpt: CheckpointConfig, save_dir: Path, warn: Callable[[str], None] | None,
         check: Verifier) -> ResumePoint | None:
    """The checkpoint this run starts from, or None. A relaunch (of a fine-tuning run too)
    continues from its own latest; otherwise checkpoint.load, all of it or (finetune) its
    weights only. `check` says whether a checkpoint is good (trainer.checkpoint.integrity)."""
    if ckpt.resume and (ckpt.finetune or ckpt.load is None):
        own = latest(save_dir, warn, check)
        if own is not None:  # checkpoint.load is not read: the run is past it
            return ResumePoint(own, False, True)
    if ckpt.load is not None:
        return ResumePoint(resolve(Path(ckpt.load), warn, check), ckpt.finetune, False)
    return None


@dataclass(frozen=True)
class Expected:
    """What this run's config says a checkpoint it starts from must match."""

    shapes: dict[str, tuple[int, ...]]  # every parameter of the model (model.plan)
    stream: dict  # the sample stream's identity (trainer.data.stream)
    plan: RunPlan
    layout: Layout
    model: ModelConfig  # the settings the checkpoint's must match (a resume) or are noted against


def check(point: ResumePoint, expected: Expected) -> list[str]:
    """What the checkpoint's metadata can tell before its tensors are read: every weight of this
    model at its shape and none dropped, the model settings it was trained with (a fine-tune's
    differences are notes, returned), the same sample stream, and an end at exactly
    train.train_samples. A ValueError names the checkpoint and the fix."""
    fix = "use the model config it was saved with (its meta.json records it)"
    fix += f", or {OTHER_FOLDER}" if point.own else ""
    from trainer.checkpoint import dcp  # torch: only when there is a checkpoint to look at

    try:
        meta = read_meta(point.path)
    except ValueError as error:
        raise ValueError(f"{point.where}: {error}. Fix: start from another checkpoint.") from None
    saved = dcp.saved_entries(point.path)
    names = {name.removeprefix("model.") for name in saved if name.startswith("model.")}
    notes = match.weights(names, expected.model, point.where, point.weights_only, fix)
    # A tied checkpoint has no head; a fine-tune's untied head starts as its embedding.
    shapes = {name: shape for name, shape in expected.shapes.items()
              if name != match.HEAD_WEIGHT or name in names}
    dcp.check_loadable(point.path, shapes, point.weights_only, point.where, fix, saved)
    finetune = ("checkpoint.finetune=true" if not point.own else
                f"checkpoint.load={point.path} checkpoint.finetune=true, in another folder")
    notes += match.settings(meta.get("model"), expected.model, point.where, point.weights_only,
                            finetune)
    if point.weights_only:
        return notes
    if meta.get("data") != expected.stream:
        raise ValueError(
            f"{point.where} was trained on the sample stream {meta.get('data')}, this run's is "
            f"{expected.stream}. Fix: use the same dataset, train.seq_length and data.seed, or "
            f"{OTHER_FOLDER if point.own else 'start from another checkpoint'}.")
    consumed = meta.get("consumed_samples")
    if not isinstance(consumed, int) or consumed < 0:
        raise ValueError(f"{point.where}: its meta.json records no consumed_samples. Fix: start "
                         f"from another checkpoint.")
    expected.plan.check_resume(expected.layout, consumed, point.where,
                               meta.get("global_batch_size"), again_ok=point.own)
    return notes


def start_state(engine: dcp.Engine, ckpt: CheckpointConfig, save_dir: Path, expected: Expected,
                say: Callable[[str], None] | None) -> dcp.TrainState:
    """Collective: find the checkpoint the run starts from, every file's checksum verified split
    over the ranks (trainer.checkpoint.integrity.agreed), check it, and load it into the built
    engine; a fresh state when there is none. `say` prints (rank 0) or is None."""
    from trainer.checkpoint import dcp  # torch (a rank)

    fresh, notes = dcp.TrainState(data=expected.stream), []
    try:
        point = find(ckpt, save_dir, say, agreed(engine.groups.world.handle))
        if point is not None:
            notes = check(point, expected)
    except (ValueError, FileNotFoundError) as error:
        raise ConfigError(str(error)) from None
    if point is None:
        return fresh
    if point.weights_only:  # fine-tuning: this run starts at step 0
        dcp.load_weights(engine, point.path)
        if say:
            for note in notes:
                say(note)
            say(f"fine-tuning from {point.path}: weights loaded; optimizer, schedule and data "
                f"start fresh")
        return fresh
    return dcp.load(engine, point.path)
