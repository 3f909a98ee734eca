"""optim=muon against optim=adamw: Muon's step time, the bytes its exchange moves, how evenly its
owners share the Newton-Schulz work, and the loss it reaches.

1. step time: 4 gloo ranks, model=small (conf/model/small.yaml), WS 4 (one weight tile of 4,
   one replica), micro-batch 1 x 128 tokens, 2 micro-batches a step, fp32. Both optimizers'
   engines live in the same rank processes and their steps alternate (which goes first
   alternates too), so load from anything else on the machine falls on both alike; a step's
   time is its slowest rank's, the first step of each is a warm-up. Beside the median step of
   each and the ratio, the update alone (optimizer.update after reduce_gradients, the ranks
   lined up by a barrier first so it holds no wait for a late rank): Muon's update's share of
   its step. model=small at its own width fits (about 10 to 25 s a step on 2 shared cores);
   with 2 timed steps the ratio moves with the load (1.33 and 1.71 in two runs here).
2. bytes: what each rank's CommStats record during one update() of the Muon engine minus the
   same for AdamW's (Muon buffers' exchange only: both record everything else alike), against
   a count from the shapes. A Muon buffer of N elements, padded to P = R ceil(N / R), over R
   replicas and a weight tile of T ranks, sends per rank (elements, 4 bytes each in fp32):
     all-gather of the (Nesterov) momentum over the replicas   (R - 1) P / R
     reduce-scatter of the update back over the replicas         (R - 1) P / R
     first all-to-all, to each matrix's owner (its replica column only): of every matrix owned
       by another tile rank of this column, the piece this rank holds: rows_t x cols, where
       GTP's row shard gives tile rank t rows_t = clamp(rows - t ceil(rows / T), 0, ceil(rows / T))
     second all-to-all, back: of every matrix it owns, what the other T - 1 tile ranks hold,
       (rows - rows_t) x cols.
   all_to_all_rows records the elements a rank sends to others; the ring collectives (R - 1)
   times their part. With TP 1 (row shards only; TP would cut row-parallel weights by columns),
   WS 4: R = 1, T = 4, so the replica terms vanish, every matrix of model=small splits evenly
   and rank t sends (N - O_t) / 4 + 3 O_t / 4, O_t the elements of the matrices it owns: over
   the ranks 2 x 3/4 x N. AdamW's update at R = 1 sends nothing. Goal: busiest rank and sum 1.00.
3. balance: max over mean of the Newton-Schulz FLOPs per owner slot (trainer.plan.muon.matrix_flops
   of each row block, summed per matrix, assigned by assign_owners over T x R slots), from the
   shapes alone: model=small at WS 4, and the seed's first example
   (conf/experiment/seed_ws64_tp2_sp.yaml: llama3_1_8b, TP 2 with SP, WS 64, SS 16 on 64 ranks,
   so one tile of 64). Checked against the owners MuonExchange assigns on the ranks of (1).
   Goal <= 1.2.
4. loss: one process trains a 4-layer model of width 128 on the built-in corpus, the same
   samples in the same order from the same initial weights for each optimizer, at each of a
   sweep of 3 lrs each around its own best (10% linear warmup, cosine to 0.1 lr); the loss on
   64 fixed samples of the validation split at the end picks the best lr and is the figure
   (selection and figure on the same samples: both optimizers alike). Muon's best over AdamW's.
   Goal <= 1.0.

    python bench/muon.py          # quick: 2 timed steps, 200 training steps per lr
    python bench/muon.py --full   # 4 timed steps, 500 training steps per lr
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))
from ranks import run_ranks  # noqa: E402
from table import met  # noqa: E402

from parallel.layout import Layout  # noqa: E402
from trainer.config import ModelConfig, OptimConfig  # noqa: E402
from trainer.parts.assembly import parallel_plan, parameter_shapes  # noqa: E402
from trainer.parts.matrices import muon_parameters  # noqa: E402
from trainer.plan.muon import assign_owners, matrix_blocks, matrix_flops  # noqa: E402

WORLD, SHARDS, MICRO, SEQ, MICRO_BATCHES = 4, 4, 1, 128, 2
ADAMW = OptimConfig(name="adamw", weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8,
                    clip_grad=1.0)
MUON = replace(ADAMW, name="muon")  # OptimConfig's Muon defaults are conf/optim/muon.yaml's
OPTIMS = {"adamw": ADAMW, "muon": MUON}
SEED_PRESET = ROOT / "conf/experiment/seed_ws64_tp2_sp.yaml"
LOSS_MODEL = ModelConfig(name="llama", vocab_size=256, hidden_size=128, num_layers=4,
                         num_heads=4, ffn_hidden_size=344, rope_theta=1e4, norm_eps=1e-5,
                         init_std=0.02)
LOSS_MICRO, LOSS_SEQ, EVAL_SAMPLES = 8, 128, 64
# Each optimizer's grid, a factor ~3 apart around where a first 200-step sweep of the same
# runs found its best (AdamW flat over 1e-3 to 3e-3; Muon at 1e-2, worse at 3e-3 and 3e-2).
LRS = {"adamw": (6e-4, 2e-3, 6e-3), "muon": (3e-3, 1e-2, 3e-2)}


def preset_model(name: str) -> ModelConfig:
    return ModelConfig(**OmegaConf.to_container(OmegaConf.load(ROOT / f"conf/model/{name}.yaml")))


def ws4_layout() -> Layout:
    layout = Layout(WORLD, micro_batch_size=MICRO, seq_length=SEQ,
                    tensor_parallel_num_weight_shards=SHARDS)
    return replace(layout, global_batch_size=MICRO * layout.batch_parallel_size * MICRO_BATCHES)


def seed_layout() -> tuple[ModelConfig, Layout]:
    preset = OmegaConf.load(SEED_PRESET)
    model = next(d["override /model"] for d in preset.defaults if "override /model" in d)
    cluster = next(d["override /cluster"] for d in preset.defaults if "override /cluster" in d)
    cluster = OmegaConf.load(ROOT / f"conf/cluster/{cluster}.yaml")
    layout = Layout(cluster.num_nodes * cluster.procs_per_node, **preset.parallel,
                    micro_batch_size=preset.train.micro_batch_size,
                    seq_length=preset.train.seq_length)
    return preset_model(model), layout


# ---------------------------------------------------------------- owners from the shapes alone

def owner_plan(model: ModelConfig, layout: Layout, cfg: OptimConfig = MUON) -> dict:
    """The dense Muon buffer's matrices ((rows, cols), NS FLOPs summed over row blocks), their
    owners and each slot's FLOPs, as MuonExchange computes them but without torch or ranks."""
    shapes, plan = parameter_shapes(model), parallel_plan(model)
    dims, costs = [], []
    for name in muon_parameters(shapes, list(cfg.adamw_params)):
        shape = shapes[name]
        # an expert's or a whole linear's matrix is another buffer with other slots
        assert len(shape) == 2 and plan.linear_style(name.removesuffix(".weight"))[0] != "whole", \
            name
        dims.append(shape)
        costs.append(matrix_flops(matrix_blocks(name, shape, plan, cfg.muon_split_qkv),
                                  cfg.muon_num_ns_steps))
    slots = layout.weight_tile_size * layout.num_weight_replicas
    owner = assign_owners(costs, slots)
    loads = [0] * slots
    for cost, slot in zip(costs, owner):
        loads[slot] += cost
    return {"dims": dims, "costs": costs, "owner": owner, "loads": loads}


