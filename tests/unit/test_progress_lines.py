"""A slow first step says when the next progress line comes (MetricsLogger.first_step): with
logger.log_interval steps between lines, a person would otherwise watch a silent console."""
from __future__ import annotations

from trainer.config import LoggerConfig, LoggerName
from trainer.train.metrics import MetricsLogger


def logger(tmp_path, interval: int, total_steps: int = 1000) -> MetricsLogger:
    cfg = LoggerConfig(name=LoggerName.console, log_interval=interval, project=None,
                       sample_prompts=None, sample_max_new_tokens=0)
    return MetricsLogger(tmp_path, cfg, True, total_steps, (0, 8 * total_steps))


def test_a_slow_first_step_says_when_the_next_progress_line_comes(tmp_path, capsys):
    logger(tmp_path, 64).first_step(1, 7.0)  # 63 steps more at 7 s: 441 s
    logger(tmp_path, 64).first_step(101, 7.0)  # a resumed start: the next line at 128
    logger(tmp_path, 64, total_steps=110).first_step(101, 7.0)  # the last step logs too
    assert capsys.readouterr().out.splitlines() == [
        "step 1 took 7.0 s; progress lines come every 64 steps (logger.log_interval), the next "
        "at step 64, in about 7m21s at this pace",
        "step 101 took 7.0 s; progress lines come every 64 steps (logger.log_interval), the "
        "next at step 128, in about 3m09s at this pace",
        "step 101 took 7.0 s; progress lines come every 64 steps (logger.log_interval), the "
        "next at step 110, in about 1m03s at this pace"]


def test_a_quick_or_logged_first_step_says_nothing_more(tmp_path, capsys):
    logger(tmp_path, 64).first_step(1, 2.0)  # quick: its line comes soon enough
    logger(tmp_path, 1).first_step(1, 30.0)  # logged now
    logger(tmp_path, 64).first_step(64, 30.0)  # logged now
    logger(tmp_path, 64, total_steps=1).first_step(1, 30.0)  # the last step: logged
    assert capsys.readouterr().out == ""
