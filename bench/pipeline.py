"""Pipeline parallel benchmarks on 2 gloo ranks (PP 2), all from one pair of rank processes:

- bubble_over_ideal: each schedule's measured idle share over (p - 1) / (v * m + p - 1), for
  1F1B and interleaved 1F1B (gpipe beside them), and every schedule's over 1F1B's ideal
  (over_1f1b_ideal: the zero-bubble schedules' goal, zb_h1 <= 0.6 and zbv <= 0.5); beside
  it the schedule's own bubble at the F, B, I and W times this run measured (simulated:
  what the order allows at these costs, so measured over it is what the runner loses).
  A step's bubble is 1 - mean busy / makespan,
  as parallel.layout.pipeline_simulation.simulate_orders defines it: busy is the runner's busy_s per
  stage; the makespan runs from the first stage's start to the last end on any stage (run_s
  placed on the monotonic clock all processes share). Each stage's busy over its own run_s
  would miss the last stage's idle tail and read below the ideal.
- zero_bubble_where_w_is_near_i: 1F1B and ZB-H1 again on a shape of the same matmul work
  whose W costs about what I does (the zero-bubble paper's F = B = W), as the main shape's
  does not (LINEAR_HEAVY says why): what the schedule gains where its premise holds.
- step_time_vs_torch_pipelining: our runner's forwards + backwards of a step (the same span)
  over torch.distributed.pipelining's same schedule on the same model, weights, micro-batches
  and loss (schedule.step, spanned alike); no optimizer in either: Schedule1F1B, and for the
  zero-bubble ones ScheduleInterleavedZeroBubble with one stage a rank (ZB-H1) and
  ScheduleZBVZeroBubble. The first-step losses must agree: the check that both computed the
  same thing.
- What explains the bubble: a gloo hop's cost with the receive posted when needed or ahead
  (the runner posts each action's receives one action early), and each schedule's bubble
  with hops that cost that.

The engines and torch's stage share the rank processes and take turns step by step (who goes
first alternates), so outside load falls on all alike; on a shared 2-core CPU the ratios are
the figures, not the absolute times.

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
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
from ranks import run_ranks  # noqa: E402

from parallel.layout import Layout  # noqa: E402
from parallel.layout import pipeline_schedules as schedules  # noqa: E402
from parallel.layout.pipeline_simulation import simulate  # noqa: E402
from trainer.config import ModelConfig, OptimConfig  # noqa: E402
from trainer.model.transformer import Transformer  # noqa: E402
from trainer.plan.options import EngineOptions  # noqa: E402
from trainer.train.batch import MicroBatch  # noqa: E402
from trainer.train.engine import build_engine  # noqa: E402
from trainer.train.step import train_step  # noqa: E402

# Blocks dominate (small vocabulary), so the stages' compute is near equal, as the ideal
# assumes; 8 layers make 4 chunks of 2 for interleaving. Micro-batches as long as the quick
# mode allows, so a hop's milliseconds weigh less against an action's compute.
MODEL = ModelConfig(name="llama", vocab_size=256, hidden_size=256, num_layers=8, num_heads=4,
                    ffn_hidden_size=688, rope_theta=10000.0, norm_eps=1e-5, init_std=0.02)
OPTIM = OptimConfig(name="adamw", weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8,
                    clip_grad=1.0)
PP, MICRO, SEQ, M, SEED, LR = 2, 1, 1024, 8, 1234, 1e-4
SCHEDULES = {"1f1b": 1, "interleaved_1f1b": 2, "gpipe": 1, "zb_h1": 1, "zbv": 2}  # -> chunks
SPLIT = ("zb_h1", "zbv")  # no late-receive model for these (it knows F and B only)
MODES = {"quick": dict(warmup=1, steps=5), "full": dict(warmup=3, steps=15)}
HOPS = 20  # hops timed per way of posting the receives
TOLERANCE = 1e-5  # relative, on the first step's loss: same sums in fp32, another order
# Ours -> torch.distributed.pipelining's schedule of the same name (its class, V-shaped)
TORCH = {"1f1b": (Schedule1F1B, False), "zb_h1": (ScheduleInterleavedZeroBubble, False),
         "zbv": (ScheduleZBVZeroBubble, True)}


# The zero-bubble schedules' gain rests on W's share of the work: ZB-H1 idles (p - 1) x
# (F + I - W) where 1F1B idles (p - 1) x (F + I + W). Above, attention over 1,024 tokens of a
# 256-wide model (no weights) and the elementwise work leave W a sixth of a micro-batch's.
# This shape has about the main one's matmul work per micro-batch, with W near I (as the ZB
# paper's F = B = W): 512 wide, 256 tokens. Only ours, 1F1B and ZB-H1.
LINEAR_HEAVY = (ModelConfig(name="llama", vocab_size=256, hidden_size=512, num_layers=8,
                            num_heads=8, ffn_hidden_size=1376, rope_theta=10000.0,
                            norm_eps=1e-5, init_std=0.02), 256, ("1f1b", "zb_h1"))


def make_layout(virtual: int, seq: int = SEQ) -> Layout:
    return Layout(PP, pipeline_model_parallel_size=PP, micro_batch_size=MICRO, seq_length=seq,
                  global_batch_size=MICRO * M,
                  virtual_pipeline_model_parallel_size=virtual if virtual > 1 else None)


def make_batches(model: ModelConfig = MODEL, seq: int = SEQ) -> list[MicroBatch]:
    """The same M micro-batches on both ranks and every step (content does not change the
    work); no ignored labels, so the token count is M * MICRO * seq."""
    gen = torch.Generator().manual_seed(SEED)
    samples = torch.randint(0, model.vocab_size, (M * MICRO, seq + 1), generator=gen)
    positions = torch.arange(seq).expand(MICRO, -1)
    return [MicroBatch(s[:, :-1], s[:, 1:], positions) for s in samples.split(MICRO)]


class TorchStage(nn.Module):
    """Model chunk `chunk` of `chunks` of the single-device Transformer (whose forward skips a
    module set to None); all but the last pass the positions on with the hidden states, as
    our runner does."""

    def __init__(self, chunk: int, chunks: int):
        super().__init__()
        model = Transformer(MODEL)
        model.init_weights(SEED)  # the same full weights our engine initialises from SEED
        for i in range(MODEL.num_layers):
            if i * chunks // MODEL.num_layers != chunk:
                del model.layers[str(i)]
        if chunk != 0:
            model.embed = None
        if chunk != chunks - 1:  # the last takes hidden states and returns logits
            model.norm = model.head = None
        self.model, self.last = model, chunk == chunks - 1

    def forward(self, x: torch.Tensor, positions: torch.Tensor):
        out = self.model(x, positions)
        return out if self.last else (out, positions)


def torch_schedule(rank: int, name: str):
    """torch's schedule `name` on this rank, with its stage modules (ours' chunks: one a rank,
    or a V's two), and whether this rank feeds the data and holds the loss."""
    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # Global-token mean, like train_step: each micro-batch's sum over every token of the
        # batch, so scale_grads must stay off (it would divide by M once more).
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                               reduction="sum") / (M * MICRO * SEQ)

    kind, v_shape = TORCH[name]
    chunks = 2 * PP if v_shape else PP
    mine = [rank, chunks - 1 - rank] if v_shape else [rank]
    modules = [TorchStage(c, chunks) for c in mine]
    stages = [PipelineStage(m, c, chunks, torch.device("cpu")) for m, c in zip(modules, mine)]
    if kind is Schedule1F1B:
        schedule = kind(stages[0], n_microbatches=M, loss_fn=loss_fn, scale_grads=False)
    else:
        schedule = kind(stages, n_microbatches=M, loss_fn=loss_fn, scale_grads=False)
    return schedule, nn.ModuleList(modules), 0 in mine, chunks - 1 in mine


