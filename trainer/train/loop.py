"""The training loop of one rank: data, schedule, steps, evaluation, checkpoints, logging.

Every rank runs it with the same typed config; the default process group must already exist.
Counts are samples: the step that starts at c consumed samples trains on samples [c, c + its
global batch) of the shuffled stream (the batch is the plan's at c: a ramp-up's, or the last
step's remainder), at the learning rate and weight decay of Megatron's scheduler at c.
"""
from __future__ import annotations

import functools
import signal
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from hydra.errors import CompactHydraException

from trainer.checkpoint import resume
from trainer.checkpoint.adapters import BASE, base_record, peft_record
from trainer.checkpoint.dcp import folder_of, load_weights
from trainer.checkpoint.integrity import latest, resolve, verify
from trainer.checkpoint.saver import Saver
from trainer.compose.runspec import RunSpec
from trainer.config import Config
from trainer.data.stream import open_streams
from trainer.model.lora import adapters_off
from trainer.parts.assembly import parameter_shapes
from trainer.parts.matrices import muon_names
from trainer.plan.options import EngineOptions
from trainer.train.batch import DocumentRules, rank_micro_batches
from trainer.train.compile import COMPILE_CACHE, CompileWatch, use_cache
from trainer.train.dpo import Dpo
from trainer.train.engine import build_engine, build_reference
from trainer.train.hangs import HangWatch, backend_timeout_s
from trainer.train.metrics import MetricsLogger
from trainer.train.samples import Sampler
from trainer.train.signals import PREEMPT, Interrupted, PreemptionWatch, code_of, signal_of
from trainer.train.step import NonFiniteStep, evaluate, train_step
from trainer.train.throughput import Throughput


class TrainingDiverged(CompactHydraException):
    """A non-finite loss or gradient norm stopped the run (one line, no traceback)."""


class Preempted(Exception):
    """The run stopped early on request (a checkpoint of the last step is saved)."""


