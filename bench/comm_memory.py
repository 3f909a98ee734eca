"""Bytes moved and bytes held per rank, measured on real gloo ranks, over an analytic model.

The analytic model is worked out here from the layout and the model's shapes alone: the
collectives the algorithm needs (GTP_remat gathers each linear weight in forward and again in
backward, the embedding once; TP+SP gathers before and reduce-scatters after each pair of
layers, both ways; CP (the ring, cp_comm_type=p2p) sends K/V c-1 hops per layer forward and
again backward, and their gradients c hops; gradients are reduce-scattered), each costed like
parallel/comm.py (ring: all-gather and reduce-scatter (n-1) x shard, all-reduce 2(n-1)/n).
A ratio of 1.00 means no redundant traffic. Memory: parameters + gradients + AdamW state per
rank over params/(TP x G) + the same for gradients + 2 moments/(weight replicas).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import torch
from ranks import run_ranks

from parallel.layout import Layout
from trainer.config import ModelConfig, OptimConfig
from trainer.train.engine import build_engine
from trainer.train.step import MicroBatch, train_step

MODEL = ModelConfig(name="llama", vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
                    ffn_hidden_size=176, rope_theta=10000.0, norm_eps=1e-5, init_std=0.02)
OPTIM = OptimConfig(name="adamw", weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8,
                    clip_grad=1.0)
MICRO, SEQ, MICRO_BATCHES, F32, F64 = 2, 64, 2, 4, 8
LAYOUTS = {
    "gtp_ws4": (4, dict(tensor_parallel_num_weight_shards=4)),
    "gtp_ws4_ss2": (4, dict(tensor_parallel_num_weight_shards=4,
                            tensor_parallel_num_sequence_shards=2)),
    "cp2": (2, dict(context_parallel_size=2)),
    "tp2_sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "ws2_dp2": (4, dict(tensor_parallel_num_weight_shards=2)),
}


def make_layout(world: int, kwargs: dict) -> Layout:
    layout = Layout(world, micro_batch_size=MICRO, seq_length=SEQ, **kwargs)
    return replace(layout, global_batch_size=MICRO * layout.batch_parallel_size * MICRO_BATCHES)


def one_step(rank: int, layout: Layout) -> dict:
    from parallel.context import keep_local, local_positions

    engine = build_engine(MODEL, OPTIM, 0, layout, torch.device("cpu"))
    keep = local_positions(layout, rank)
    gen = torch.Generator().manual_seed(rank)  # content does not change the byte counts
    samples = [torch.randint(0, MODEL.vocab_size, (MICRO, SEQ + 1), generator=gen)
               for _ in range(layout.num_microbatches)]
    positions = torch.arange(SEQ).expand(MICRO, -1)
    batches = [MicroBatch(keep_local(s[:, :-1], keep), keep_local(s[:, 1:], keep),
                          keep_local(positions, keep)) for s in samples]
    engine.groups.stats.reset()
    train_step(engine.model, engine.optimizer, batches, 1e-3)
    by_op: dict[str, int] = defaultdict(int)
    for (_, op), nbytes in engine.groups.stats.bytes.items():
        by_op[op] += nbytes
    opt = engine.optimizer
    held = {
        "params": sum(b.params.numel() for b in opt.buffers) * F32,
        "grads": sum(b.grads.numel() for b in opt.buffers) * F32,
        "optimizer": sum(t.numel() for state in opt.adam.state.values()
                         for k, t in state.items() if k != "step") * F32,
    }
    return {"bytes": dict(by_op), "held": held}


def _ring(op: str, n: int, nbytes: int) -> int:
    if n == 1:
        return 0
    return 2 * (n - 1) * nbytes // n if op == "all_reduce" else (n - 1) * nbytes


def analytic_bytes(layout: Layout) -> dict[str, int]:
    t, g, c, r = layout.tp_size, layout.gtp_remat_size, layout.runtime_context_parallel_size, \
        layout.num_weight_replicas
    h, f, v, layers = MODEL.hidden_size, MODEL.ffn_hidden_size, MODEL.vocab_size, MODEL.num_layers
    m, local_seq = layout.num_microbatches, SEQ // c
    matrices = {"embed": (v, h), "head": (v, h)}
    for i in range(layers):
        matrices |= {f"{i}.qkv": (3 * h, h), f"{i}.o": (h, h), f"{i}.gate_up": (2 * f, h),
                     f"{i}.down": (h, f)}
    shard = {}
    for name, (rows, cols) in matrices.items():
        column = not name.endswith((".o", ".down"))  # row-parallel layers split the columns
        local_rows, local_cols = (rows // t, cols) if column else (rows, cols // t)
        shard[name] = layout.shard_rows(local_rows) * local_cols * F32
    norms = (2 * layers + 1) * h * F32
    out = defaultdict(int)
    # GTP_remat, per micro-batch: linears gathered twice (remat), the embedding once.
    out["all_gather"] += m * sum(_ring("all_gather", g, b) * (1 if n == "embed" else 2)
                                 for n, b in shard.items())
    out["reduce_scatter"] += m * sum(_ring("reduce_scatter", g, b) for b in shard.values())
    out["all_reduce"] += _ring("all_reduce", g, norms)
    # TP with SP, per micro-batch: 2L+1 gathers and 2L+1 reduce-scatters forward, duals backward.
    act = MICRO * local_seq * h * F32
    out["all_gather"] += m * 2 * (2 * layers + 1) * _ring("all_gather", t, act // t)
    out["reduce_scatter"] += m * 2 * (2 * layers + 1) * _ring("reduce_scatter", t, act // t)
    out["all_reduce"] += m * 3 * _ring("all_reduce", t, MICRO * local_seq * F32)  # CE
    out["all_reduce"] += _ring("all_reduce", t, norms) if layout.sequence_parallel else 0
    # CP, per micro-batch and layer, the ring: K/V c-1 hops forward and c-1 backward, their
    # gradients c hops (the last one home).
    kv = 2 * MICRO * local_seq * (h // t) * F32
    out["p2p"] += m * layers * (2 * (c - 1) + c) * kv if c > 1 else 0
    # The optimizer over weight replicas: both flat buffers reduce-scattered and gathered.
    sharded_numel = sum(shard.values()) // F32
    for numel in (sharded_numel, norms // F32):
        part = layout.optimizer_part(numel) * F32
        out["reduce_scatter"] += _ring("reduce_scatter", r, part)
        out["all_gather"] += _ring("all_gather", r, part)
    # Scalars over token_distinct: the loss-token and empty-sample counts and the loss sum;
    # the gradient norm over the world.
    token_distinct = layout.world_size // (t * layout.pp_size)
    out["all_reduce"] += 3 * _ring("all_reduce", token_distinct, F64)
    out["all_reduce"] += _ring("all_reduce", layout.world_size, F64)
    return {op: b for op, b in out.items() if b}


def analytic_memory(layout: Layout) -> int:
    """params/(TP x G) unpadded, the same for gradients, two fp32 moments over the replicas."""
    h, f, v, layers = MODEL.hidden_size, MODEL.ffn_hidden_size, MODEL.vocab_size, MODEL.num_layers
    matrices = 2 * v * h + layers * (4 * h * h + 3 * h * f)  # embed, head; qkv+o, gate_up+down
    local = matrices / layout.weight_tile_size + (2 * layers + 1) * h
    return round(F32 * (2 * local + 2 * local / layout.num_weight_replicas))


def measure(quick: bool = True) -> dict:
    results = {}
    for name, (world, kwargs) in LAYOUTS.items():
        layout = make_layout(world, kwargs)
        ranks = run_ranks(world, one_step, layout)
        measured, analytic = ranks[0]["bytes"], analytic_bytes(layout)
        held = ranks[0]["held"]
        results[name] = {
            "world": world,
            "bytes_per_step": measured,
            "analytic_bytes_per_step": analytic,
            "ratio_by_op": {op: round(measured.get(op, 0) / b, 4) for op, b in analytic.items()},
            "unexpected_ops": sorted(set(measured) - set(analytic)),
            "held_bytes": held,
            "analytic_held_bytes": analytic_memory(layout),
            "memory_ratio": round(sum(held.values()) / analytic_memory(layout), 4),
        }
    return results