def hop_s(rank: int, early: bool) -> dict | None:
    """Rank 1's waits (medians) for messages rank 0 sent 10 ms before and computes on after:
    one (a gradient), and positions then activations (a forward's input), received when
    needed one after the other (as the runner's _inputs), or posted ahead. Gloo moves bytes
    only once the receive is posted; then the sender's transport thread needs a core too."""
    messages = (torch.zeros(MICRO, SEQ, dtype=torch.long),
                torch.zeros(MICRO, SEQ, MODEL.hidden_size))
    work, waits = torch.randn(256, 256), []

    def compute(seconds: float) -> None:
        begin = time.perf_counter()
        while time.perf_counter() - begin < seconds:
            work @ work

    for i in range(HOPS):
        dist.barrier()
        if rank == 0:  # both sent at once (as _send_forward), then compute on
            sends = [dist.isend(t, 1, tag=2 * i + k) for k, t in enumerate(messages)]
            compute(0.03)
            for send in sends:
                send.wait()
            continue
        posted = [dist.irecv(torch.empty_like(t), 0, tag=2 * i + k)
                  for k, t in enumerate(messages)] if early else []
        compute(0.01)
        begin, ends = time.perf_counter(), []
        for k, t in enumerate(messages):
            (posted[k] if early else dist.irecv(torch.empty_like(t), 0, tag=2 * i + k)).wait()
            ends.append(time.perf_counter() - begin)
        waits.append(ends)
    return {key: statistics.median(w[j] for w in waits)
            for j, key in enumerate(("one", "pair"))} if waits else None