class Trainer:
    """One rank's run: everything built from the config, then run() to the end."""

    def __init__(self, spec: RunSpec, run_dir: Path, device: torch.device,
                 meta: dict[str, Any] | None = None, watch: PreemptionWatch | None = None,
                 decided: resume.Decided | None = None):
        config = spec.config
        self.layout, self.device = spec.layout, device
        self.rank, self.meta, self.watch = dist.get_rank(), meta or {}, watch
        if config.peft is not None:  # which adapters the checkpoints hold, and on which base
            self.meta = {**self.meta, "peft": peft_record(config.peft),
                         BASE: base_record(config)}
        self.run_dir, self.timeout_s = run_dir, config.cluster.timeout_s
        self.plan, self.schedule, self.weight_decay = spec.plan, spec.schedule, spec.weight_decay
        self.save_interval = config.checkpoint.save_interval
        self.mtp_depths = config.model.mtp_num_layers or 0  # multi-token prediction's D
        self.train_stream, self.valid_stream = open_streams(
            spec.data, self.layout.seq_length, config.data.seed, bool(self.plan.eval_interval),
            config.data.pack)
        self.documents = DocumentRules.of(config.data)
        self.throughput = Throughput(config, self.layout, device,  # before the model is built
                                     spec.memory["per_stage"])
        self.sampler = None
        if config.logger.sample_prompts:
            self.sampler = Sampler(config.model, spec.data.tokenizer_file(),
                                   list(config.logger.sample_prompts),
                                   config.logger.sample_max_new_tokens)
        options = EngineOptions.from_config(config)
        self.compiles = CompileWatch() if options.compile_blocks else None
        if self.compiles:  # a relaunch in this folder (a resume, a restart) finds the kernels
            use_cache(run_dir / COMPILE_CACHE)
        self.engine = build_engine(config.model, config.optim, config.train.seed, self.layout,
                                   device, options, backend_timeout_s(config.cluster.timeout_s),
                                   config.peft)
        self.save_dir = resume.save_folder(config.checkpoint, run_dir)
        # launch.py checked this choice before the ranks started (and hands it over, `decided`,
        # in its own process); here every file's checksum is verified too, so a damaged newest
        # checkpoint gives way to the one before it.
        expected = resume.Expected(parameter_shapes(config.model, config.peft),
                                   self.train_stream.identity, self.plan, self.layout,
                                   config.model, muon_names(config.model, config.optim),
                                   config.peft, config.train.seed)
        self.state = resume.start_state(self.engine, config.checkpoint, self.save_dir, expected,
                                        (lambda line: print(line, flush=True))
                                        if self.rank == 0 else None, decided)
        self.dpo = self._dpo(config, device, options)
        self.saver = Saver(self.engine, self.save_dir, self.meta, config.checkpoint.async_save,
                           backend_timeout_s(config.cluster.timeout_s))
        self.total_steps = self.state.step + self.plan.steps_from(self.state.consumed_samples)
        self.logger = MetricsLogger(run_dir, config.logger, self.rank == 0, self.total_steps,
                                    (self.state.consumed_samples, self.plan.train_samples),
                                    ramp=self.plan.ramp is not None)
        self.logger.forget_after(self.state.step)  # steps logged after the checkpoint run again

    def _dpo(self, config: Config, device: torch.device, options: EngineOptions) -> Dpo | None:
        """train.objective=dpo's reference: the model with its adapters off (peft=lora), or a
        frozen copy of the weights the run started from (checkpoint.load, or the seed's)."""
        if config.train.objective != "dpo":
            return None
        if config.peft is not None:
            return Dpo(config.dpo, None, functools.partial(adapters_off, self.engine.model.module))
        reference = build_reference(config.model, config.train.seed, self.engine, device, options)
        if config.checkpoint.load is not None:  # the fine-tune's start, also on a resume
            start = resolve(Path(config.checkpoint.load), None, verify)
            load_weights(SimpleNamespace(model=reference), start)
        return Dpo(config.dpo, reference)

    def run(self, keep_records: bool = False) -> list[dict[str, Any]]:
        """Collective. Steps run until train.train_samples are consumed; the step counter only
        numbers them (a resume under another global batch size continues both). A hang watch
        runs beside (trainer.train.hangs). keep_records: return every step's record as this
        rank computed it (every rank computes the same), for tests; a run does not keep them,
        as each holds ~1.6 KiB for the rest of the run (the soak's resident set grew by it)."""
        with HangWatch(self.engine.groups.stats, self.rank, self.layout.world_size,
                       self.run_dir, self.timeout_s):
            return self._run(keep_records)

    def _run(self, keep_records: bool) -> list[dict[str, Any]]:
        plan, state, layout, logger = self.plan, self.state, self.layout, self.logger
        start = (f"{layout.world_size} rank(s), {plan.describe_batch()}, {self.total_steps} "
                 f"steps from step "
                 f"{state.step} (samples {state.consumed_samples:,} to {plan.train_samples:,}); "
                 f"{self.schedule.describe()}; {self.weight_decay.describe()}")
        if self.compiles:  # torch compiles on the first call, which CompileWatch times
            start += "; train.compile=blocks: the first step compiles the blocks"
        logger.note(start)
        for line in self.train_stream.describe_packing():
            logger.note(line)
        records, steps = [], 0  # steps: taken in this start
        if state.consumed_samples >= plan.train_samples:
            logger.note(f"nothing to train: the checkpoint has consumed {state.consumed_samples:,}"
                        f" of train.train_samples={plan.train_samples:,}")
        while state.consumed_samples < plan.train_samples:
            started, consumed = time.perf_counter(), state.consumed_samples
            step_layout = plan.step_layout(layout, consumed)  # a ramp's, or a short last step
            samples = step_layout.global_batch_size
            micro_batches = rank_micro_batches(self.train_stream, step_layout, self.rank,
                                               self.device, self.documents, consumed,
                                               self.mtp_depths)
            data_s = time.perf_counter() - started
            # Megatron's scheduler is stepped after each update: a step trains at its values
            # for the samples consumed before it (the first warmup step at lr_warmup_init).
            lr, weight_decay = self.schedule.lr(consumed), self.weight_decay.weight_decay(consumed)
            self.engine.groups.stats.reset()
            if self.compiles:
                self.compiles.start()
            try:
                result = train_step(self.engine.model, self.engine.optimizer, micro_batches, lr,
                                    weight_decay=weight_decay, dpo=self.dpo)
            except NonFiniteStep as error:
                self.finish_saves()
                logger.close()
                raise self.diverged(state.step + 1, error, lr) from None
            state.step, state.consumed_samples = state.step + 1, consumed + samples
            if self.compiles and (line := self.compiles.end(state.step)):
                logger.note(line)
            last = state.consumed_samples == plan.train_samples
            speed = self.throughput.step(samples * layout.seq_length,
                                         time.perf_counter() - started, data_s)
            record = {"consumed_samples": state.consumed_samples, "global_batch_size": samples,
                      "loss": result.loss, "lr": lr, "weight_decay": weight_decay,
                      "grad_norm": result.grad_norm, "loss_tokens": result.loss_tokens,
                      "empty_samples": result.empty_samples, **speed.as_dict(),
                      "comm_bytes": self.engine.groups.stats.by_op(),  # this rank, this step
                      **result.moe, **result.dpo,
                      # multi-token prediction, by depth (Megatron logs "mtp_1 loss", ...)
                      **{f"mtp_{d + 1}_loss": v for d, v in enumerate(result.mtp_losses)},
                      # QK-clip (Megatron logs "max attention logit")
                      **({"max_attention_logit": result.max_attention_logit}
                         if result.max_attention_logit is not None else {})}
            steps += 1
            if steps == 1:
                logger.first_step(state.step, time.perf_counter() - started)
            if keep_records:
                records.append({"step": state.step, **record})
            logger.log(state.step, record)
            if plan.eval_interval and (state.step % plan.eval_interval == 0 or last):
                eval_loss = self.evaluate()
                if keep_records:
                    records.append({"step": state.step, "eval_loss": eval_loss})
                logger.log_eval(state.step, {"eval_loss": eval_loss,
                                             "eval_samples": plan.eval_layout.global_batch_size})
                if self.sampler is not None:
                    logger.log_samples(state.step,
                                       self.sampler.sample(self.engine, self.rank, self.device))
            interval = self.save_interval
            saved = (interval and state.step % interval == 0) or last
            for line in self.saver.poll() + (self.saver.save(state) if saved else []):
                logger.note(line)
            signum = self.stop_requested() if not last else None
            if signum is not None:
                self.stop(signum, saved)
        self.finish_saves()
        if steps:
            self.report_memory()
        if self.compiles and steps:
            logger.note(self.compiles.summary())
        logger.close()
        return records

    def finish_saves(self) -> None:
        """Wait for a background save in flight (its failure raises here)."""
        for line in self.saver.wait():
            self.logger.note(line)
        self.saver.close()

    def report_memory(self) -> None:
        """Collective: each stage's state and peak beside the plan's, printed by rank 0."""
        reference = self.dpo.reference if self.dpo else None  # DPO's frozen copy, if any
        mine = torch.tensor([self.throughput.measured_bytes(self.engine, reference)],
                            dtype=torch.int64, device=self.device)
        every = self.engine.groups.world.all_gather(mine).tolist()
        for line in self.throughput.memory_table(every):
            self.logger.note(line)

    def diverged(self, step: int, error: NonFiniteStep, lr: float) -> TrainingDiverged:
        good = latest(self.save_dir, check=lambda path: verify(path, None))
        return TrainingDiverged(
            f"Training diverged at step {step}: {error} (lr {lr:.3g}). "
            f"The step was not applied and nothing of it was saved; the last good checkpoint is "
            f"{good or 'none'}. Fix: lower schedule.lr or set optim.clip_grad (add "
            f"checkpoint.load=<that checkpoint> to continue from it), or check the data.")

    def stop_requested(self) -> int | None:
        """The stop signal any rank got (the strongest, if they differ), or None. Collective:
        every rank must stop at the same step, and in the same way."""
        if self.watch is None:
            return None
        code = torch.tensor([float(code_of(self.watch.signum))], device=self.device)
        self.engine.groups.world.all_reduce(code, dist.ReduceOp.MAX)
        return signal_of(int(code.item()))

    def stop(self, signum: int, saved: bool) -> None:
        """Collective: save this step (unless it just was), then leave the loop. Preemption
        exits 0 (submitit requeues on that); an interrupt is an error the user asked for."""
        state = self.state
        for line in [] if saved else self.saver.save(state):
            self.logger.note(line)
        self.finish_saves()
        path = folder_of(self.save_dir, state.step)
        self.logger.close()
        if signum == PREEMPT:
            self.logger.note(f"preempted at step {state.step}: saved {path}; run the same "
                             f"command again to resume")
            raise Preempted(state.step)
        raise Interrupted(f"interrupted by {signal.Signals(signum).name} at step {state.step}: "
                          f"saved {path}; run the same command again to resume", signum)

    def evaluate(self) -> float:
        """The same first eval_samples of the validation split every time, so evals compare."""
        micro_batches = rank_micro_batches(self.valid_stream, self.plan.eval_layout,
                                           self.rank, self.device, self.documents)
        return evaluate(self.engine.model, micro_batches)
