"""LrSchedule: each style's value at its key points (from the formulas), monotonicity, continuity
at the phase boundaries, every validation rule with its message, and that the lr depends on
consumed samples only (the same under any global batch size, hence any layout)."""
from __future__ import annotations

import math

import pytest
from omegaconf import OmegaConf

from trainer.config import LrDecayStyle, ScheduleConfig
from trainer.plan.schedule import LrSchedule

from config_helpers import compose_config

LR, MIN_LR, WARMUP, DECAY, TRAIN = 1e-3, 1e-4, 100, 1000, 1200
WSD = 200  # anneal from 800 to 1000


def config(style: str = "cosine", **overrides) -> ScheduleConfig:
    values = dict(lr_decay_style=LrDecayStyle(style), lr=LR, min_lr=MIN_LR,
                  lr_warmup_samples=WARMUP, lr_warmup_fraction=None, lr_decay_samples=DECAY,
                  lr_wsd_decay_samples=WSD if style == "wsd" else None)
    return ScheduleConfig(**{**values, **overrides})


def schedule(style: str = "cosine", train_samples: int = TRAIN, **overrides) -> LrSchedule:
    return LrSchedule.from_config(config(style, **overrides), train_samples)


ALL_STYLES = [style.value for style in LrDecayStyle]
MID_DECAY = 550  # r = (550 - 100) / 900 = 0.5


@pytest.mark.parametrize("style,expected", [
    # consumed:      0    50 (mid-warmup)  100 (end)  550 (r=0.5)  1000 (end)  1100 (past)
    ("constant", [0.0, LR / 2, LR, LR, LR, LR]),
    ("linear", [0.0, LR / 2, LR, LR - (LR - MIN_LR) * 0.5, MIN_LR, MIN_LR]),
    ("cosine", [0.0, LR / 2, LR, MIN_LR + (LR - MIN_LR) * 0.5, MIN_LR, MIN_LR]),
    ("wsd", [0.0, LR / 2, LR, LR, MIN_LR, MIN_LR]),  # 550 is still in the stable phase
    ("inverse_sqrt", [0.0, LR / 2, LR, LR * math.sqrt(100 / 550), LR * math.sqrt(100 / 1000),
                      max(LR * math.sqrt(100 / 1100), MIN_LR)]),
])
def test_key_points(style, expected):
    s = schedule(style)
    got = [s.lr(c) for c in (0, 50, WARMUP, MID_DECAY, DECAY, DECAY + 100)]
    assert got == pytest.approx(expected, rel=1e-12, abs=0)


@pytest.mark.parametrize("consumed,r", [(100, 0.0), (325, 0.25), (775, 0.75), (999, 899 / 900)])
def test_cosine_and_linear_follow_their_formulas(consumed, r):
    assert schedule("cosine").lr(consumed) == pytest.approx(
        MIN_LR + (LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * r)), rel=1e-12)
    assert schedule("linear").lr(consumed) == pytest.approx(LR - (LR - MIN_LR) * r, rel=1e-12)


def test_wsd_is_stable_then_anneals_linearly():
    s = schedule("wsd")
    assert s.lr(800) == LR  # the anneal starts at decay - wsd_decay = 800
    assert s.lr(850) == pytest.approx(LR - (LR - MIN_LR) * 0.25, rel=1e-12)
    assert s.lr(900) == pytest.approx((LR + MIN_LR) / 2, rel=1e-12)
    assert s.lr(1000) == MIN_LR


def test_wsd_anneal_may_fill_the_whole_decay_span():
    s = schedule("wsd", lr_wsd_decay_samples=DECAY - WARMUP)
    assert s.lr(WARMUP) == LR and s.lr(MID_DECAY) == pytest.approx((LR + MIN_LR) / 2, rel=1e-12)


def test_inverse_sqrt_floors_at_min_lr_and_never_ends():
    s = schedule("inverse_sqrt")
    assert s.lr(10_000) == pytest.approx(LR * math.sqrt(100 / 10_000), rel=1e-12)  # 1e-4 exactly
    assert s.lr(1_000_000) == MIN_LR and s.lr(10**12) == MIN_LR


def test_without_warmup_lr_zero_is_the_peak():
    for style in ALL_STYLES:
        assert schedule(style, lr_warmup_samples=None).lr(0) == LR, style
    assert schedule("inverse_sqrt", lr_warmup_samples=0).lr(4) == LR / 2  # sqrt(1) / sqrt(4)


