"""The learning rate as a pure function of consumed samples, so it is identical under every
parallel layout and global batch size. Owns the schedule arithmetic and its config checks; it
must not touch the optimizer, torch or any process group (the loop sets the lr it returns).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from trainer.config import LrDecayStyle, ScheduleConfig

# Styles whose lr never reaches a decay end: they only need warmup <= decay samples. The others
# need a non-empty decay span (warmup < decay samples), which the progress r divides by.
NO_DECAY_END = (LrDecayStyle.constant, LrDecayStyle.inverse_sqrt)


@dataclass(frozen=True)
class LrSchedule:
    """Build with from_config, which validates. All lengths are in samples.

    Warmup (Megatron's convention): max_lr * consumed / warmup_samples while consumed <= warmup,
    so lr(0) = 0 and lr(warmup) = max_lr exactly; with warmup_samples = 0 there is no warmup and
    lr(0) is the first value of the decay. A loop that calls lr() with the samples consumed
    *before* a step trains its first step at lr 0 (as Megatron does); passing the count *after*
    the step avoids that. Either is layout-independent; pick one in the loop.
    """

    style: LrDecayStyle
    max_lr: float  # schedule.lr (the method lr() owns that name)
    min_lr: float
    warmup_samples: int
    decay_samples: int  # where linear/cosine/wsd reach min_lr; constant/inverse_sqrt ignore it
    wsd_decay_samples: Optional[int] = None  # wsd only: the final linear anneal

    @classmethod
    def from_config(cls, schedule: ScheduleConfig, train_samples: int) -> "LrSchedule":
        """Resolve warmup and decay samples and check them. Decay samples above train_samples
        are allowed (the run stops before the decay ends); warmup past train_samples then too."""
        _check_values(schedule)
        decay = train_samples if schedule.lr_decay_samples is None else schedule.lr_decay_samples
        decay_key = (f"schedule.lr_decay_samples={schedule.lr_decay_samples}"
                     if schedule.lr_decay_samples is not None
                     else f"schedule.lr_decay_samples=null (train.train_samples={train_samples})")
        if decay < 1:
            raise ValueError(f"{decay_key} is below 1: the schedule needs a decay span. Fix: set "
                             "a positive schedule.lr_decay_samples (or train.train_samples).")
        if schedule.lr_warmup_samples is not None:
            warmup = schedule.lr_warmup_samples
            warmup_key = f"schedule.lr_warmup_samples={warmup}"
        elif schedule.lr_warmup_fraction is not None:
            # Rounded down; round(.., 6) first so 0.29 x 100 is 29, not 28.999999999999996 -> 28.
            warmup = int(round(schedule.lr_warmup_fraction * decay, 6))
            warmup_key = (f"schedule.lr_warmup_fraction={schedule.lr_warmup_fraction} "
                          f"({warmup} samples of {decay})")
        else:
            warmup, warmup_key = 0, "no warmup"
        style = schedule.lr_decay_style
        if style in NO_DECAY_END and warmup > decay:
            raise ValueError(f"{warmup_key} is above {decay_key}: warmup must end within the "
                             "schedule. Fix: shorten the warmup or lengthen the decay samples.")
        if style not in NO_DECAY_END and warmup >= decay:
            raise ValueError(f"{warmup_key} is not below {decay_key}: warmup must end before the "
                             "decay does. Fix: shorten the warmup or lengthen the decay samples.")
        wsd = schedule.lr_wsd_decay_samples
        if style is LrDecayStyle.wsd and wsd > decay - warmup:
            raise ValueError(
                f"schedule.lr_wsd_decay_samples={wsd} does not fit between the end of warmup "
                f"({warmup_key}) and {decay_key}: at most {decay - warmup} samples are left. "
                "Fix: shorten the anneal or the warmup, or lengthen the decay samples.")
        return cls(style, schedule.lr, schedule.min_lr, warmup, decay, wsd)

    def lr(self, consumed_samples: int) -> float:
        """The learning rate once consumed_samples samples have been consumed (any value >= 0)."""
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples={consumed_samples} is negative")
        warmup, decay = self.warmup_samples, self.decay_samples
        if consumed_samples <= warmup and warmup > 0:
            return self.max_lr * consumed_samples / warmup
        if self.style is LrDecayStyle.constant:
            return self.max_lr
        if self.style is LrDecayStyle.inverse_sqrt:
            # Continuous at the end of warmup (= max_lr there); before any sample it is max_lr.
            scale = math.sqrt(max(warmup, 1)) / math.sqrt(max(consumed_samples, 1))
            return max(self.max_lr * scale, self.min_lr)
        if consumed_samples >= decay:
            return self.min_lr
        span = self.max_lr - self.min_lr
        if self.style is LrDecayStyle.wsd:
            anneal_start = decay - self.wsd_decay_samples
            if consumed_samples <= anneal_start:
                return self.max_lr
            return self.max_lr - span * (consumed_samples - anneal_start) / self.wsd_decay_samples
        progress = (consumed_samples - warmup) / (decay - warmup)
        if self.style is LrDecayStyle.linear:
            return self.max_lr - span * progress
        assert self.style is LrDecayStyle.cosine, self.style
        return self.min_lr + span * 0.5 * (1.0 + math.cos(math.pi * progress))

    def describe(self) -> str:
        """One line for the start line, every count with its unit and thousands separators, e.g.
        'cosine: lr 0.001, warmup 1,024 samples, decay to 0.0001 at 16,384 samples'."""
        def _samples(count: int) -> str:  # a reader of the logs should never guess the unit
            return f"{count:,} sample" + ("" if count == 1 else "s")

        head = f"{self.style.value}: lr {self.max_lr:g}, warmup {_samples(self.warmup_samples)}"
        if self.style is LrDecayStyle.constant:
            return f"{head}, then constant"
        if self.style is LrDecayStyle.inverse_sqrt:
            # lr() scales by sqrt(max(warmup, 1) / consumed): say where the 1/sqrt fall starts.
            return (f"{head}, then falls as 1/sqrt(samples) from "
                    f"{_samples(max(self.warmup_samples, 1))}, floor {self.min_lr:g}")
        if self.style is LrDecayStyle.wsd:
            stable_end = self.decay_samples - self.wsd_decay_samples
            head += f", stable to {_samples(stable_end)}, anneal"
        else:
            head += ", decay"
        return f"{head} to {self.min_lr:g} at {_samples(self.decay_samples)}"


def _check_values(schedule: ScheduleConfig) -> None:
    """The checks that need no resolved sample counts; each names its keys, values and fix."""
    s = schedule
    if not (math.isfinite(s.lr) and s.lr >= 0):
        raise ValueError(f"schedule.lr={s.lr} must be a finite number >= 0. Fix: set e.g. "
                         "schedule.lr=3e-4.")
    if s.lr == 0:  # min_lr <= lr: every step's learning rate would be 0, the run a no-op
        raise ValueError("schedule.lr=0 trains nothing: no step's learning rate is above "
                         "schedule.lr, so the weights would never change. Fix: set e.g. "
                         "schedule.lr=3e-4.")
    if not (math.isfinite(s.min_lr) and s.min_lr >= 0):
        raise ValueError(f"schedule.min_lr={s.min_lr} must be a finite number >= 0. Fix: set "
                         "schedule.min_lr >= 0 (e.g. a tenth of schedule.lr).")
    if s.min_lr > s.lr:
        raise ValueError(f"schedule.min_lr={s.min_lr} is above schedule.lr={s.lr}: the schedule "
                         "would rise while decaying. Fix: set schedule.min_lr <= schedule.lr.")
    if s.lr_warmup_samples is not None and s.lr_warmup_fraction is not None:
        raise ValueError(
            f"schedule.lr_warmup_samples={s.lr_warmup_samples} and schedule.lr_warmup_fraction="
            f"{s.lr_warmup_fraction} are both set: only one may say how long warmup is. "
            "Fix: set the other one to null.")
    if s.lr_warmup_fraction is not None and not 0 <= s.lr_warmup_fraction < 1:
        raise ValueError(f"schedule.lr_warmup_fraction={s.lr_warmup_fraction} is outside [0, 1): "
                         "it is a share of the decay samples. Fix: use e.g. 0.01.")
    if s.lr_warmup_samples is not None and s.lr_warmup_samples < 0:
        raise ValueError(f"schedule.lr_warmup_samples={s.lr_warmup_samples} is negative. "
                         "Fix: set it >= 0 (0 = no warmup).")
    wsd, style = s.lr_wsd_decay_samples, s.lr_decay_style
    if style is LrDecayStyle.wsd and wsd is None:
        raise ValueError("schedule.lr_wsd_decay_samples=null with schedule.lr_decay_style=wsd: "
                         "wsd needs the length of its final anneal. Fix: set "
                         "schedule.lr_wsd_decay_samples (e.g. a tenth of the decay samples).")
    if style is LrDecayStyle.wsd and wsd < 1:
        raise ValueError(f"schedule.lr_wsd_decay_samples={wsd} is below 1: the anneal needs at "
                         "least one sample. Fix: set schedule.lr_wsd_decay_samples >= 1.")
    if style is not LrDecayStyle.wsd and wsd is not None:
        raise ValueError(f"schedule.lr_wsd_decay_samples={wsd} is set but "
                         f"schedule.lr_decay_style={style.value}: only wsd reads it, so it would "
                         "be silently ignored. Fix: set it to null, or use lr_decay_style=wsd.")
