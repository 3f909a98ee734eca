"""A mixture of experts: dispatch bytes, speed against a dense model and under EP, balance, and
the measured dry run of an EP layout against its plan.

- dispatch bytes: 4 gloo ranks, EP 4, one step of MOE; the bytes every rank recorded on the
  expert_model_parallel group over a count made from the routing alone: each rank's (token,
  expert) pairs whose expert lives on another rank (read from the Experts module's input by a
  forward pre-hook) travel four times (there and back in forward, the same in backward), h x 4
  bytes a row in fp32, plus each forward's token-count exchange ((EP-1)/EP of E int64 counts).
  Goal 1.00.
- MoE over dense: one process, MOE and a dense model of the same active parameters (its FFN
  top-k x the expert FFN), the same tokens; their steps alternate, median step time dense over
  MoE (= MoE's tokens/s over dense's). Where MoE's time goes: torch.profiler's self CPU time of
  one MoE step by operator, the largest few.
- EP 4 over EP 1: 4 gloo ranks, the same model and global batch; each layout's engine lives in
  the same rank processes and their steps alternate; median step time EP 4 over EP 1.
- imbalance: launch.py trains model=tiny_moe for 256 steps on the built-in corpus, once with
  the switch loss (aux_loss) and once with DeepSeek-V3's expert bias (sigmoid router, no aux
  loss); the last step's tokens-per-expert max over mean (metrics.jsonl's moe_imbalance). Goal
  <= 1.5.
- measured dry run over plan: the real CLI's measured dry run (dry_run_rank=0) of a mid-sized
  mixture of experts under EP 4 and under TP 2 x EP 2: the allocator's count of the step's peak
  over the planned peak (bench/memory.py's method). Goal 0.8-1.2.

    python bench/moe.py
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))
from memory import MID, measured_dry_run  # noqa: E402
from ranks import run_ranks  # noqa: E402

from parallel.layout import Layout  # noqa: E402
from trainer.config import ModelConfig, OptimConfig  # noqa: E402

SEQ, MICRO = 512, 4
MOE = ModelConfig(name="llama", vocab_size=512, hidden_size=256, num_layers=2, num_heads=8,
                  ffn_hidden_size=688, rope_theta=1e4, norm_eps=1e-5, init_std=0.02,
                  num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=256,
                  moe_aux_loss_coeff=0.01)
# The same active parameters a token passes through: top-k experts' FFN as one dense FFN.
DENSE = replace(MOE, num_moe_experts=None, moe_router_topk=2, moe_ffn_hidden_size=None,
                moe_aux_loss_coeff=None, ffn_hidden_size=2 * 256)
OPTIM = OptimConfig(name="adamw", weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8,
                    clip_grad=1.0)
MID_MOE = MID + ["model.num_moe_experts=8", "model.moe_router_topk=2",
                 "model.moe_ffn_hidden_size=688", "model.moe_aux_loss_coeff=0.01"]
DRY_RUNS = {
    "ep4": ["cluster.procs_per_node=4", "parallel.expert_model_parallel_size=4"],
    "tp2_sp_ep2": ["cluster.procs_per_node=4", "parallel.tensor_model_parallel_size=2",
                   "parallel.sequence_parallel=true", "parallel.expert_tensor_parallel_size=1",
                   "parallel.expert_model_parallel_size=2"],
}
IMBALANCE = {
    "aux_loss": [],
    "expert_bias": ["model.moe_router_score_function=sigmoid",
                    "model.moe_router_enable_expert_bias=true",
                    "model.moe_router_load_balancing_type=none", "model.moe_aux_loss_coeff=0"],
}


def _batch(model: ModelConfig, samples: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, model.vocab_size, (samples, SEQ + 1), generator=gen)


def _engine(model: ModelConfig, layout: Layout):
    from trainer.train.engine import build_engine
    return build_engine(model, OPTIM, 0, layout, torch.device("cpu"))


def _timed_steps(rank: int, engines: dict, batch: torch.Tensor, steps: int,
                 mtp: dict[str, int] | None = None) -> dict:
    """Each engine's step, alternating (the first of each a warm-up): seconds per step. mtp:
    each engine's multi-token prediction depths (none where absent)."""
    from trainer.train.batch import rank_micro_batches
    from trainer.train.step import train_step

    times: dict[str, list[float]] = {name: [] for name in engines}
    for step in range(steps + 1):
        names = list(engines)[step % len(engines):] + list(engines)[:step % len(engines)]
        for name in names:
            engine = engines[name]
            micro = rank_micro_batches(lambda idx: batch[idx], engine.layout, rank,
                                       mtp_depths=(mtp or {}).get(name, 0))
            if dist.is_initialized():
                dist.barrier()
            start = time.perf_counter()
            train_step(engine.model, engine.optimizer, micro, 1e-4)
            if dist.is_initialized():
                dist.barrier()
            if step:
                times[name].append(time.perf_counter() - start)
    return times


