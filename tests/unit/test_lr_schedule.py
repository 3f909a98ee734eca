"""LrSchedule and WeightDecaySchedule against Megatron-Core's own OptimizerParamScheduler
(megatron-core, installed by the test extra: test tooling, never imported at run time), step by
step, for every decay style, WSD anneal style, warmup init, warmup fraction and samples, and
every weight decay style; then the few values worth stating by hand, and every validation rule
with its message.

Megatron's sample-based training hands its scheduler samples where it says steps (training.py
get_optimizer_param_scheduler: lr_warmup_steps = lr_warmup_fraction x lr_decay_samples, not
rounded, or lr_warmup_samples; lr_decay_steps = lr_decay_samples or train_samples;
wd_incr_steps = train_samples), builds it at 0 (its __init__ calls step(0)) and steps it by the
global batch after each update. So the n-th update trains at its values for the samples consumed
before it; `megatron_run` replays exactly that."""
from __future__ import annotations

import itertools
import math
import warnings
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from trainer.config import (
    LrDecayStyle,
    OptimConfig,
    ScheduleConfig,
    WeightDecayIncrStyle,
    WsdDecayStyle,
)
from trainer.plan.lr_schedule import LrSchedule, WeightDecaySchedule

from config_helpers import compose_config

with warnings.catch_warnings():  # megatron-core says once that TE and Apex are missing
    warnings.simplefilter("ignore")
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

LR, MIN_LR, WARMUP, DECAY, TRAIN = 1e-3, 1e-4, 100, 1000, 1200
WSD = 200  # anneal from 800 to 1000
MEGATRON_STYLES = ["constant", "linear", "cosine", "inverse-square-root", "WSD"]


def config(style: str = "cosine", **overrides) -> ScheduleConfig:
    values = dict(lr_decay_style=LrDecayStyle[style], lr=LR, min_lr=MIN_LR, lr_warmup_init=0.0,
                  lr_warmup_samples=WARMUP, lr_warmup_fraction=None, lr_decay_samples=DECAY,
                  lr_wsd_decay_samples=WSD if LrDecayStyle[style] is LrDecayStyle.WSD else None,
                  lr_wsd_decay_style=None)
    return ScheduleConfig(**{**values, **overrides})


def schedule(style: str = "cosine", train_samples: int = TRAIN, **overrides) -> LrSchedule:
    return LrSchedule.from_config(config(style, **overrides), train_samples)


def optim(style: str = "constant", start=None, end=None, weight_decay=0.1) -> OptimConfig:
    return OptimConfig(name="adamw", weight_decay=weight_decay, start_weight_decay=start,
                       end_weight_decay=end, weight_decay_incr_style=WeightDecayIncrStyle(style),
                       beta1=0.9, beta2=0.95, eps=1e-8, clip_grad=None)


def megatron_run(cfg: ScheduleConfig, wd: OptimConfig, train_samples: int, batches) -> list:
    """(lr, weight decay) of each update of Megatron's sample-based run, from its scheduler."""
    decay = cfg.lr_decay_samples if cfg.lr_decay_samples is not None else train_samples
    warmup = (cfg.lr_warmup_fraction * decay if cfg.lr_warmup_fraction is not None
              else cfg.lr_warmup_samples or 0)
    constant = wd.weight_decay_incr_style is WeightDecayIncrStyle.constant
    optimizer = SimpleNamespace(param_groups=[{}])
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=cfg.lr_warmup_init, max_lr=cfg.lr, min_lr=cfg.min_lr,
        lr_warmup_steps=warmup, lr_decay_steps=decay, lr_decay_style=cfg.lr_decay_style.value,
        start_wd=wd.weight_decay if constant else wd.start_weight_decay,
        end_wd=wd.weight_decay if constant else wd.end_weight_decay,
        wd_incr_steps=train_samples, wd_incr_style=wd.weight_decay_incr_style.value,
        wsd_decay_steps=cfg.lr_wsd_decay_samples,
        lr_wsd_decay_style=(cfg.lr_wsd_decay_style or WsdDecayStyle.exponential).value)
    values = []
    for batch in batches:
        group = optimizer.param_groups[0]
        values.append((group["lr"], group["weight_decay"]))
        scheduler.step(increment=batch)  # after the update, as Megatron's train_step does
    return values


