"""Progress output from one rank: console lines, metrics.jsonl in the run directory, and wandb
when `logger=wandb`, TensorBoard event files in the run directory's tensorboard/ when
`logger=tensorboard` (the same numbers, each a scalar against the step). Other ranks get a logger
that writes nothing."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from trainer.config import LoggerConfig, LoggerName
from trainer.units import duration

TENSORBOARD = "tensorboard"  # the run folder's event files
SLOW_FIRST_STEP_S = 5.0  # a first step this slow, with progress lines far apart, is announced


def _step_of(line: str) -> float:
    try:
        return json.loads(line).get("step", 0)
    except ValueError:
        return float("inf")  # a line cut short by a crash mid-write: dropped


class MetricsLogger:
    """total_steps numbers the progress line; the time left is counted in samples (the steps
    of a resumed run may hold another global batch than the steps before)."""

    def __init__(self, run_dir: Path, cfg: LoggerConfig, writer: bool, total_steps: int,
                 samples: tuple[int, int], config: dict[str, Any] | None = None,
                 ramp: bool = False):
        """samples: (consumed when this run starts, train.train_samples); a resumed run times
        only its own steps. ramp: a batch ramp-up, whose step's batch each line shows."""
        self.cfg, self.writer, self.total_steps = cfg, writer, total_steps
        self.ramp = ramp
        self.first_samples, self.total_samples = samples
        self.path = run_dir / "metrics.jsonl"
        self.started = time.perf_counter()
        self.wandb = None
        if writer:
            run_dir.mkdir(parents=True, exist_ok=True)
        if writer and cfg.name is LoggerName.wandb:
            import wandb  # only the writing rank pays for the import

            self.wandb = wandb.init(project=cfg.project, dir=str(run_dir), config=config)
        self.tensorboard = None
        if writer and cfg.name is LoggerName.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(run_dir / TENSORBOARD))

    def forget_after(self, step: int) -> None:
        """Drop metrics.jsonl's rows past `step`, the step this run starts from: a run that
        crashed after its last checkpoint logged steps that the resumed run trains again, and
        each step must appear once. Rewritten to a temporary file and renamed, so a crash here
        loses nothing."""
        if not self.writer or not self.path.exists():
            return
        lines = self.path.read_text().splitlines()
        kept = [line for line in lines if _step_of(line) <= step]
        if len(kept) == len(lines):
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)
        self.note(f"metrics.jsonl: dropped {len(lines) - len(kept)} row(s) after step {step}, "
                  f"which this run trains again")

    def log(self, step: int, record: dict[str, Any]) -> None:
        """One training step: written every log_interval steps and at the last step."""
        if not self.writer or (step % self.cfg.log_interval and step != self.total_steps):
            return
        consumed = record["consumed_samples"]
        elapsed = time.perf_counter() - self.started
        left = elapsed / max(consumed - self.first_samples, 1) * (self.total_samples - consumed)
        extra = (f"aux {record['moe_aux_loss']:.2e} | imbalance {record['moe_imbalance']:.2f} | "
                 if "moe_aux_loss" in record else "")
        if record.get("moe_dropped"):  # an expert capacity dropped some of the step's pairs
            extra += f"dropped {record['moe_dropped']:.2%} | "
        if record.get("empty_samples"):  # a loss mask left samples with no counted token
            extra += f"{record['empty_samples']} sample(s) count no token | "
        if self.ramp:  # the batch changes from step to step
            extra = f"batch {record['global_batch_size']} | " + extra
        print(f"step {step:>6d}/{self.total_steps} | samples {record['consumed_samples']:>9,d} | "
              f"loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
              f"grad norm {record['grad_norm']:.3f} | {extra}{record['tokens_per_s']:>9,.0f} tok/s "
              f"| {record['tflops_per_rank']:.3g} TFLOP/s/rank (MFU {record['mfu']:.1%}) | "
              f"mem {record['peak_memory_bytes'] / 2**30:.2f} GiB | "
              f"data {record['data_wait_share']:.1%} | left {duration(left)}", flush=True)
        self._write({"step": step, **record})

    def first_step(self, step: int, seconds: float) -> None:
        """After this start's first step: when it was slow and the next progress line is more
        than a step away, say when that line comes (a person would otherwise wait
        log_interval steps on a silent console)."""
        interval = self.cfg.log_interval
        if not self.writer or seconds < SLOW_FIRST_STEP_S or step % interval == 0 \
                or step == self.total_steps:
            return
        after = min(self.total_steps, step + interval - step % interval)
        self.note(f"step {step} took {seconds:.1f} s; progress lines come every {interval} steps "
                  f"(logger.log_interval), the next at step {after}, in about "
                  f"{duration(seconds * (after - step))} at this pace")

    def log_eval(self, step: int, record: dict[str, Any]) -> None:
        if not self.writer:
            return
        print(f"eval at step {step}: loss {record['eval_loss']:.4f} "
              f"({record['eval_samples']} samples)", flush=True)
        self._write({"step": step, **record})

    def log_samples(self, step: int, samples: list[dict] | None) -> None:
        """logger.sample_prompts' continuations (rank 0 has them)."""
        if not self.writer or samples is None:
            return
        for sample in samples:
            print(f"sample at step {step}: {sample['prompt']!r} -> "
                  f"{sample['continuation']!r}", flush=True)
        self._write({"step": step, "samples": samples})

    def note(self, message: str) -> None:
        if self.writer:
            print(message, flush=True)

    def _write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log(record, step=record["step"])
        if self.tensorboard is not None:
            for key, value in record.items():  # numbers only (not comm_bytes' table, samples)
                if key != "step" and isinstance(value, (int, float)):
                    self.tensorboard.add_scalar(key, value, record["step"])
            self.tensorboard.flush()  # a run killed later keeps what was logged

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()