def late_receive_model(name: str, virtual: int, forward: float, hop: dict) -> float:
    """The bubble of `name` if an input from another stage arrived `hop` after the later of
    its sending and the receiver reaching it (the receive posted only then): hop["pair"] for
    a forward's input, hop["one"] for a gradient. simulate_orders' model otherwise: backward
    twice the forward, both split evenly over a stage's chunks."""
    orders = [schedules.stage_actions(name, s, PP, M, virtual) for s in range(PP)]
    last, done, free, at = PP * virtual - 1, {}, [0.0] * PP, [0] * PP
    cost = {"F": forward / virtual, "B": 2 * forward / virtual}
    while any(at[s] < len(orders[s]) for s in range(PP)):
        for s, order in enumerate(orders):
            while at[s] < len(order):
                a = order[at[s]]
                chunk = schedules.model_chunk(s, a.chunk, PP)
                if a.kind == "F":  # model chunk 0 reads the data
                    needed, wait = chunk and ("F", a.microbatch, chunk - 1), hop["pair"]
                elif chunk == last:  # the last chunk's backward starts from its own loss
                    needed, wait = ("F", a.microbatch, chunk), 0.0
                else:
                    needed, wait = ("B", a.microbatch, chunk + 1), hop["one"]
                if needed and needed not in done:
                    break
                wait = wait if needed and needed[2] % PP != s else 0.0
                start = max(free[s], done.get(needed, 0.0)) + wait
                free[s] = done[(a.kind, a.microbatch, chunk)] = start + cost[a.kind]
                at[s] += 1
    return 1 - 3 * M * forward / max(free)


def note_end(runner) -> None:
    """Keep when each run() returns (`ended`): with run_s, where the run sat on the clock."""
    inner = runner.run  # the instance attribute shadows the method

    def run(*args, **kwargs) -> None:
        inner(*args, **kwargs)
        runner.ended = time.perf_counter()

    runner.run = run


def rank_steps(rank: int, warmup: int, steps: int, linear_heavy: bool = False) -> dict:
    """Each schedule's steps on this rank (linear_heavy: LINEAR_HEAVY's, ours alone)."""
    model, seq, names = LINEAR_HEAVY if linear_heavy else (MODEL, SEQ, tuple(SCHEDULES))
    batches = make_batches(model, seq)
    engines = {name: build_engine(model, OPTIM, SEED, make_layout(SCHEDULES[name], seq),
                                  torch.device("cpu"), EngineOptions(pipeline_schedule=name))
               for name in names}
    for engine in engines.values():
        note_end(engine.model.runner)
    theirs = {} if linear_heavy else {f"torch_{name}": torch_schedule(rank, name)
                                      for name in TORCH}
    tokens, positions, labels = (torch.cat([getattr(mb, key) for mb in batches])
                                 for key in ("tokens", "positions", "labels"))
    # (start, end) of this rank's run on time.perf_counter: CLOCK_MONOTONIC, one for all ranks
    out: dict = {name: {"span": [], "busy_s": [], "busy_by_kind": [], "loss": None}
                 for name in [*engines, *theirs]}
    for step in range(warmup + steps):
        order = [*engines, *theirs]
        for name in order if step % 2 == 0 else reversed(order):
            dist.barrier()  # every rank starts the step together
            record = out[name]
            if name in theirs:
                schedule, modules, first, last = theirs[name]
                losses: list[torch.Tensor] = []
                modules.zero_grad(set_to_none=False)  # accumulate in place, as ours do
                data = (tokens, positions) if first else ()
                start = time.perf_counter()
                if last:
                    schedule.step(*data, target=labels, losses=losses)
                else:
                    schedule.step(*data)
                end = time.perf_counter()
                loss = torch.tensor(float(sum(x.detach() for x in losses)), dtype=torch.float64)
                dist.all_reduce(loss)  # the loss's rank holds it, the other 0
                result = loss.item()
            else:
                engine = engines[name]
                result = train_step(engine.model, engine.optimizer, batches, LR).loss
                runner = engine.model.runner
                start, end = runner.ended - runner.run_s, runner.ended
                record["busy_s"].append(runner.busy_s)
                record["busy_by_kind"].append(dict(runner.busy_by_kind))
            record["span"].append((start, end))
            if record["loss"] is None:
                record["loss"] = result  # first step: same initial weights everywhere
    if not linear_heavy:
        out["hop_s"] = {"posted_when_needed": hop_s(rank, False),
                        "posted_ahead": hop_s(rank, True)}
    return out


