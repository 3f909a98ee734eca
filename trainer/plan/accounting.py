"""Sample accounting of a run: steps, evaluation batches and intervals, checked before any
process starts. Counts are independent samples (global batches), never ranks: CP, sequence
shards and TP change who reads a sample, not how many samples a step consumes.

Progress is samples too: a run ends when it has consumed train.train_samples, so a resume under
another global batch size continues at the checkpoint's consumed samples and ends exactly
there. A run from the start is whole steps; after a resume from a count that is not a multiple
of the new global batch, the last step is the smaller batch that is left, if that is a global
batch of the layout (whole micro-batches on every batch lane); otherwise the resume is refused.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from parallel.layout import Layout, LayoutError, multiples_near
from trainer.config import CheckpointConfig, TrainConfig


@dataclass(frozen=True)
class RunPlan:
    global_batch_size: int
    train_steps: int
    eval_interval: int | None  # steps
    eval_layout: Layout | None  # the layout whose global batch is one evaluation
    train_samples: int  # where the run ends, whatever global batch consumed the samples before

    @classmethod
    def from_config(cls, train: TrainConfig, checkpoint: CheckpointConfig,
                    layout: Layout) -> RunPlan:
        gbs = layout.global_batch_size
        if train.train_samples < 1 or train.train_samples % gbs:
            raise ValueError(
                f"train.train_samples={train.train_samples} is not a positive multiple of the "
                f"global batch size {gbs} (train.micro_batch_size x batch_parallel_size x "
                f"micro-batches): a run is whole steps. Fix: set train.train_samples to "
                f"{multiples_near(train.train_samples, gbs)}.")
        eval_layout = None
        if train.eval_interval is not None:
            if train.eval_interval < 1:
                raise ValueError(f"train.eval_interval={train.eval_interval} must be >= 1 "
                                 f"(steps). Fix: set it to a number of steps, or null for no "
                                 f"evaluation.")
            lanes = layout.micro_batch_times_batch_parallel_size
            if train.eval_samples < 1 or train.eval_samples % lanes:
                raise ValueError(
                    f"train.eval_samples={train.eval_samples} is not a positive multiple of "
                    f"train.micro_batch_size x batch_parallel_size = {layout.micro_batch_size} x "
                    f"{layout.batch_parallel_size} = {lanes}: every batch lane reads whole "
                    f"micro-batches. Fix: set train.eval_samples to "
                    f"{multiples_near(train.eval_samples, lanes)}.")
            eval_layout = replace(layout, global_batch_size=train.eval_samples)
        if checkpoint.save_interval is not None and checkpoint.save_interval < 1:
            raise ValueError(f"checkpoint.save_interval={checkpoint.save_interval} must be >= 1 "
                             f"(steps). Fix: set it to a number of steps, or null to save only "
                             f"at the end.")
        return cls(gbs, train.train_samples // gbs, train.eval_interval, eval_layout,
                   train.train_samples)

    def steps_from(self, consumed: int) -> int:
        """Steps left once `consumed` samples have been trained (the last may be smaller)."""
        return max(-(-(self.train_samples - consumed) // self.global_batch_size), 0)

    def step_layout(self, layout: Layout, consumed: int) -> Layout:
        """The layout of the step that starts at `consumed` samples: the run's, or for a last
        step with fewer samples left than a global batch, the same with that global batch (a
        LayoutError when it is not one: check_resume refuses that before any rank starts)."""
        left = self.train_samples - consumed
        return layout if left >= self.global_batch_size else replace(layout,
                                                                      global_batch_size=left)

    def check_resume(self, layout: Layout, consumed: int, where: str, saved_gbs: int | None,
                     again_ok: bool) -> None:
        """A run that resumes at `consumed` samples (`where`: the checkpoint, as the message
        names it) can end exactly at train.train_samples. again_ok: the run's own checkpoint,
        whose relaunch after the end has nothing to do and is no error."""
        total = self.train_samples
        if consumed > total or (consumed == total and not again_ok):
            past = "past" if consumed > total else "equal to"
            raise ValueError(
                f"{where} has consumed {consumed:,} samples, {past} train.train_samples="
                f"{total}: nothing is left to train. Fix: set train.train_samples above "
                f"{consumed} (a multiple of the global batch size {self.global_batch_size}) to "
                f"train on, or start from another checkpoint.")
        left = total - consumed
        if left % self.global_batch_size == 0:
            return
        try:
            self.step_layout(layout, total - left % self.global_batch_size)
        except LayoutError as error:
            # Every global batch of this layout is a multiple of one unit (whole micro-batches on
            # every lane, in groups of PP when interleaved) and the run's is one: so the samples
            # left are not, and no global batch size alone can end the run exactly.
            groups = layout.pp_size if layout.virtual_pipeline_size > 1 else 1
            unit = (f"train.micro_batch_size x batch_parallel_size"
                    f"{' x PP (interleaved)' if groups > 1 else ''} = "
                    f"{layout.micro_batch_times_batch_parallel_size * groups}")
            saved = (f" (the checkpoint was saved at train.global_batch_size={saved_gbs})"
                     if saved_gbs else "")
            raise ValueError(
                f"{where} has consumed {consumed:,} samples: the {left:,} left to "
                f"train.train_samples={total} are {left // self.global_batch_size} step(s) of "
                f"train.global_batch_size={self.global_batch_size} and a last one of "
                f"{left % self.global_batch_size} sample(s), which is no global batch of this "
                f"layout ({str(error).split(' Fix:')[0]}). Fix: resume with a "
                f"train.micro_batch_size and layout where {unit} divides the {left:,} samples "
                f"left{saved}.") from None
