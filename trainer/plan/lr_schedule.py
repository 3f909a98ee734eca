"""The learning rate and the weight decay as pure functions of consumed samples: Megatron-Core's
OptimizerParamScheduler (get_lr, get_wd) in its sample-based form, so a run moved here from
Megatron trains every step at the same values, under every layout, global batch and ramp-up.
Owns that arithmetic and its config checks; no torch, no optimizer (the loop sets what it
returns, for the samples consumed *before* each step, as Megatron steps its scheduler after
each update and builds it at 0).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from trainer.config import (
    LrDecayStyle,
    OptimConfig,
    ScheduleConfig,
    WeightDecayIncrStyle,
    WsdDecayStyle,
)

WSD, INVERSE_SQRT = LrDecayStyle.WSD, LrDecayStyle["inverse-square-root"]


def _samples(count: float) -> str:
    """'1,024 samples': a reader of the logs should never guess the unit. Megatron's warmup
    from a fraction need not be whole ('6.4 samples')."""
    text = f"{count:,.0f}" if float(count).is_integer() else f"{count:,.6g}"
    return f"{text} sample" + ("" if count == 1 else "s")


@dataclass(frozen=True)
class LrSchedule:
    """Build with from_config, which validates. All lengths are in samples, as Megatron's
    sample-based training passes them to its scheduler (whose names say steps)."""

    style: LrDecayStyle
    max_lr: float  # schedule.lr (the method lr() owns that name)
    min_lr: float
    init_lr: float  # schedule.lr_warmup_init
    warmup_samples: float  # lr_warmup_fraction x decay samples is not rounded, as in Megatron
    decay_samples: int
    wsd_decay_samples: Optional[int] = None  # WSD only: the final anneal
    wsd_style: WsdDecayStyle = WsdDecayStyle.exponential  # WSD only

    @classmethod
    def from_config(cls, schedule: ScheduleConfig, train_samples: int) -> LrSchedule:
        """Resolve warmup and decay samples (Megatron's get_optimizer_param_scheduler) and check
        them. Decay samples above train_samples are allowed (the run stops before the decay
        ends)."""
        _check_values(schedule)
        s = schedule
        decay = train_samples if s.lr_decay_samples is None else s.lr_decay_samples
        decay_key = (f"schedule.lr_decay_samples={s.lr_decay_samples}"
                     if s.lr_decay_samples is not None
                     else f"schedule.lr_decay_samples=null (train.train_samples={train_samples})")
        if decay < 1:
            raise ValueError(f"{decay_key} is below 1: the schedule needs a decay span. Fix: set "
                             "a positive schedule.lr_decay_samples (or train.train_samples).")
        if s.lr_warmup_fraction is not None:
            warmup = s.lr_warmup_fraction * decay
            warmup_key = (f"schedule.lr_warmup_fraction={s.lr_warmup_fraction} "
                          f"({_samples(warmup)} of {decay})")
        else:
            warmup = s.lr_warmup_samples or 0
            warmup_key = f"schedule.lr_warmup_samples={s.lr_warmup_samples}"
        if warmup >= decay:  # Megatron asserts lr_warmup_steps < lr_decay_steps for every style
            raise ValueError(f"{warmup_key} is not below {decay_key}: warmup must end before the "
                             "decay span does. Fix: shorten the warmup or lengthen the decay "
                             "samples.")
        if s.lr_warmup_init != 0 and warmup == 0:
            raise ValueError(f"schedule.lr_warmup_init={s.lr_warmup_init} is set but there is no "
                             f"warmup ({warmup_key}): nothing would read it. Fix: set "
                             "schedule.lr_warmup_samples or lr_warmup_fraction, or "
                             "schedule.lr_warmup_init=0.")
        wsd = s.lr_wsd_decay_samples
        if s.lr_decay_style is WSD and wsd > decay - warmup:
            raise ValueError(
                f"schedule.lr_wsd_decay_samples={wsd} does not fit between the end of warmup "
                f"({warmup_key}) and {decay_key}: at most {decay - warmup:g} samples are left. "
                "Fix: shorten the anneal or the warmup, or lengthen the decay samples.")
        return cls(s.lr_decay_style, s.lr, s.min_lr, s.lr_warmup_init, warmup, decay, wsd,
                   s.lr_wsd_decay_style or WsdDecayStyle.exponential)

    def lr(self, consumed_samples: int) -> float:
        """Megatron's get_lr() once consumed_samples have been consumed: the lr of the step
        that consumes the next ones. The operations are Megatron's, in its order, so the
        floats agree to the last bit."""
        n = consumed_samples
        if n < 0:
            raise ValueError(f"consumed_samples={n} is negative")
        warmup, decay, top, bottom = (self.warmup_samples, self.decay_samples, self.max_lr,
                                      self.min_lr)
        if warmup > 0 and n <= warmup:
            return self.init_lr + (top - self.init_lr) * float(n) / float(warmup)
        if self.style is LrDecayStyle.constant:
            return top
        if n > decay:
            return bottom
        if self.style is INVERSE_SQRT:
            # Continuous at the end of warmup (= lr there), then 1/sqrt(samples) to the floor.
            return max(bottom, top * max(warmup, 1) ** 0.5 / (max(n, 1) ** 0.5))
        if self.style is WSD:
            coeff = self._anneal(n)
        else:
            ratio = float(n - warmup) / float(decay - warmup)
            coeff = 1.0 - ratio if self.style is LrDecayStyle.linear else _half_cosine(ratio)
        return bottom + coeff * (top - bottom)

    def _anneal(self, n: int) -> float:
        """WSD's share of lr - min_lr: 1 in the stable phase, then down to 0 by wsd_style."""
        start = self.decay_samples - self.wsd_decay_samples
        if n <= start:
            return 1.0
        r = float(n - start) / float(self.wsd_decay_samples)
        style = self.wsd_style
        if style is WsdDecayStyle.linear:
            return 1.0 - r
        if style is WsdDecayStyle.cosine:
            return _half_cosine(r)
        if style is WsdDecayStyle.exponential:
            return 2.0 * math.pow(0.5, r) - 1.0
        return 1.0 - math.sqrt(r)  # minus_sqrt

    def describe(self) -> str:
        """One line for the start line, e.g. 'cosine: lr 0.001, warmup 1,024 samples, decay to
        0.0001 at 16,384 samples'."""
        head = f"{self.style.value}: lr {self.max_lr:g}, warmup {_samples(self.warmup_samples)}"
        if self.init_lr:
            head += f" from {self.init_lr:g}"
        if self.style is LrDecayStyle.constant:
            return f"{head}, then constant"
        if self.style is INVERSE_SQRT:
            return (f"{head}, then falls as 1/sqrt(samples) from "
                    f"{_samples(max(self.warmup_samples, 1))}, floor {self.min_lr:g}, "
                    f"{self.min_lr:g} after {_samples(self.decay_samples)}")
        if self.style is WSD:
            stable_end = self.decay_samples - self.wsd_decay_samples
            head += f", stable to {_samples(stable_end)}, {self.wsd_style.value} anneal"
        else:
            head += ", decay"
        return f"{head} to {self.min_lr:g} at {_samples(self.decay_samples)}"


def _half_cosine(ratio: float) -> float:
    return 0.5 * (math.cos(math.pi * ratio) + 1.0)


@dataclass(frozen=True)
class WeightDecaySchedule:
    """Megatron's get_wd(): weight decay from start to end over train.train_samples."""

    style: WeightDecayIncrStyle
    start: float
    end: float
    incr_samples: int  # train.train_samples, as Megatron's sample-based wd_incr_steps

    @classmethod
    def from_config(cls, optim: OptimConfig, train_samples: int) -> WeightDecaySchedule:
        style, start, end = (optim.weight_decay_incr_style, optim.start_weight_decay,
                             optim.end_weight_decay)
        keys = (f"optim.start_weight_decay={start}, optim.end_weight_decay={end}, "
                f"optim.weight_decay_incr_style={style.value}")
        if style is WeightDecayIncrStyle.constant:
            if start is not None or end is not None:
                raise ValueError(f"{keys}: a constant weight decay is optim.weight_decay, so "
                                 "start and end would be ignored. Fix: set both to null, or "
                                 "optim.weight_decay_incr_style=linear (or cosine).")
            return cls(style, optim.weight_decay, optim.weight_decay, train_samples)
        if start is None or end is None:
            raise ValueError(f"{keys}: an increasing weight decay needs both ends. Fix: set "
                             "optim.start_weight_decay and optim.end_weight_decay (e.g. 0.0 "
                             "and 0.1), or optim.weight_decay_incr_style=constant.")
        for key, value in (("start_weight_decay", start), ("end_weight_decay", end)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"optim.{key}={value} must be a finite number >= 0. Fix: use "
                                 "e.g. 0.1, or 0 for none.")
        if end < start:  # Megatron asserts end_wd >= start_wd: the decay only increases
            raise ValueError(f"optim.end_weight_decay={end} is below optim.start_weight_decay="
                             f"{start}: Megatron's weight decay schedule only increases. Fix: "
                             "set optim.end_weight_decay >= optim.start_weight_decay.")
        return cls(style, start, end, train_samples)

    def weight_decay(self, consumed_samples: int) -> float:
        """Megatron's get_wd() once consumed_samples have been consumed."""
        if consumed_samples > self.incr_samples or self.style is WeightDecayIncrStyle.constant:
            return self.end
        ratio = float(consumed_samples) / float(self.incr_samples)
        coeff = (ratio if self.style is WeightDecayIncrStyle.linear
                 else _half_cosine(1 - ratio))
        return self.start + coeff * (self.end - self.start)

    def describe(self) -> str:
        if self.style is WeightDecayIncrStyle.constant:
            return f"weight decay {self.end:g}"
        return (f"weight decay {self.start:g} to {self.end:g} ({self.style.value}) over "
                f"{_samples(self.incr_samples)}")


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
    if not (math.isfinite(s.lr_warmup_init) and 0 <= s.lr_warmup_init <= s.lr):
        raise ValueError(f"schedule.lr_warmup_init={s.lr_warmup_init} must be a finite number in "
                         f"[0, schedule.lr={s.lr}]: warmup rises from it to schedule.lr. Fix: "
                         "use e.g. 0 (Megatron's default).")
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
    if (s.lr_decay_style is LrDecayStyle.constant and s.lr_decay_samples is not None
            and s.lr_warmup_fraction is None):
        raise ValueError(f"schedule.lr_decay_samples={s.lr_decay_samples} is set but "
                         "schedule.lr_decay_style=constant never decays and no "
                         "lr_warmup_fraction is taken of it: nothing would read it. Fix: set "
                         "it to null, or pick a decaying schedule.lr_decay_style.")
    _check_wsd(s)


def _check_wsd(s: ScheduleConfig) -> None:
    wsd, style, shape = s.lr_wsd_decay_samples, s.lr_decay_style, s.lr_wsd_decay_style
    if style is WSD and wsd is None:
        raise ValueError("schedule.lr_wsd_decay_samples=null with schedule.lr_decay_style=WSD: "
                         "WSD needs the length of its final anneal. Fix: set "
                         "schedule.lr_wsd_decay_samples (e.g. a tenth of the decay samples).")
    if style is WSD and wsd < 1:
        raise ValueError(f"schedule.lr_wsd_decay_samples={wsd} is below 1: the anneal needs at "
                         "least one sample. Fix: set schedule.lr_wsd_decay_samples >= 1.")
    for key, value in (("lr_wsd_decay_samples", wsd),
                       ("lr_wsd_decay_style", shape and shape.value)):
        if style is not WSD and value is not None:
            raise ValueError(f"schedule.{key}={value} is set but schedule.lr_decay_style="
                             f"{style.value}: only WSD reads it, so it would be silently "
                             "ignored. Fix: set it to null, or use lr_decay_style=WSD.")
