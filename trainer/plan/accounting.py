"""Sample accounting of a run: steps, evaluation batches and intervals, checked before any
process starts. Counts are independent samples (global batches), never ranks: CP, sequence
shards and TP change who reads a sample, not how many samples a step consumes.

Progress is samples too: a run ends when it has consumed train.train_samples, so a resume under
another global batch size continues at the checkpoint's consumed samples and ends exactly
there. A step's global batch is a function of the samples consumed before it: the layout's,
or under train.rampup_batch_size Megatron's ramp (trainer.plan.rampup). A run from the start
is whole steps; after a resume from a count the new steps do not reach exactly, the last step
is the smaller batch that is left, if that is a global batch of the layout (whole micro-batches
on every batch lane); otherwise the resume is refused.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from parallel.layout import Layout, LayoutError, multiples_near
from trainer.config import CheckpointConfig, TrainConfig
from trainer.plan.rampup import BatchRamp


@dataclass(frozen=True)
class RunPlan:
    global_batch_size: int
    train_steps: int
    eval_interval: int | None  # steps
    eval_layout: Layout | None  # the layout whose global batch is one evaluation
    train_samples: int  # where the run ends, whatever global batch consumed the samples before
    ramp: BatchRamp | None = None  # train.rampup_batch_size

    @classmethod
    def from_config(cls, train: TrainConfig, checkpoint: CheckpointConfig,
                    layout: Layout) -> RunPlan:
        gbs, total = layout.global_batch_size, train.train_samples
        ramp = BatchRamp.from_config(train.rampup_batch_size, layout)
        ramp_steps = ramp.steps(0, total) if ramp else []
        ramped = sum(ramp_steps[-1]) if ramp_steps else 0  # where the ramp's steps end
        if ramp_steps and ramp_steps[-1][1] < ramp.global_batch(ramp_steps[-1][0]):
            start = ramp_steps[-1][0]  # the run would end inside this ramp step
            ends = [count for count in (start, start + ramp.global_batch(start)) if count]
            raise ValueError(
                f"train.train_samples={total} ends inside a step of the batch ramp-up "
                f"({ramp.describe()}): a run is whole steps. Fix: set train.train_samples to "
                f"{' or '.join(map(str, ends))}.")
        if total < 1 or (total - ramped) % gbs:
            after = f" after the ramp-up's steps end at {ramped:,} samples" if ramped else ""
            near = " or ".join(str(ramped + int(n)) for n in
                               multiples_near(total - ramped, gbs).split(" or "))
            raise ValueError(
                f"train.train_samples={total} is not a positive multiple of the global batch "
                f"size {gbs} (train.micro_batch_size x batch_parallel_size x micro-batches)"
                f"{after}: a run is whole steps. Fix: set train.train_samples to {near}.")
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
        plan = cls(gbs, 0, train.eval_interval, eval_layout, total, ramp)
        return replace(plan, train_steps=plan.steps_from(0))

    def describe_batch(self) -> str:
        """The steps' global batch, for the start line and the dry run."""
        return (self.ramp.describe() if self.ramp
                else f"global batch {self.global_batch_size} samples")

    def batch_at(self, consumed: int) -> int:
        """The global batch of the step that starts at `consumed` samples: the ramp's or the
        layout's, or for a last step with fewer samples left, what is left."""
        full = self.ramp.global_batch(consumed) if self.ramp else self.global_batch_size
        return min(full, self.train_samples - consumed)

    def _ramp_steps(self, consumed: int) -> list[tuple[int, int]]:
        """(consumed, batch) of the ramp's steps from `consumed` (none without a ramp)."""
        return self.ramp.steps(consumed, self.train_samples) if self.ramp else []

    def _after_ramp(self, consumed: int) -> tuple[int, int]:
        """(the ramp's steps from `consumed`, the samples consumed once they are taken)."""
        ramp = self._ramp_steps(consumed)
        return len(ramp), sum(ramp[-1]) if ramp else consumed

    def steps_from(self, consumed: int) -> int:
        """Steps left once `consumed` samples have been trained (the last may be smaller)."""
        steps, consumed = self._after_ramp(consumed)
        return steps + max(-(-(self.train_samples - consumed) // self.global_batch_size), 0)

    def step_layout(self, layout: Layout, consumed: int) -> Layout:
        """The layout of the step that starts at `consumed` samples: the run's with this step's
        global batch (a LayoutError when a last step's is not one: check_resume refuses that
        before any rank starts)."""
        batch = self.batch_at(consumed)
        return layout if batch == layout.global_batch_size else replace(layout,
                                                                         global_batch_size=batch)

    def last_step(self, consumed: int) -> int | None:
        """The samples of the last step from `consumed` when it is cut short (fewer left than
        the step's global batch), else None."""
        ramp = self._ramp_steps(consumed)
        after = sum(ramp[-1]) if ramp else consumed
        if ramp and after == self.train_samples:  # the ramp's steps end the run
            start, batch = ramp[-1]
            return batch if batch < self.ramp.global_batch(start) else None
        return (self.train_samples - after) % self.global_batch_size or None

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
        left, cut = total - consumed, self.last_step(consumed)
        gbs_key = f"train.global_batch_size={self.global_batch_size}"
        if cut is None:
            return
        try:
            self.step_layout(layout, total - cut)
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
            of = f"the batch ramp-up and of {gbs_key}" if self.ramp else gbs_key
            raise ValueError(
                f"{where} has consumed {consumed:,} samples: the {left:,} left to "
                f"train.train_samples={total} are {self.steps_from(consumed) - 1} step(s) of "
                f"{of} and a last one of {cut} sample(s), which is no global batch of this "
                f"layout ({str(error).split(' Fix:')[0]}). Fix: resume with a "
                f"train.micro_batch_size and layout where {unit} divides the {left:,} samples "
                f"left{saved}.") from None