def ours(cfg: ScheduleConfig, wd: OptimConfig, train_samples: int, batches) -> list:
    lr = LrSchedule.from_config(cfg, train_samples)
    decay = WeightDecaySchedule.from_config(wd, train_samples)
    consumed = [sum(batches[:i]) for i in range(len(batches))]
    return [(lr.lr(c), decay.weight_decay(c)) for c in consumed]


def assert_same(got: list, expected: list) -> None:
    assert len(got) == len(expected)
    for step, (a, b) in enumerate(zip(got, expected)):
        assert a == pytest.approx(b, rel=1e-12, abs=0), f"step {step + 1}: {a} != {b}"


# Global batches of whole runs past the decay end: constant, odd (steps land between warmup and
# anneal boundaries) and ramping (8, 8, ..., 16, ... as a batch ramp-up gives them).
BATCHES = {"gbs 8": [8] * 160, "gbs 7": [7] * 180, "ramp": [8] * 20 + [16] * 20 + [32] * 30}
WARMUPS = {"no warmup": dict(lr_warmup_samples=0),
           "samples 100": dict(lr_warmup_samples=100),
           "samples 100 from init": dict(lr_warmup_samples=100, lr_warmup_init=2e-4),
           "fraction 0.0625": dict(lr_warmup_samples=None, lr_warmup_fraction=0.0625),
           "fraction 0.0123": dict(lr_warmup_samples=None, lr_warmup_fraction=0.0123),
           "fraction 0.29 of 100": dict(lr_warmup_samples=None, lr_warmup_fraction=0.29,
                                        lr_decay_samples=100)}
STYLE_CASES = [(style, None) for style in MEGATRON_STYLES if style != "WSD"] + [
    ("WSD", anneal) for anneal in WsdDecayStyle]


@pytest.mark.parametrize("style,anneal", STYLE_CASES,
                         ids=[f"{s}-{a.value}" if a else s for s, a in STYLE_CASES])
