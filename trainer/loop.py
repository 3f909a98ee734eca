"""The training loop of one rank: data, schedule, steps, evaluation, checkpoints, logging.

Every rank runs it with the same typed config; the default process group must already exist.
Counts are samples: step s trains on samples [s x GBS, (s+1) x GBS) of the shuffled stream, and
the learning rate is the schedule's value at the samples consumed by the end of the step.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from parallel.layout import Layout
from trainer import checkpoint
from trainer.accounting import RunPlan
from trainer.batch import rank_micro_batches
from trainer.config import Config
from trainer.data import SampleStream, TokenDataset, builtin_corpus
from trainer.engine import Engine, build_engine
from trainer.metrics import MetricsLogger
from trainer.preemption import PreemptionWatch
from trainer.schedule import LrSchedule
from trainer.step import evaluate, train_step


def dataset_path(settings: Config) -> Path:
    """The prepared dataset: data.path, or the built-in corpus (prepared on first use)."""
    data = settings.data
    if data.path is not None:
        return Path(data.path)
    if data.tokenizer != "byte":
        raise ValueError(f"data.tokenizer={data.tokenizer!r}: the built-in corpus is prepared "
                         f"with the byte tokenizer. Fix: set data.tokenizer=byte, or data.path.")
    cache = Path(data.cache_dir) if data.cache_dir is not None else None
    return builtin_corpus(cache, data.valid_fraction)


def open_streams(settings: Config, plan: RunPlan) -> tuple[SampleStream, SampleStream | None]:
    dataset = TokenDataset.open(dataset_path(settings))
    if dataset.vocab_size > settings.model.vocab_size:
        raise ValueError(
            f"the dataset {dataset.path} has a vocabulary of {dataset.vocab_size} tokens but "
            f"model.vocab_size={settings.model.vocab_size}. Fix: raise model.vocab_size.")
    seq, seed = settings.train.seq_length, settings.data.seed
    train = SampleStream(dataset, "train", seq, seed, shuffle=True)
    valid = SampleStream(dataset, "valid", seq, seed, shuffle=False) if plan.eval_interval else None
    return train, valid


def resume(engine: Engine, path: Path, stream: SampleStream) -> checkpoint.TrainState:
    state = checkpoint.load(engine, path)
    if state.data != stream.identity:
        raise ValueError(
            f"the checkpoint {path} was trained on the sample stream {state.data}, this run's "
            f"is {stream.identity}. Fix: use the same dataset, train.seq_length and data.seed, "
            f"or start from another checkpoint.dir / checkpoint.load.")
    return state


class Preempted(Exception):
    """The run stopped early on request (a checkpoint of the last step is saved)."""


class Trainer:
    """One rank's run: everything built from the config, then run() to the end."""

    def __init__(self, settings: Config, layout: Layout, run_dir: Path, device: torch.device,
                 meta: dict[str, Any] | None = None, watch: PreemptionWatch | None = None):
        self.settings, self.layout, self.device = settings, layout, device
        self.rank, self.meta, self.watch = dist.get_rank(), meta or {}, watch
        self.plan = RunPlan.from_config(settings.train, settings.checkpoint, layout)
        self.schedule = LrSchedule.from_config(settings.schedule, settings.train.train_samples)
        self.train_stream, self.valid_stream = open_streams(settings, self.plan)
        self.engine = build_engine(settings.model, settings.optim, settings.train.seed, layout,
                                   device, settings.train.precision)
        self.state = checkpoint.TrainState(data=self.train_stream.identity)
        ckpt = settings.checkpoint
        self.save_dir = Path(ckpt.dir) if ckpt.dir else run_dir / "checkpoints"
        load = Path(ckpt.load) if ckpt.load is not None else None
        if load is None and ckpt.resume:
            load = checkpoint.latest(self.save_dir)  # a relaunch continues where it stopped
        if load is not None:
            self.state = resume(self.engine, load, self.train_stream)
        self.logger = MetricsLogger(run_dir, settings.logger, self.rank == 0,
                                    self.plan.train_steps)

    def run(self) -> list[dict[str, Any]]:
        """Collective. Returns the records this rank computed (every rank computes the same)."""
        plan, state, layout, logger = self.plan, self.state, self.layout, self.logger
        logger.note(f"{layout.world_size} rank(s), global batch {plan.global_batch_size} "
                    f"samples, {plan.train_steps} steps from step {state.step}; "
                    f"{self.schedule.describe()}")
        gbs, tokens_per_step = plan.global_batch_size, plan.global_batch_size * layout.seq_length
        records = []
        if state.step >= plan.train_steps:
            logger.note(f"nothing to train: the checkpoint is at step {state.step} of "
                        f"{plan.train_steps}")
        while state.step < plan.train_steps:
            started, consumed = time.perf_counter(), state.consumed_samples
            micro_batches = rank_micro_batches(
                lambda idx: self.train_stream.get([consumed + i for i in idx]), layout,
                self.rank, self.device)
            lr = self.schedule.lr(consumed + gbs)
            self.engine.groups.stats.reset()
            result = train_step(self.engine.model, self.engine.optimizer, micro_batches, lr)
            state.step, state.consumed_samples = state.step + 1, consumed + gbs
            record = {"consumed_samples": state.consumed_samples, "loss": result.loss, "lr": lr,
                      "grad_norm": result.grad_norm,
                      "tokens_per_s": tokens_per_step / (time.perf_counter() - started),
                      "comm_bytes": self.engine.groups.stats.by_op()}  # this rank, this step
            records.append({"step": state.step, **record})
            logger.log(state.step, record)
            if plan.eval_interval and (state.step % plan.eval_interval == 0
                                       or state.step == plan.train_steps):
                records.append({"step": state.step, "eval_loss": self.evaluate()})
                logger.log_eval(state.step, {"eval_loss": records[-1]["eval_loss"],
                                             "eval_samples": plan.eval_layout.global_batch_size})
            interval = self.settings.checkpoint.save_interval
            saved = (interval and state.step % interval == 0) or state.step == plan.train_steps
            if saved:
                logger.note(f"saved {checkpoint.save(self.engine, state, self.save_dir, self.meta)}")
            if state.step < plan.train_steps and self.stop_requested():
                path = (self.save_dir / f"{checkpoint.PREFIX}{state.step:08d}" if saved
                        else checkpoint.save(self.engine, state, self.save_dir, self.meta))
                logger.note(f"preempted at step {state.step}: saved {path}; run the same "
                            f"command again to resume")
                logger.close()
                raise Preempted(state.step)
        logger.close()
        return records

    def stop_requested(self) -> bool:
        """Whether any rank got the preemption signal: every rank must stop at the same step."""
        if self.watch is None:
            return False
        flag = torch.tensor([float(self.watch.requested)], device=self.device)
        self.engine.groups.world.all_reduce(flag, dist.ReduceOp.MAX)
        return bool(flag.item())

    def evaluate(self) -> float:
        """The same first eval_samples of the validation split every time, so evals compare."""
        micro_batches = rank_micro_batches(self.valid_stream.get, self.plan.eval_layout,
                                           self.rank, self.device)
        return evaluate(self.engine.model, micro_batches)


def train(settings: Config, layout: Layout, run_dir: Path, device: torch.device,
          meta: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Collective: build this rank's trainer and run it."""
    return Trainer(settings, layout, run_dir, device, meta).run()