def modelled_bubble(name: str, virtual: int, ranks: list[dict], timed: range) -> dict:
    """The schedule's own bubble at this run's costs: each kind's mean action time (both
    stages, the timed steps) as a whole stage's (x virtual), simulated; and with each stage's
    actions scaled by its busy time over the stages' mean (the last stage also runs the head
    and the loss, the first the embedding: the ideal assumes equal stages)."""
    def mean_action(kind: str) -> float:
        total = sum(r[name]["busy_by_kind"][i].get(kind, 0.0) for r in ranks for i in timed)
        return total / (len(ranks) * len(timed) * M * virtual) * virtual
    forward, weight = mean_action("F"), mean_action("W")
    backward = mean_action("B") + mean_action("I") + weight
    result = simulate(name, PP, M, virtual, forward, backward, 0.0, weight or None)
    busy = [statistics.mean(r[name]["busy_s"][i] for i in timed) for r in ranks]
    scale = tuple(b / statistics.mean(busy) for b in busy)
    unequal = simulate(name, PP, M, virtual, forward, backward, 0.0, weight or None, scale)
    return {"bubble": round(result.bubble_fraction, 4),
            "action_s": {"F": round(forward, 4), "backward": round(backward, 4),
                         "W": round(weight, 4)},
            "bubble_at_stage_costs": round(unequal.bubble_fraction, 4),
            "stage_scale": [round(x, 4) for x in scale]}


def schedule_bubble(name: str, ranks: list[dict], timed: range, late: dict | None) -> dict:
    """One schedule's bubble figures from both ranks' timed steps (late: the gloo hops for the
    late-receive model; None: not modelled)."""
    v = SCHEDULES[name]

    def span(i: int) -> float:  # from stage 0's start: barrier skew stays out
        return max(r[name]["span"][i][1] for r in ranks) - ranks[0][name]["span"][i][0]

    one_f_one_b = schedules.ideal_bubble_fraction(PP, M)
    busy = [[r[name]["busy_s"][i] for r in ranks] for i in timed]
    per_step = [1 - statistics.mean(b) / span(i) for b, i in zip(busy, timed)]
    measured, ideal = statistics.median(per_step), schedules.ideal_bubble_fraction(PP, M, v)
    if name in SPLIT:  # their own ideal is near zero: only 1F1B's is a yardstick
        ideal = one_f_one_b
    stage_busy = [statistics.median(b[s] for b in busy) for s in range(PP)]
    modelled = None if name in SPLIT or late is None else late_receive_model(
        name, v, statistics.mean(stage_busy) / (3 * M), late)
    at_costs = modelled_bubble(name, v, ranks, timed)
    figures = {
        "measured": round(measured, 4), "ideal": round(ideal, 4),
        "ratio": round(measured / ideal, 3),
        "over_1f1b_ideal": round(measured / one_f_one_b, 3),
        "per_step": [round(b, 4) for b in per_step],
        # Busiest stage over the least busy (the ideal assumes 1.00), and each stage's busy.
        "stage_busy_imbalance": round(statistics.median(max(b) / min(b) for b in busy), 3),
        "stage_busy_s": [round(b, 4) for b in stage_busy],
        "late_receive_model": modelled and round(modelled, 4),
        "late_receive_model_ratio": modelled and round(modelled / ideal, 3),
        "simulated_at_measured_costs": at_costs,
        "over_simulated": round(measured / at_costs["bubble"], 3),
        # what the runner loses: over the same with each stage's own busy time
        "over_simulated_at_stage_costs": round(measured / at_costs["bubble_at_stage_costs"], 3),
    }
    print(f"  bubble {name:17s} measured {measured:.4f}, ideal {ideal:.4f}, ratio "
          f"{measured / ideal:.3f}, over 1F1B's ideal {figures['over_1f1b_ideal']:.3f}; "
          f"simulated at its measured costs {at_costs['bubble']:.4f} ({at_costs['action_s']}), "
          f"at each stage's {at_costs['bubble_at_stage_costs']:.4f}; late-receive model "
          f"{modelled}, busy imbalance {figures['stage_busy_imbalance']}", flush=True)
    return figures