def test_constant_may_warm_up_for_the_whole_span():
    s = schedule("constant", lr_warmup_samples=DECAY)
    assert s.lr(DECAY // 2) == LR / 2 and s.lr(DECAY) == LR and s.lr(10 * DECAY) == LR


@pytest.mark.parametrize("style", ALL_STYLES)
def test_warmup_rises_and_decay_never_rises(style):
    s = schedule(style)
    values = [s.lr(c) for c in range(0, 3 * DECAY)]
    warmup, rest = values[:WARMUP + 1], values[WARMUP:]
    assert all(a < b for a, b in zip(warmup, warmup[1:]))
    assert all(a >= b for a, b in zip(rest, rest[1:]))
    assert min(values[WARMUP:]) >= (LR if style == "constant" else MIN_LR)


@pytest.mark.parametrize("style", ALL_STYLES)
def test_continuous_at_the_phase_boundaries(style):
    s = schedule(style)
    # The steepest slope anywhere is the warmup's, LR / WARMUP per sample.
    step = LR / WARMUP
    for boundary in (WARMUP, DECAY - WSD, DECAY):
        assert abs(s.lr(boundary) - s.lr(boundary - 1)) <= step * (1 + 1e-9), boundary
        assert abs(s.lr(boundary + 1) - s.lr(boundary)) <= step * (1 + 1e-9), boundary
    assert s.lr(WARMUP) == LR


@pytest.mark.parametrize("fraction,decay,train,warmup", [
    (0.1, 2000, 5000, 200),  # against lr_decay_samples, not train_samples
    (0.1, None, 5000, 500),  # decay samples null = train_samples
    (0.29, 100, 100, 29),  # 0.29 x 100 is 28.999999999999996 in floats
    (0.015, 1000, 1000, 15),
    (0.0, 1000, 1000, 0),
])
def test_warmup_fraction_resolves_against_decay_samples(fraction, decay, train, warmup):
    s = schedule(lr_warmup_samples=None, lr_warmup_fraction=fraction, lr_decay_samples=decay,
                 train_samples=train)
    assert (s.warmup_samples, s.decay_samples) == (warmup, decay or train)


def test_decay_past_the_end_of_the_run_is_allowed():
    s = schedule("cosine", train_samples=600, lr_decay_samples=DECAY)
    assert s.lr(600) > MIN_LR


@pytest.mark.parametrize("style", ALL_STYLES)
def test_lr_depends_only_on_consumed_samples(style):
    """Stepping with global batch 8 or 16 (any layout) meets the same lr at common counts."""
    by_gbs = {}
    for gbs in (8, 16):
        s = schedule(style)  # a fresh object per run, as each rank/restart builds its own
        by_gbs[gbs] = {consumed: s.lr(consumed) for consumed in range(0, TRAIN + 1, gbs)}
    common = by_gbs[8].keys() & by_gbs[16].keys()
    assert len(common) == TRAIN // 16 + 1
    assert all(by_gbs[8][c] == by_gbs[16][c] for c in common)
    assert schedule(style) == schedule(style)  # frozen, compares by value
    s = schedule(style)
    assert [s.lr(c) for c in reversed(range(TRAIN))] == [s.lr(c) for c in range(TRAIN)][::-1]


@pytest.mark.parametrize("overrides,train,keys", [
    (dict(lr=float("nan")), TRAIN, ["schedule.lr=nan"]),
    (dict(lr=float("inf")), TRAIN, ["schedule.lr=inf"]),
    (dict(lr=-1e-3), TRAIN, ["schedule.lr=-0.001"]),
    (dict(min_lr=-1e-5), TRAIN, ["schedule.min_lr=-1e-05"]),
    (dict(min_lr=2e-3), TRAIN, ["schedule.min_lr=0.002", "schedule.lr=0.001"]),
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
])
def test_validation_names_the_keys(overrides, train, keys):
    with pytest.raises(ValueError) as err:
        schedule("cosine", train_samples=train, **overrides)
    assert all(key in str(err.value) for key in keys), str(err.value)
    assert "Fix:" in str(err.value)


@pytest.mark.parametrize("style,overrides,keys", [
    ("constant", dict(lr_warmup_samples=DECAY + 1), ["schedule.lr_warmup_samples=1001", "above"]),
    ("inverse_sqrt", dict(lr_warmup_samples=DECAY + 1), ["schedule.lr_warmup_samples=1001"]),
    ("linear", dict(lr_wsd_decay_samples=10), ["schedule.lr_wsd_decay_samples=10"]),
    ("wsd", dict(lr_wsd_decay_samples=None), ["schedule.lr_wsd_decay_samples=null"]),
    ("wsd", dict(lr_wsd_decay_samples=0), ["schedule.lr_wsd_decay_samples=0"]),
    ("wsd", dict(lr_wsd_decay_samples=DECAY - WARMUP + 1),
     ["schedule.lr_wsd_decay_samples=901", "schedule.lr_warmup_samples=100",
      "schedule.lr_decay_samples=1000", "at most 900"]),
    ("wsd", dict(lr_warmup_samples=None, lr_warmup_fraction=0.5, lr_wsd_decay_samples=501),
     ["schedule.lr_wsd_decay_samples=501", "schedule.lr_warmup_fraction=0.5 (500 samples"]),
])
def test_style_specific_validation(style, overrides, keys):
    with pytest.raises(ValueError) as err:
        schedule(style, **overrides)
    assert all(key in str(err.value) for key in keys), str(err.value)


def test_negative_consumed_samples_is_an_error():
    with pytest.raises(ValueError, match="consumed_samples=-1"):
        schedule().lr(-1)


@pytest.mark.parametrize("style,line", [
    ("constant", "constant: lr 0.001, warmup 100 samples, then constant"),
    ("linear", "linear: lr 0.001, warmup 100 samples, decay to 0.0001 at 1,000 samples"),
    ("cosine", "cosine: lr 0.001, warmup 100 samples, decay to 0.0001 at 1,000 samples"),
    ("wsd", "wsd: lr 0.001, warmup 100 samples, stable to 800 samples, anneal to 0.0001 at "
            "1,000 samples"),
    ("inverse_sqrt", "inverse_sqrt: lr 0.001, warmup 100 samples, then falls as 1/sqrt(samples) "
                     "from 100 samples, floor 0.0001"),
])
def test_describe(style, line):
    assert schedule(style).describe() == line


@pytest.mark.parametrize("preset", ["cosine", "wsd"])
def test_shipped_presets_build(preset):
    cfg = compose_config(f"schedule={preset}")
    s = LrSchedule.from_config(OmegaConf.to_object(cfg.schedule), cfg.train.train_samples)
    assert (s.warmup_samples, s.decay_samples) == (1024, cfg.train.train_samples)
    assert s.lr(s.decay_samples) == s.min_lr
