"""Pipeline parallel benchmarks on 2 gloo ranks (PP 2), both from one pair of rank processes:

- bubble_over_ideal: the idle share each schedule measures over its analytic one,
  (p - 1) / (v * m + p - 1), for 1F1B and interleaved 1F1B (gpipe beside them). A step's
  bubble is 1 - mean busy / makespan, as parallel.pipeline.schedules.simulate_orders defines
  it: busy is the runner's compute time per stage (busy_s), the makespan the longer stage's
  run (max run_s; both start together, right after train_step's token-count all-reduce).
  Dividing each stage's busy by its own run_s instead would miss the last stage's idle tail
  (it finishes a backward before the first stage does) and read below the ideal.
- step_time_vs_torch_pipelining: our runner's forwards + backwards of one step (run_s, the
  slower rank) over torch.distributed.pipelining's Schedule1F1B on the same model, weights,
  micro-batches and loss (schedule.step, the slower rank), no optimizer in either timing.
  Both first-step losses must agree: the check that both computed the same thing.

The engines and torch's stage live in the same processes and take turns step by step (which one
goes first alternates), so load from anything else falls on all alike. Absolute times on a
shared 2-core CPU mean little; the ratios are the figures.

    python bench/pipeline.py           # quick mode
    python bench/pipeline.py --full    # more steps
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# Imported once here, not in every forked rank (seconds each on a busy machine).
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
from ranks import run_ranks  # noqa: E402

from parallel.layout import Layout  # noqa: E402
from parallel.pipeline import schedules  # noqa: E402
from trainer.config import ModelConfig, OptimConfig  # noqa: E402
from trainer.data.batch import MicroBatch  # noqa: E402
from trainer.model.transformer import Transformer  # noqa: E402
from trainer.train.engine import build_engine  # noqa: E402
from trainer.train.options import EngineOptions  # noqa: E402
from trainer.train.step import train_step  # noqa: E402

# Blocks dominate (small vocabulary), so the stages' compute is near equal, as the ideal
# assumes; 8 layers split into 4 chunks of 2 for interleaving.
MODEL = ModelConfig(name="llama", vocab_size=256, hidden_size=256, num_layers=8, num_heads=4,
                    ffn_hidden_size=688, rope_theta=10000.0, norm_eps=1e-5, init_std=0.02)
OPTIM = OptimConfig(name="adamw", weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8,
                    clip_grad=1.0)
PP, MICRO, SEQ, M, SEED, LR = 2, 1, 256, 8, 1234, 1e-4
SCHEDULES = {"1f1b": 1, "interleaved_1f1b": 2, "gpipe": 1}  # -> virtual chunks per stage
MODES = {"quick": dict(warmup=2, steps=7), "full": dict(warmup=3, steps=20)}
HOPS = 20  # messages timed per way of posting the receive
TOLERANCE = 1e-5  # relative, on the first step's loss: same sums in fp32, another order
TORCH = "torch_1f1b"


def make_layout(virtual: int) -> Layout:
    return Layout(PP, pipeline_model_parallel_size=PP, micro_batch_size=MICRO, seq_length=SEQ,
                  global_batch_size=MICRO * M,
                  virtual_pipeline_model_parallel_size=virtual if virtual > 1 else None)


def make_batches() -> list[MicroBatch]:
    """The same M micro-batches on both ranks and every step (content does not change the
    work); no ignored labels, so the token count is M * MICRO * SEQ."""
    gen = torch.Generator().manual_seed(SEED)
    samples = torch.randint(0, MODEL.vocab_size, (M * MICRO, SEQ + 1), generator=gen)
    positions = torch.arange(SEQ).expand(MICRO, -1)
    return [MicroBatch(s[:, :-1], s[:, 1:], positions) for s in samples.split(MICRO)]


class TorchStage(nn.Module):
    """Half of the single-device Transformer (its forward skips the embedding, or the final
    norm and head, set to None); the first half passes the positions on with the hidden
    states, as our runner does."""

    def __init__(self, stage: int):
        super().__init__()
        model = Transformer(MODEL)
        model.init_weights(SEED)  # the same full weights our engine initialises from SEED
        half = MODEL.num_layers // PP
        for i in range(MODEL.num_layers):
            if i // half != stage:
                del model.layers[str(i)]
        if stage == 0:
            model.norm = model.head = None
        else:
            model.embed = None
        self.model, self.last = model, stage == PP - 1

    def forward(self, x: torch.Tensor, positions: torch.Tensor):
        out = self.model(x, positions)
        return out if self.last else (out, positions)


def torch_schedule(rank: int) -> tuple[Schedule1F1B, nn.Module]:
    tokens = M * MICRO * SEQ

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # Global-token mean, like train_step: summed per micro-batch, divided by every token,
        # so scale_grads must stay off (it would divide by M once more).
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                               reduction="sum") / tokens

    module = TorchStage(rank)
    stage = PipelineStage(module, rank, PP, torch.device("cpu"))
    return Schedule1F1B(stage, n_microbatches=M, loss_fn=loss_fn, scale_grads=False), module


def hop_s(rank: int, early: bool) -> float | None:
    """What one stage-to-stage hop costs the receiver on gloo (rank 1's seconds waiting, median),
    for a message sent while it computed: its receive posted only when needed (as the runner
    does, positions then activations, one after the other) or posted before computing. Gloo
    moves the bytes only once the receive is posted, so a late one waits a round trip of its
    transport threads, which on a loaded 2-core box is milliseconds."""
    x = torch.zeros(MICRO, SEQ, MODEL.hidden_size)
    positions = torch.zeros(MICRO, SEQ, dtype=torch.long)
    messages, work, waits = (positions, x), torch.randn(256, 256), []
    for i in range(HOPS):
        dist.barrier()
        if rank == 0:
            for send in [dist.isend(t, 1, tag=2 * i + k) for k, t in enumerate(messages)]:
                send.wait()  # both posted at once, as the runner's _send_forward
            continue
        def recv(k: int, i: int = i) -> dist.Work:
            return dist.irecv(torch.empty_like(messages[k]), 0, tag=2 * i + k)

        posted = [recv(k) for k in range(len(messages))] if early else []
        begin = time.perf_counter()
        while time.perf_counter() - begin < 0.01:  # the sender's messages go out meanwhile
            work @ work
        begin = time.perf_counter()
        for k in range(len(messages)):
            (posted[k] if early else recv(k)).wait()  # late: one after the other, as _inputs
        waits.append(time.perf_counter() - begin)
    return statistics.median(waits) if waits else None


def rank_steps(rank: int, warmup: int, steps: int) -> dict:
    batches = make_batches()
    engines = {name: build_engine(MODEL, OPTIM, SEED, make_layout(v), torch.device("cpu"),
                                  EngineOptions(pipeline_schedule=name))
               for name, v in SCHEDULES.items()}
    schedule, module = torch_schedule(rank)
    tokens = torch.cat([mb.tokens for mb in batches])
    positions = torch.cat([mb.positions for mb in batches])
    labels = torch.cat([mb.labels for mb in batches])
    out: dict = {name: {"run_s": [], "busy_s": [], "loss": None} for name in engines}
    out[TORCH] = {"run_s": [], "loss": None}
    for step in range(warmup + steps):
        order = [*engines, TORCH]
        for name in order if step % 2 == 0 else reversed(order):
            dist.barrier()  # every rank starts the step together
            if name == TORCH:
                losses: list[torch.Tensor] = []
                module.zero_grad(set_to_none=False)  # like ours: in place
                start = time.perf_counter()
                if rank == 0:
                    schedule.step(tokens, positions)
                else:
                    schedule.step(target=labels, losses=losses)
                seconds = time.perf_counter() - start
                loss = torch.tensor(float(sum(losses)) if losses else 0.0, dtype=torch.float64)
                dist.broadcast(loss, src=PP - 1)  # the last stage holds it
                result, record = loss.item(), out[TORCH]
            else:
                engine = engines[name]
                result = train_step(engine.model, engine.optimizer, batches, LR).loss
                runner, record = engine.model.runner, out[name]
                seconds = runner.run_s
                record["busy_s"].append(runner.busy_s)
            record["run_s"].append(seconds)
            if record["loss"] is None:
                record["loss"] = result  # first step: same initial weights everywhere
    out["hop_s"] = {"posted_late": hop_s(rank, False), "posted_early": hop_s(rank, True)}
    return out


def measure(quick: bool = True) -> dict:
    mode = MODES["quick" if quick else "full"]
    warmup, steps = mode["warmup"], mode["steps"]
    print(f"pipeline: PP {PP} on gloo, {warmup} warm-up + {steps} timed steps of "
          f"{len(SCHEDULES)} schedules and torch's 1F1B ...", flush=True)
    started = time.perf_counter()
    ranks = run_ranks(PP, rank_steps, warmup, steps)
    timed = range(warmup, warmup + steps)
    hop = ranks[1]["hop_s"]
    print(f"  gloo hop (positions + activations): {hop['posted_late'] * 1e3:.2f} ms with the "
          f"receives posted when needed, {hop['posted_early'] * 1e3:.2f} ms posted ahead",
          flush=True)
    bubbles: dict = {}
    for name, v in SCHEDULES.items():
        per_step, imbalance = [], []
        for i in timed:
            busy = [r[name]["busy_s"][i] for r in ranks]
            makespan = max(r[name]["run_s"][i] for r in ranks)
            per_step.append(1 - statistics.mean(busy) / makespan)
            imbalance.append(max(busy) / min(busy))
        measured = statistics.median(per_step)
        ideal = schedules.ideal_bubble_fraction(PP, M, v)
        # What the schedule would give if every hop cost the late-posted wait measured above
        # (forward time a third of a stage's busy per micro-batch, backward two thirds).
        forward = statistics.mean(statistics.median(r[name]["busy_s"][i] for i in timed)
                                  for r in ranks) / (3 * M)
        orders = [schedules.stage_actions(name, stage, PP, M, v) for stage in range(PP)]
        simulated = schedules.simulate_orders(orders, PP, v, forward, 2 * forward,
                                              hop["posted_late"]).bubble_fraction
        bubbles[name] = {
            "measured": round(measured, 4), "ideal": round(ideal, 4),
            "ratio": round(measured / ideal, 3),
            "per_step": [round(b, 4) for b in per_step],
            # Busiest stage over the least busy: the ideal assumes 1.00.
            "stage_busy_imbalance": round(statistics.median(imbalance), 3),
            "stage_busy_s": [round(statistics.median(r[name]["busy_s"][i] for i in timed), 4)
                             for r in ranks],
            "simulated_with_late_hops": round(simulated, 4),
            "simulated_ratio": round(simulated / ideal, 3),
        }
        print(f"  bubble {name:17s} measured {measured:.4f}, ideal {ideal:.4f}, ratio "
              f"{measured / ideal:.3f}; simulated with late hops {simulated:.4f}, busy "
              f"imbalance {bubbles[name]['stage_busy_imbalance']}", flush=True)
    step_s = {name: [max(r[name]["run_s"][i] for r in ranks) for i in timed]
              for name in ("1f1b", TORCH)}
    ours, theirs = (statistics.median(step_s[n]) for n in ("1f1b", TORCH))
    loss_ours, loss_torch = ranks[0]["1f1b"]["loss"], ranks[0][TORCH]["loss"]
    loss_error = abs(loss_ours - loss_torch) / abs(loss_torch)
    versus = {
        "ratio": round(ours / theirs, 3),
        "ours_run_s_median": round(ours, 4), "torch_step_s_median": round(theirs, 4),
        "ours_run_s": [round(s, 4) for s in step_s["1f1b"]],
        "torch_step_s": [round(s, 4) for s in step_s[TORCH]],
        "first_loss": {"ours": loss_ours, "torch": loss_torch,
                       "relative_error": float(f"{loss_error:.2e}"),
                       "within_tolerance": loss_error <= TOLERANCE},
    }
    print(f"  step time vs torch 1F1B: ours {ours:.4f} s, torch {theirs:.4f} s, ratio "
          f"{ours / theirs:.3f}; first loss {loss_ours:.6f} vs {loss_torch:.6f} "
          f"(relative {loss_error:.1e}) [{time.perf_counter() - started:.0f} s]", flush=True)
    return {
        "bubble_over_ideal": bubbles,
        "gloo_hop_s": {k: round(v, 5) for k, v in hop.items()},
        "step_time_vs_torch_pipelining": versus,
        "goals": {
            "bubble_1f1b_over_ideal": (bubbles["1f1b"]["ratio"], "<= 1.1"),
            "bubble_interleaved_over_ideal": (bubbles["interleaved_1f1b"]["ratio"], "<= 1.1"),
            "pp2_step_vs_torch_pipelining": (versus["ratio"], "<= 1.0"),
        },
        "setup": f"{PP} gloo ranks, PP {PP}, llama {MODEL.num_layers} layers x "
                 f"{MODEL.hidden_size}, vocab {MODEL.vocab_size}, {M} micro-batches of "
                 f"{MICRO} x {SEQ} tokens, fp32, {steps} timed steps after {warmup}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="more timed steps")
    print(json.dumps(measure(quick=not parser.parse_args().full), indent=1))


if __name__ == "__main__":
    main()