def measure(quick: bool = True) -> dict:
    warmup, steps = (MODES["quick" if quick else "full"][k] for k in ("warmup", "steps"))
    print(f"pipeline: PP {PP} on gloo, {warmup} warm-up + {steps} timed steps of "
          f"{', '.join(SCHEDULES)} and torch's {', '.join(TORCH)} ...", flush=True)
    started = time.perf_counter()
    ranks = run_ranks(PP, rank_steps, warmup, steps)
    timed = range(warmup, warmup + steps)

    def span(name: str, i: int) -> float:  # from stage 0's start: barrier skew stays out
        return max(r[name]["span"][i][1] for r in ranks) - ranks[0][name]["span"][i][0]

    hops = ranks[1]["hop_s"]
    late = hops["posted_when_needed"]
    print(f"  gloo hop, one message / positions + activations: {late['one'] * 1e3:.2f} / "
          f"{late['pair'] * 1e3:.2f} ms with the receives posted when needed, "
          f"{hops['posted_ahead']['pair'] * 1e3:.2f} ms both posted ahead", flush=True)
    bubbles = {name: schedule_bubble(name, ranks, timed, late) for name in SCHEDULES}
    model, seq, names = LINEAR_HEAVY
    print(f"  where W is near I: llama {model.num_layers} x {model.hidden_size}, {seq} tokens, "
          f"{', '.join(names)} ...", flush=True)
    heavy = run_ranks(PP, rank_steps, warmup, steps, True)
    linear_heavy = {name: schedule_bubble(name, heavy, timed, None) for name in names}
    linear_heavy["setup"] = (f"the same, but llama {model.num_layers} layers x "
                             f"{model.hidden_size} (ffn {model.ffn_hidden_size}), micro-batches "
                             f"of {MICRO} x {seq} tokens")
    versus = {}
    for name in TORCH:
        ours, torchs = (statistics.median(span(n, i) for i in timed)
                        for n in (name, f"torch_{name}"))
        loss_ours, loss_torch = ranks[0][name]["loss"], ranks[0][f"torch_{name}"]["loss"]
        loss_error = abs(loss_ours - loss_torch) / abs(loss_torch)
        versus[name] = {
            "ratio": round(ours / torchs, 3),
            "ours_s_median": round(ours, 4), "torch_s_median": round(torchs, 4),
            "ours_s": [round(span(name, i), 4) for i in timed],
            "torch_s": [round(span(f"torch_{name}", i), 4) for i in timed],
            "first_loss": {"ours": loss_ours, "torch": loss_torch,
                           "relative_error": float(f"{loss_error:.2e}"),
                           "within_tolerance": loss_error <= TOLERANCE},
        }
        print(f"  step time vs torch's {name}: ours {ours:.4f} s, torch {torchs:.4f} s, "
              f"ratio {ours / torchs:.3f}; first loss {loss_ours:.6f} vs {loss_torch:.6f} "
              f"(relative {loss_error:.1e}) [{time.perf_counter() - started:.0f} s]",
              flush=True)
    return {
        "bubble_over_ideal": bubbles,
        "zero_bubble_where_w_is_near_i": linear_heavy,
        "gloo_hop_s": {k: {n: round(t, 5) for n, t in v.items()} for k, v in hops.items()},
        "step_time_vs_torch_pipelining": versus,
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