def _dispatch(rank: int, layout: Layout) -> dict:
    from trainer.model.moe import Experts
    from trainer.train.batch import rank_micro_batches
    from trainer.train.step import train_step

    engine = _engine(MOE, layout)
    ep = engine.groups.expert_model_parallel
    local = MOE.num_moe_experts // ep.size
    leaving = [0]

    def count(module, args):  # (x, weights, experts): pairs whose expert is elsewhere
        leaving[0] += int((args[2] // local != ep.rank).sum())

    for module in engine.model.module.modules():
        if isinstance(module, Experts):
            module.register_forward_pre_hook(count)
    micro = rank_micro_batches(lambda idx: _batch(MOE, layout.global_batch_size)[idx], layout,
                               rank)
    engine.groups.stats.reset()
    train_step(engine.model, engine.optimizer, micro, 1e-4)
    sent = sum(b for (kind, _), b in engine.groups.stats.bytes.items()
               if kind == "expert_model_parallel")
    exchanges = MOE.num_layers * len(micro)  # every block is a mixture of experts here
    counts = exchanges * (ep.size - 1) * MOE.num_moe_experts * 8 // ep.size
    return {"sent": sent, "analytic": 4 * leaving[0] * MOE.hidden_size * 4 + counts}


def dispatch_bytes() -> dict:
    layout = Layout(4, expert_model_parallel_size=4, micro_batch_size=MICRO, seq_length=SEQ)
    ranks = run_ranks(4, _dispatch, layout)
    sent, analytic = sum(r["sent"] for r in ranks), sum(r["analytic"] for r in ranks)
    return {"setup": f"4 gloo ranks, EP 4, {MOE.num_moe_experts} experts top "
                     f"{MOE.moe_router_topk}, hidden {MOE.hidden_size}, {MICRO} x {SEQ} tokens "
                     f"a rank, one step, fp32",
            "sent_bytes": sent, "analytic_bytes": analytic,
            "bytes_over_analytic": round(sent / analytic, 4)}


def _moe_vs_dense(rank: int, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from trainer.train.batch import rank_micro_batches
    from trainer.train.step import train_step

    layout = Layout(1, micro_batch_size=MICRO, seq_length=SEQ)
    engines = {"moe": _engine(MOE, layout), "dense": _engine(DENSE, layout)}
    batch = _batch(MOE, layout.global_batch_size)
    times = _timed_steps(0, engines, batch, steps)
    micro = rank_micro_batches(lambda idx: batch[idx], layout, 0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_step(engines["moe"].model, engines["moe"].optimizer, micro, 1e-4)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    where = {e.key: round(e.self_cpu_time_total / total, 3) for e in events[:6]}
    return {"times": times, "where": where}


def moe_over_dense(steps: int) -> dict:
    (result,) = run_ranks(1, _moe_vs_dense, steps)
    median = {name: statistics.median(t) for name, t in result["times"].items()}
    return {"setup": f"one process, one thread, {MICRO} x {SEQ} tokens; MoE {MOE.num_moe_experts} "
                     f"experts of {MOE.moe_ffn_hidden_size} top {MOE.moe_router_topk} vs dense "
                     f"FFN {DENSE.ffn_hidden_size}, hidden {MOE.hidden_size}, "
                     f"{MOE.num_layers} layers, {steps} timed steps each",
            "step_s": {name: round(t, 4) for name, t in median.items()},
            "tokens_per_s_moe_over_dense": round(median["dense"] / median["moe"], 3),
            "moe_self_cpu_share_by_op": result["where"]}


def _ep_steps(rank: int, layouts: dict, steps: int) -> dict:
    engines = {name: _engine(MOE, layout) for name, layout in layouts.items()}
    batch = _batch(MOE, next(iter(layouts.values())).global_batch_size)
    return _timed_steps(rank, engines, batch, steps)


def ep4_over_ep1(steps: int) -> dict:
    layouts = {f"ep{ep}": Layout(4, expert_model_parallel_size=ep, micro_batch_size=MICRO,
                                 seq_length=SEQ) for ep in (1, 4)}
    ranks = run_ranks(4, _ep_steps, layouts, steps)
    median = {name: statistics.median(max(r[name][i] for r in ranks) for i in range(steps))
              for name in layouts}
    return {"setup": f"4 gloo ranks (data parallel 4), the same {MOE.num_moe_experts} experts "
                     f"and global batch, {steps} timed steps each, alternating",
            "step_s": {name: round(t, 4) for name, t in median.items()},
            "step_time_ep4_over_ep1": round(median["ep4"] / median["ep1"], 3)}


def _last_imbalance(overrides: list[str], steps: int) -> float:
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run([sys.executable, "launch.py", "model=tiny_moe", *overrides,
                        f"train.train_samples={steps * 8}", "train.global_batch_size=8",
                        "train.eval_interval=null", "checkpoint.save_interval=null",
                        f"hydra.run.dir={folder}"], cwd=ROOT, check=True, capture_output=True,
                       timeout=1800)
        lines = (Path(folder) / "metrics.jsonl").read_text().splitlines()
    last = [json.loads(line) for line in lines if '"moe_imbalance"' in line][-1]
    return last["moe_imbalance"]


def imbalance(steps: int = 256) -> dict:
    return {"setup": f"launch.py model=tiny_moe, {steps} steps of 8 samples on the built-in "
                     f"corpus, one process; the last step's tokens-per-expert max over mean "
                     f"(worst layer)",
            **{name: _last_imbalance(extra, steps) for name, extra in IMBALANCE.items()}}


def dry_runs() -> dict:
    return {name: measured_dry_run(MID_MOE + extra) for name, extra in DRY_RUNS.items()}


def measure(quick: bool = True) -> dict:
    return {"dispatch": dispatch_bytes(), "moe_over_dense": moe_over_dense(3 if quick else 8),
            "ep4_over_ep1": ep4_over_ep1(3 if quick else 6), "imbalance": imbalance(),
            "dry_run": dry_runs()}


if __name__ == "__main__":
    print(json.dumps(measure(), indent=1))
