"""What a run starts from, decided in one place: its own latest checkpoint (a relaunch continues
where it stopped), checkpoint.load, or nothing. launch.py asks before any rank starts, with a
quick look at each checkpoint, and checks what the config can tell against the checkpoint's
metadata (the model's shapes, the weights it holds and the model settings its run recorded:
trainer.checkpoint.match; the sample stream, the samples left to train), so a mismatch is
one line before anything is built; the ranks then ask again in start_state, verifying every
file's checksum between them (an older checkpoint is taken when the newest turns out to be
damaged), and load it into their built engine. A rank in the launcher's own process is handed
what it found and checked (Decided), so each step runs once in a process.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from parallel.layout import Layout
from trainer.checkpoint import match
from trainer.checkpoint.adapters import BASE, base_of, find_base
from trainer.checkpoint.integrity import Verifier, agreed, latest, read_meta, resolve
from trainer.config import (
    RUN_CHECKPOINTS,
    CheckpointConfig,
    ConfigError,
    ModelConfig,
    PeftConfig,
)
from trainer.parts.lora import is_adapter
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

    shapes: dict[str, tuple[int, ...]]  # every parameter of the model (parts.assembly)
    stream: dict  # the sample stream's identity (trainer.data.stream)
    plan: RunPlan
    layout: Layout
    model: ModelConfig  # the settings the checkpoint's must match (a resume) or are noted against
    # the parameters optim=muon updates (trainer.parts.matrices; each saves a momentum_buffer
    # where AdamW saves exp_avg and exp_avg_sq); empty under adamw
    muon: frozenset[str] = frozenset()
    # peft=lora: `shapes` holds the adapters, the only parameters with optimizer state; a
    # fine-tune may start them fresh (a base checkpoint has none)
    peft: PeftConfig | None = None
    seed: int = 0  # train.seed: a LoRA checkpoint's base may be the seed's initial weights


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
    base = meta.get(BASE)  # a LoRA checkpoint: the adapters, its base elsewhere
    if base and expected.peft is None:
        raise ValueError(f"{point.where} holds LoRA adapters (its base: {base}), this run has "
                         f"peft=null. Fix: peft=lora with meta.json's peft settings, or export "
                         f"it merged (python -m trainer.hf export) and import that.")
    if base:
        find_base(point.where, base, expected.seed)
    notes = match.weights(names, expected.model, point.where, point.weights_only, fix,
                          expected.peft)
    # A tied checkpoint has no head; a fine-tune's untied head starts as its embedding.
    shapes = {name: shape for name, shape in expected.shapes.items()
              if (name != match.HEAD_WEIGHT or name in names)
              and (not base or is_adapter(name))}
    dcp.check_loadable(point.path, shapes, point.weights_only, point.where, fix, saved)
    finetune = ("checkpoint.finetune=true" if not point.own else
                f"checkpoint.load={point.path} checkpoint.finetune=true, in another folder")
    notes += match.settings(meta.get("model"), expected.model, point.where, point.weights_only,
                            finetune)
    if point.weights_only:
        return notes
    _check_optimizer_state(saved, expected, point.where, fix)
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


@dataclass(frozen=True)
class Decided:
    """What the launcher found (a quick look: no checksums) and checked, for a rank started in
    its own process (world size 1, or torchrun/submitit), which then neither finds nor checks
    again; spawned ranks and restarts find for themselves."""

    point: ResumePoint | None
    notes: list[str]  # check()'s
    warnings: list[str]  # the checkpoints find() skipped, said by the rank (in the run's log)


def decide(ckpt: CheckpointConfig, save_dir: Path,
           expected: Callable[[], Expected]) -> Decided:
    """The launcher's find and check; `expected` is called only when there is a checkpoint."""
    from trainer.checkpoint.integrity import verify

    warnings: list[str] = []
    point = find(ckpt, save_dir, warnings.append, lambda path: verify(path, None))
    return Decided(point, check(point, expected()) if point is not None else [], warnings)


def start_state(engine: dcp.Engine, ckpt: CheckpointConfig, save_dir: Path, expected: Expected,
                say: Callable[[str], None] | None,
                decided: Decided | None = None) -> dcp.TrainState:
    """Collective: the checkpoint the run starts from, every file's checksum verified split
    over the ranks (trainer.checkpoint.integrity.agreed), checked and loaded into the built
    engine; a fresh state when there is none. `decided`: the launcher's choice in this process,
    taken when every rank has the same one and its checksums hold; else (or without it) found
    and checked here. `say` prints (rank 0) or is None."""
    from trainer.checkpoint import dcp  # torch (a rank)

    fresh, notes = dcp.TrainState(data=expected.stream), []
    files_good = agreed(engine.groups.world.handle)
    try:
        if decided is not None and _taken(decided, engine.groups.world.handle, files_good):
            point, notes = decided.point, decided.notes
            for line in decided.warnings if say else ():
                say(line)
        else:  # a damaged file in the launcher's choice: find again, every checksum verified
            point = find(ckpt, save_dir, say, files_good)
            if point is not None:
                notes = check(point, expected)
    except (ValueError, FileNotFoundError) as error:
        raise ConfigError(str(error)) from None
    if point is None:
        return fresh
    base = base_of(point.path)
    if base and "path" in base:  # a LoRA checkpoint: its frozen base first (check() found it)
        dcp.load_weights(engine, Path(base["path"]))
    if point.weights_only:  # fine-tuning: this run starts at step 0
        dcp.load_weights(engine, point.path)
        if say:
            for note in notes:
                say(note)
            say(f"fine-tuning from {point.path}: weights loaded; optimizer, schedule and data "
                f"start fresh")
        return fresh
    return dcp.load(engine, point.path)


def _taken(decided: Decided, group, files_good: Verifier) -> bool:
    """Collective: every rank's launcher chose the same checkpoint, and its files are good."""
    import torch.distributed as dist

    mine = None if decided.point is None else str(decided.point.path)
    every: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    if any(path != mine for path in every):
        return False
    return decided.point is None or files_good(decided.point.path) is None


def _check_optimizer_state(saved: dict, expected: Expected, where: str, fix: str) -> None:
    """A resume continues the optimizer it was saved with: each weight's state is the one this
    run's optimizer keeps (Muon's momentum, or AdamW's two moments)."""
    for name in expected.shapes:
        if f"model.{name}" not in saved or (expected.peft and not is_adapter(name)):
            continue  # not in it, or frozen (LoRA's base: no state)
        muon = name in expected.muon
        if f"optim.{'momentum_buffer' if muon else 'exp_avg'}.{name}" in saved:
            continue
        theirs, ours = ("AdamW's moments", "optim=muon") if muon else ("Muon's momentum",
                                                                      "AdamW")
        raise ValueError(
            f"{where} holds {theirs} for {name!r}, where this run's optimizer ({ours}) keeps "
            f"{'a momentum' if muon else 'two moments'}. Fix: resume with the optimizer it was "
            f"saved with (its meta.json records the config), or start the optimizer afresh "
            f"from its weights with checkpoint.finetune=true, in another folder.")