@pytest.mark.parametrize("warmup", WARMUPS, ids=list(WARMUPS))
@pytest.mark.parametrize("batches", BATCHES, ids=list(BATCHES))
def test_lr_equals_megatron_step_by_step(style, anneal, warmup, batches):
    overrides = dict(WARMUPS[warmup])
    if style == "WSD":
        decay = overrides.get("lr_decay_samples", DECAY)
        overrides.update(lr_wsd_decay_style=anneal, lr_wsd_decay_samples=decay // 5)
    if style == "constant" and "lr_warmup_fraction" not in overrides:
        overrides["lr_decay_samples"] = None  # nothing reads it (refused), train_samples instead
    cfg = config(style, **overrides)
    runs = BATCHES[batches]
    total = sum(runs)
    got, expected = ours(cfg, optim(), total, runs), megatron_run(cfg, optim(), total, runs)
    assert_same(got, expected)
    assert got[0][0] == (cfg.lr_warmup_init if overrides.get("lr_warmup_samples", 1) != 0
                         or overrides.get("lr_warmup_fraction") else LR)


@pytest.mark.parametrize("style,start,end", [("constant", None, None), ("linear", 0.0, 0.1),
                                             ("cosine", 0.01, 0.2), ("linear", 0.05, 0.05)])
@pytest.mark.parametrize("batches", BATCHES, ids=list(BATCHES))
def test_weight_decay_equals_megatron_step_by_step(style, start, end, batches):
    runs = BATCHES[batches]
    total = sum(runs[:len(runs) * 3 // 4])  # a resumed run may go past wd_incr_steps: cover it
    wd = optim(style, start, end)
    got, expected = ours(config(), wd, total, runs), megatron_run(config(), wd, total, runs)
    assert_same(got, expected)
    if style != "constant":
        assert got[0][1] == start and got[-1][1] == end


def test_megatron_spellings_and_aliases_name_the_same_styles():
    assert LrDecayStyle["inverse_sqrt"] is LrDecayStyle["inverse-square-root"]
    assert LrDecayStyle["wsd"] is LrDecayStyle["WSD"] is LrDecayStyle("WSD")
    assert [s.value for s in LrDecayStyle] == MEGATRON_STYLES
    for spelling in ("inverse_sqrt", "inverse-square-root", "wsd", "WSD"):
        composed = compose_config(f"schedule.lr_decay_style={spelling}")
        assert OmegaConf.to_object(composed.schedule).lr_decay_style is LrDecayStyle[spelling]


# ------------------------------------------------------------- values worth stating by hand

@pytest.mark.parametrize("style,expected", [
    # consumed:  0   50 (mid-warmup)  100 (end)  550 (r=0.5)  1000 (end)  1001 (past)
    ("constant", [0.0, LR / 2, LR, LR, LR, LR]),
    ("linear", [0.0, LR / 2, LR, LR - (LR - MIN_LR) * 0.5, MIN_LR, MIN_LR]),
    ("cosine", [0.0, LR / 2, LR, MIN_LR + (LR - MIN_LR) * 0.5, MIN_LR, MIN_LR]),
    ("WSD", [0.0, LR / 2, LR, LR, MIN_LR, MIN_LR]),  # 550 is still in the stable phase
    # Megatron's inverse square root ends at min_lr past the decay samples.
    ("inverse-square-root", [0.0, LR / 2, LR, LR * math.sqrt(100 / 550),
                             LR * math.sqrt(100 / 1000), MIN_LR]),
])
def test_key_points(style, expected):
    s = schedule(style, lr_wsd_decay_style=WsdDecayStyle.linear if style == "WSD" else None,
                 **({"lr_decay_samples": None, "lr_warmup_fraction": None} if style == "constant"
                    else {}), train_samples=DECAY if style == "constant" else TRAIN)
    got = [s.lr(c) for c in (0, 50, WARMUP, 550, DECAY, DECAY + 1)]
    assert got == pytest.approx(expected, rel=1e-12, abs=0)


def test_wsd_anneal_shapes_at_their_midpoint():
    start, span = DECAY - WSD, LR - MIN_LR
    for shape, share in [(WsdDecayStyle.linear, 0.5), (WsdDecayStyle.cosine, 0.5),
                         (WsdDecayStyle.exponential, math.sqrt(2) - 1),
                         (WsdDecayStyle.minus_sqrt, 1 - math.sqrt(0.5))]:
        s = schedule("WSD", lr_wsd_decay_style=shape)
        assert s.lr(start) == LR and s.lr(DECAY) == pytest.approx(MIN_LR, rel=1e-12)
        assert s.lr(start + WSD // 2) == pytest.approx(MIN_LR + share * span, rel=1e-12), shape
    assert schedule("WSD").wsd_style is WsdDecayStyle.exponential  # null: Megatron's default


def test_warmup_from_a_fraction_is_not_rounded():
    s = schedule(lr_warmup_samples=None, lr_warmup_fraction=0.29, lr_decay_samples=100)
    assert s.warmup_samples == 0.29 * 100 != 29  # 28.999999999999996, as in Megatron
    assert s.lr(28) == LR * 28 / (0.29 * 100) != LR * 28 / 29


@pytest.mark.parametrize("style", MEGATRON_STYLES)
def test_warmup_rises_from_init_and_decay_never_rises(style):
    s = schedule(style, lr_warmup_init=LR / 10,
                 **({"lr_decay_samples": None} if style == "constant" else {}))
    values = [s.lr(c) for c in range(0, 3 * DECAY)]
    warmup, rest = values[:WARMUP + 1], values[WARMUP:]
    assert values[0] == LR / 10 and all(a < b for a, b in zip(warmup, warmup[1:]))
    assert all(a >= b for a, b in zip(rest, rest[1:]))
    assert min(rest) >= (LR if style == "constant" else MIN_LR)


# ------------------------------------------------------------------------------- validation

@pytest.mark.parametrize("overrides,train,keys", [
    (dict(lr=float("nan")), TRAIN, ["schedule.lr=nan"]),
    (dict(lr=float("inf")), TRAIN, ["schedule.lr=inf"]),
    (dict(lr=-1e-3), TRAIN, ["schedule.lr=-0.001"]),
    (dict(min_lr=-1e-5), TRAIN, ["schedule.min_lr=-1e-05"]),
    (dict(min_lr=2e-3), TRAIN, ["schedule.min_lr=0.002", "schedule.lr=0.001"]),
    (dict(lr_warmup_init=2e-3), TRAIN, ["schedule.lr_warmup_init=0.002", "schedule.lr=0.001"]),
    (dict(lr_warmup_init=-1.0), TRAIN, ["schedule.lr_warmup_init=-1.0"]),
    (dict(lr_warmup_init=1e-4, lr_warmup_samples=0), TRAIN,
     ["schedule.lr_warmup_init=0.0001", "no warmup"]),
    (dict(lr_warmup_fraction=0.1), TRAIN,
     ["schedule.lr_warmup_samples=100", "schedule.lr_warmup_fraction=0.1"]),
    (dict(lr_warmup_samples=None, lr_warmup_fraction=1.0), TRAIN,
     ["schedule.lr_warmup_fraction=1.0", "[0, 1)"]),
    (dict(lr_warmup_samples=None, lr_warmup_fraction=-0.1), TRAIN,
     ["schedule.lr_warmup_fraction=-0.1"]),
    (dict(lr_warmup_samples=-1), TRAIN, ["schedule.lr_warmup_samples=-1"]),
    (dict(lr_decay_samples=0), TRAIN, ["schedule.lr_decay_samples=0"]),
    (dict(lr_decay_samples=None), 0,
     ["schedule.lr_decay_samples=null", "train.train_samples=0"]),
    (dict(lr_warmup_samples=5000, lr_decay_samples=4000), TRAIN,
     ["schedule.lr_warmup_samples=5000", "schedule.lr_decay_samples=4000", "not below"]),
    (dict(lr_warmup_samples=DECAY), TRAIN, ["schedule.lr_warmup_samples=1000", "not below"]),
    (dict(lr_wsd_decay_samples=100), TRAIN,
     ["schedule.lr_wsd_decay_samples=100", "schedule.lr_decay_style=cosine"]),
    (dict(lr_wsd_decay_style=WsdDecayStyle.cosine), TRAIN,
     ["schedule.lr_wsd_decay_style=cosine", "schedule.lr_decay_style=cosine"]),
])
def test_validation_names_the_keys(overrides, train, keys):
    with pytest.raises(ValueError) as err:
        schedule("cosine", train_samples=train, **overrides)
    assert all(key in str(err.value) for key in keys), str(err.value)
    assert "Fix:" in str(err.value)


@pytest.mark.parametrize("style,overrides,keys", [
    ("constant", dict(lr_decay_samples=None, lr_warmup_samples=TRAIN),
     ["schedule.lr_warmup_samples=1200", "not below"]),
    ("constant", dict(), ["schedule.lr_decay_samples=1000", "constant"]),
    ("inverse_sqrt", dict(lr_warmup_samples=DECAY + 1), ["schedule.lr_warmup_samples=1001"]),
    ("WSD", dict(lr_wsd_decay_samples=None), ["schedule.lr_wsd_decay_samples=null"]),
    ("WSD", dict(lr_wsd_decay_samples=0), ["schedule.lr_wsd_decay_samples=0"]),
    ("WSD", dict(lr_wsd_decay_samples=DECAY - WARMUP + 1),
     ["schedule.lr_wsd_decay_samples=901", "schedule.lr_warmup_samples=100",
      "schedule.lr_decay_samples=1000", "at most 900"]),
    ("WSD", dict(lr_warmup_samples=None, lr_warmup_fraction=0.5, lr_wsd_decay_samples=501),
     ["schedule.lr_wsd_decay_samples=501", "schedule.lr_warmup_fraction=0.5 (500 samples"]),
])
def test_style_specific_validation(style, overrides, keys):
    with pytest.raises(ValueError) as err:
        schedule(style, **overrides)
    assert all(key in str(err.value) for key in keys), str(err.value)


@pytest.mark.parametrize("style,start,end,keys", [
    ("constant", 0.0, None, ["optim.start_weight_decay=0.0", "ignored"]),
    ("linear", None, 0.1, ["optim.start_weight_decay=None", "both ends"]),
    ("cosine", 0.2, 0.1, ["optim.end_weight_decay=0.1", "below", "start_weight_decay=0.2"]),
    ("linear", -0.1, 0.1, ["optim.start_weight_decay=-0.1"]),
    ("linear", 0.0, float("nan"), ["optim.end_weight_decay=nan"]),
])
def test_weight_decay_validation(style, start, end, keys):
    with pytest.raises(ValueError) as err:
        WeightDecaySchedule.from_config(optim(style, start, end), TRAIN)
    assert all(key in str(err.value) for key in keys), str(err.value)
    assert "Fix:" in str(err.value)


def test_negative_consumed_samples_is_an_error():
    with pytest.raises(ValueError, match="consumed_samples=-1"):
        schedule().lr(-1)


@pytest.mark.parametrize("style,line", [
    ("constant", "constant: lr 0.001, warmup 100 samples, then constant"),
    ("linear", "linear: lr 0.001, warmup 100 samples, decay to 0.0001 at 1,000 samples"),
    ("cosine", "cosine: lr 0.001, warmup 100 samples, decay to 0.0001 at 1,000 samples"),
    ("WSD", "WSD: lr 0.001, warmup 100 samples, stable to 800 samples, exponential anneal to "
            "0.0001 at 1,000 samples"),
    ("inverse_sqrt", "inverse-square-root: lr 0.001, warmup 100 samples, then falls as "
                     "1/sqrt(samples) from 100 samples, floor 0.0001, 0.0001 after 1,000 "
                     "samples"),
])
def test_describe(style, line):
    extra = {"lr_decay_samples": None} if style == "constant" else {}
    assert schedule(style, **extra).describe() == line


def test_describe_weight_decay():
    assert WeightDecaySchedule.from_config(optim(), TRAIN).describe() == "weight decay 0.1"
    assert (WeightDecaySchedule.from_config(optim("cosine", 0.0, 0.1), TRAIN).describe()
            == "weight decay 0 to 0.1 (cosine) over 1,200 samples")


@pytest.mark.parametrize("preset", ["cosine", "wsd"])
def test_shipped_presets_build(preset):
    cfg = compose_config(f"schedule={preset}")
    s = LrSchedule.from_config(OmegaConf.to_object(cfg.schedule), cfg.train.train_samples)
    assert (s.warmup_samples, s.decay_samples) == (1024, cfg.train.train_samples)
    assert s.lr(s.decay_samples) == pytest.approx(s.min_lr, rel=1e-12)


def test_every_megatron_style_is_covered_by_the_oracle_grid():
    """The grid above runs every style and anneal: a style added to the enum must join it."""
    covered = {LrDecayStyle[s] for s, _ in STYLE_CASES}
    assert covered == set(LrDecayStyle)
    assert {a for _, a in STYLE_CASES if a} == set(WsdDecayStyle)
    assert len(list(itertools.product(STYLE_CASES, WARMUPS, BATCHES))) == 8 * 6 * 3