def imbalance(loads: list[int]) -> float:
    return max(loads) / (sum(loads) / len(loads))


def analytic_bytes(model: ModelConfig, layout: Layout) -> list[int]:
    """Bytes each slot (replica column x T + tile rank) sends in one Muon update (docstring, 2)."""
    assert layout.tp_size == 1, "the count assumes GTP's row shards only"
    found, T, R = owner_plan(model, layout), layout.weight_tile_size, layout.num_weight_replicas
    n = sum(r * c for r, c in found["dims"])
    sent = []
    for slot in range(T * R):
        t, column = slot % T, slot // T
        elements = 2 * (R - 1) * -(-n // R)
        for (rows, cols), owner in zip(found["dims"], found["owner"]):
            if owner // T != column:
                continue
            shard = -(-rows // T)
            held = max(0, min(shard, rows - t * shard)) * cols
            elements += (rows * cols - held) if owner % T == t else held
        sent.append(4 * elements)
    return sent


# ------------------------------------------------------------------------ ranks: steps, bytes

def _rank_steps(rank: int, layout: Layout, model: ModelConfig, steps: int) -> dict:
    from trainer.train.batch import MicroBatch
    from trainer.train.engine import build_engine
    from trainer.train.step import train_step

    engines = {name: build_engine(model, cfg, 0, layout, torch.device("cpu"))
               for name, cfg in OPTIMS.items()}
    update_s = {name: [] for name in engines}
    update_bytes: dict[str, dict[str, int]] = {}
    for name, engine in engines.items():  # time (and count) update() inside the real step
        def timed(*args, _inner=engine.optimizer.update, _name=name, _stats=engine.groups.stats,
                  **kwargs):
            dist.barrier()  # every rank enters together: the time is the update's own
            before, start = _stats.by_op(), time.perf_counter()
            _inner(*args, **kwargs)
            update_s[_name].append(time.perf_counter() - start)
            after = _stats.by_op()
            update_bytes[_name] = {op: after[op] - before.get(op, 0) for op in after
                                   if after[op] != before.get(op, 0)}
        engine.optimizer.update = timed
    gen = torch.Generator().manual_seed(rank)  # content does not change the work
    samples = [torch.randint(0, model.vocab_size, (MICRO, SEQ + 1), generator=gen)
               for _ in range(layout.num_microbatches)]
    positions = torch.arange(SEQ).expand(MICRO, -1)
    batches = [MicroBatch(s[:, :-1], s[:, 1:], positions) for s in samples]
    step_s = {name: [] for name in engines}
    for step in range(steps + 1):
        for name in (list(engines) if step % 2 == 0 else list(reversed(engines))):
            dist.barrier()
            start = time.perf_counter()
            train_step(engines[name].model, engines[name].optimizer, batches, 1e-4)
            dist.barrier()
            step_s[name].append(time.perf_counter() - start)
    exchange = engines["muon"].optimizer.muon[0].exchange
    steps_ns = MUON.muon_num_ns_steps
    return {"step_s": step_s, "update_s": update_s, "bytes": update_bytes,
            "tile_rank": engines["muon"].groups.weight_tile.rank,
            "buffers": len(engines["muon"].optimizer.muon), "owner": exchange.owner,
            "costs": [m.cost(steps_ns) for m in exchange.matrices]}


def steps_and_bytes(steps: int) -> tuple[dict, dict, list[dict]]:
    layout, model = ws4_layout(), preset_model("small")
    ranks = run_ranks(WORLD, _rank_steps, layout, model, steps, timeout=1200)

    def median(key: str, name: str) -> float:  # each step's slowest rank, warm-up dropped
        return statistics.median(max(r[key][name][i] for r in ranks) for i in range(1, steps + 1))

    step = {n: median("step_s", n) for n in OPTIMS}
    # Why Muon's update weighs so much here: a rank's Newton-Schulz FLOPs over its forward and
    # backward's 6 x parameters x its tokens (a 256-token share of a step is tiny)
    ns_per_rank = max(owner_plan(model, layout)["loads"])
    model_flops = 6 * sum(math.prod(s) for s in parameter_shapes(model).values()) \
        * layout.global_batch_size * SEQ // WORLD
    update = {n: median("update_s", n) for n in OPTIMS}
    timing = {
        "setup": f"{WORLD} gloo ranks, model=small, WS {SHARDS}, {layout.global_batch_size} x "
                 f"{SEQ} tokens a step ({MICRO_BATCHES} micro-batches of {MICRO} a rank), fp32, "
                 f"{steps} timed steps each, alternating",
        "step_s": {n: round(t, 3) for n, t in step.items()},
        "update_s": {n: round(t, 3) for n, t in update.items()},
        "muon_update_share_of_step": round(update["muon"] / step["muon"], 3),
        "step_time_muon_over_adamw": round(step["muon"] / step["adamw"], 3),
        "ns_flops_per_rank_over_6_n_tokens": round(ns_per_rank / model_flops, 3),
        "step_time_difference_over_update_difference": round(
            (step["muon"] - step["adamw"]) / (update["muon"] - update["adamw"]), 3),
    }
    # bytes: Muon's update over AdamW's, per rank, keyed by its slot (the tile rank: R = 1)
    extra = {r["tile_rank"]: {op: b - r["bytes"]["adamw"].get(op, 0)
                              for op, b in r["bytes"]["muon"].items()} for r in ranks}
    analytic = analytic_bytes(model, layout)
    measured = [sum(extra[t].values()) for t in range(len(analytic))]
    busiest = max(range(len(analytic)), key=lambda t: measured[t])
    sent = {
        "measured_by_rank": measured, "analytic_by_rank": analytic,
        "by_op_rank0": extra[0], "adamw_update_bytes_rank0": ranks[0]["bytes"]["adamw"],
        "busiest_rank_over_analytic": round(measured[busiest] / analytic[busiest], 4),
        "sum_over_analytic": round(sum(measured) / sum(analytic), 4),
    }
    return timing, sent, ranks


# ---------------------------------------------------------------------- one process: the loss

def _rank_loss(rank: int, cfg: OptimConfig, lr: float, steps: int) -> dict:
    from trainer.data.dataset import TokenDataset, builtin_corpus
    from trainer.data.stream import SampleStream
    from trainer.train.batch import rank_micro_batches
    from trainer.train.engine import build_engine
    from trainer.train.step import evaluate, train_step

    layout = Layout(1, micro_batch_size=LOSS_MICRO, seq_length=LOSS_SEQ,
                    global_batch_size=LOSS_MICRO)
    corpus = TokenDataset.open(builtin_corpus(None, 0.01))
    train = SampleStream(corpus, "train", LOSS_SEQ, 1234, True)
    valid = SampleStream(corpus, "valid", LOSS_SEQ, 1234, False)
    engine = build_engine(LOSS_MODEL, cfg, 1234, layout, torch.device("cpu"))
    warmup, losses = max(1, steps // 10), []
    for step in range(steps):
        progress = max(0.0, (step - warmup) / max(1, steps - warmup))
        rate = lr * (step + 1) / warmup if step < warmup else \
            lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        batch = rank_micro_batches(train.get, layout, 0, offset=step * LOSS_MICRO)
        losses.append(train_step(engine.model, engine.optimizer, batch, rate).loss)
    eval_batches = [mb for i in range(0, EVAL_SAMPLES, LOSS_MICRO)
                    for mb in rank_micro_batches(valid.get, layout, 0, offset=i)]
    return {"valid_loss": evaluate(engine.model, eval_batches),
            "last_train_loss": statistics.mean(losses[-10:])}


def loss_sweep(steps: int) -> dict:
    found = {name: {lr: run_ranks(1, _rank_loss, cfg, lr, steps, timeout=600)[0]
                    for lr in LRS[name]} for name, cfg in OPTIMS.items()}
    best = {name: min(runs, key=lambda lr: runs[lr]["valid_loss"]) for name, runs in found.items()}
    return {
        "setup": f"one process, {LOSS_MODEL.num_layers} layers, hidden {LOSS_MODEL.hidden_size}, "
                 f"byte vocabulary, built-in corpus, {steps} steps of {LOSS_MICRO} x {LOSS_SEQ} "
                 f"tokens, lr {LRS} (10% warmup, cosine to 0.1), validation loss on "
                 f"{EVAL_SAMPLES} fixed samples",
        "valid_loss": {n: {str(lr): round(r["valid_loss"], 4) for lr, r in runs.items()}
                       for n, runs in found.items()},
        "last10_train_loss": {n: {str(lr): round(r["last_train_loss"], 4)
                                  for lr, r in runs.items()} for n, runs in found.items()},
        "best_lr": {n: best[n] for n in found},
        "best_lr_at_grid_edge": {n: best[n] in (LRS[n][0], LRS[n][-1]) for n in found},
        "best_valid_loss": {n: round(found[n][best[n]]["valid_loss"], 4) for n in found},
        "loss_muon_over_adamw": round(found["muon"][best["muon"]]["valid_loss"]
                                      / found["adamw"][best["adamw"]]["valid_loss"], 4),
    }


# --------------------------------------------------------------------------------- the section

def _figure(value: float, goal: str) -> dict:
    return {"value": value, "goal": goal, "met": met(value, goal)}


def measure(quick: bool = True) -> dict:
    timing, sent, ranks = steps_and_bytes(2 if quick else 4)
    small, seed_model, seed = owner_plan(preset_model("small"), ws4_layout()), *seed_layout()
    seed_plan = owner_plan(seed_model, seed)
    # The ranks' own owners (every rank computes the same list) against the pure computation.
    real_match = all(r["owner"] == small["owner"] and r["costs"] == small["costs"]
                     and r["buffers"] == 1 for r in ranks)
    balance = {
        "small_ws4_slots": len(small["loads"]),
        "small_ws4_max_over_mean": round(imbalance(small["loads"]), 4),
        "seed_example": f"{SEED_PRESET.stem}: llama3_1_8b, TP {seed.tp_size}, WS "
                        f"{seed.tensor_parallel_num_weight_shards}, {seed.world_size} ranks, "
                        f"{len(seed_plan['costs'])} matrices over {len(seed_plan['loads'])} slots",
        "seed_example_max_over_mean": round(imbalance(seed_plan["loads"]), 4),
        "ranks_assign_the_same_owners": real_match,
    }
    loss = loss_sweep(200 if quick else 500)
    return {
        "step_time_muon_over_adamw": _figure(timing["step_time_muon_over_adamw"], "-"),
        "muon_update_share_of_step": _figure(timing["muon_update_share_of_step"], "-"),
        "exchange_bytes_busiest_over_analytic": _figure(sent["busiest_rank_over_analytic"],
                                                        "1.00"),
        "exchange_bytes_sum_over_analytic": _figure(sent["sum_over_analytic"], "1.00"),
        "ns_flops_max_over_mean_small_ws4": _figure(balance["small_ws4_max_over_mean"], "<= 1.2"),
        "ns_flops_max_over_mean_seed": _figure(balance["seed_example_max_over_mean"], "<= 1.2"),
        "owners_match_ranks": _figure(float(real_match), "1"),
        "loss_muon_over_adamw": _figure(loss["loss_muon_over_adamw"], "<= 1.0"),
        "details": {"timing": timing, "bytes": sent, "balance": balance, "loss": loss},
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="more timed and training steps")
    print(json.dumps(measure(quick=not parser.parse_args().full), indent=1))
