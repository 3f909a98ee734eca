"""Qwen3-Next's hybrid (conf/model/tiny_qwen3_next.yaml: three Gated DeltaNet blocks to one gated
full-attention block) against the same model with every block full attention.

- One process, 8,192 tokens: the median of alternating steps of the two, and where the time
  goes: the linear blocks' core (the convolution and the chunked rule, forward and backward)
  against softmax attention's core (the fused kernel) at the same length, each timed alone on
  the model's shapes.
- CP 4 by p2p, 4 gloo ranks, 2,048 tokens: the bytes the busiest rank sends over the context
  group in a step. A linear block's are the relay's: each boundary between two chunks of
  different ranks carries a state (value heads x key_dim x value_dim, fp32, a sample) and the
  convolution's last width-1 inputs of q|k|v, forward, and their gradients back; a middle rank
  owns four such boundaries a micro-batch (two in, two out). Measured as the hybrid's bytes
  less its full block's share of the all-full model's (the ring), per linear block, over that
  analytic count (goal 1.00), and over what the ring exchanges for one full block.

    python bench/hybrid.py
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from ranks import run_ranks  # noqa: E402
from window import OPTIM, _alternate  # noqa: E402

from parallel.layout import Layout  # noqa: E402
from trainer.config import CPCommType, ModelConfig  # noqa: E402

ONE_SEQ, CP, CP_SEQ = 8192, 4, 2048
HYBRID = ModelConfig(**OmegaConf.to_container(OmegaConf.load(
    HERE.parent / "conf" / "model" / "tiny_qwen3_next.yaml")))
# the same blocks, every one full attention (the family asks for linear ones: llama's name)
FULL = replace(HYBRID, name="llama", experimental_attention_variant=None,
               linear_attention_freq=None)


def _engines_alternate(rank: int, layout: Layout, steps: int, seq: int, comm: str) -> dict:
    import window
    saved = window.MODEL, window._engines
    window.MODEL = HYBRID  # its vocabulary for the batch

    def engines(layout, configs):
        from trainer.plan.options import EngineOptions
        from trainer.train.engine import build_engine
        return {name: build_engine(model, OPTIM, 0, layout, torch.device("cpu"),
                                   EngineOptions(cp_comm_type=CPCommType(comm)))
                for name, model in (("hybrid", HYBRID), ("full", FULL))}
    window._engines = engines
    try:
        return _alternate(rank, layout, [("hybrid", comm, None), ("full", comm, None)], steps,
                          seq)
    finally:
        window.MODEL, window._engines = saved


def _cores(seq: int, repeats: int) -> dict:
    """Forward and backward of one linear block's core and of one full block's attention core
    on the model's shapes, at `seq` tokens, the median of `repeats`."""
    from trainer.model.gdn import linear_attention
    m = HYBRID
    gen = torch.Generator().manual_seed(0)
    channels = 2 * m.linear_key_size + m.linear_value_size
    heads = m.linear_num_value_heads
    linear_in = [torch.randn(1, seq, channels, generator=gen),
                 torch.randn(channels, m.linear_conv_kernel_dim, generator=gen) * 0.5,
                 -torch.rand(1, seq, heads, generator=gen),
                 torch.rand(1, seq, heads, generator=gen)]
    dims = (m.linear_key_head_dim, m.linear_value_head_dim)
    q = torch.randn(1, m.num_heads, seq, m.head_dim, generator=gen)
    kv = [torch.randn(1, m.query_groups, seq, m.head_dim, generator=gen) for _ in range(2)]

    def linear():
        inputs = [t.clone().requires_grad_(True) for t in linear_in]
        out, _ = linear_attention(*inputs, None, dims)
        out.sum().backward()

    def softmax():
        inputs = [t.clone().requires_grad_(True) for t in (q, *kv)]
        F.scaled_dot_product_attention(*inputs, is_causal=True, enable_gqa=True).sum().backward()
    times = {"linear": [], "softmax": []}
    for _ in range(repeats + 1):
        for name, fn in (("linear", linear), ("softmax", softmax)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def one_process(steps: int) -> dict:
    layout = Layout(1, seq_length=ONE_SEQ)
    times = run_ranks(1, _engines_alternate, layout, steps, ONE_SEQ, "p2p",
                      timeout=1800)[0]["times"]
    median = {name: statistics.median(t) for name, t in times.items()}
    cores = _cores(ONE_SEQ, steps)
    linear = sum(HYBRID.is_linear_block(i) for i in range(HYBRID.num_layers))
    return {"setup": f"one process, 1 x {ONE_SEQ} tokens, conf/model/tiny_qwen3_next.yaml "
                     f"({linear} linear blocks, {HYBRID.num_layers - linear} full) against its "
                     f"blocks all full attention, fp32, {steps} timed steps",
            "step_s": {name: round(t, 3) for name, t in median.items()},
            "step_time_hybrid_over_full": round(median["hybrid"] / median["full"], 3),
            "core_s": {name: round(t, 4) for name, t in cores.items()},
            "linear_core_over_softmax_core": round(cores["linear"] / cores["softmax"], 2),
            "where_the_time_goes": {
                "linear_cores_s": round(linear * cores["linear"], 3),
                "softmax_cores_s": round((HYBRID.num_layers - linear) * cores["softmax"], 3),
                "all_full_cores_s": round(HYBRID.num_layers * cores["softmax"], 3)}}


def context_parallel(steps: int) -> dict:
    layout = Layout(CP, context_parallel_size=CP, seq_length=CP_SEQ)
    layout = replace(layout, global_batch_size=layout.batch_parallel_size)
    ranks = run_ranks(CP, _engines_alternate, layout, steps, CP_SEQ, "p2p", timeout=1800)
    busiest = {name: max(r["sent"][name] for r in ranks) for name in ("hybrid", "full")}
    m, b = HYBRID, layout.micro_batch_size
    linear = sum(m.is_linear_block(i) for i in range(m.num_layers))
    ring = busiest["full"] / m.num_layers  # one full block's ring, the busiest rank's
    measured = (busiest["hybrid"] - (m.num_layers - linear) * ring) / linear
    channels = 2 * m.linear_key_size + m.linear_value_size
    boundary = b * (m.linear_num_value_heads * m.linear_key_head_dim * m.linear_value_head_dim
                    + (m.linear_conv_kernel_dim - 1) * channels) * 4  # fp32
    analytic = 4 * boundary * layout.num_microbatches
    median = {name: statistics.median(max(r["times"][name][i] for r in ranks)
                                      for i in range(steps)) for name in ("hybrid", "full")}
    return {"setup": f"{CP} gloo ranks, CP {CP} p2p, 1 x {CP_SEQ} tokens, "
                     f"conf/model/tiny_qwen3_next.yaml and its blocks all full attention, fp32, "
                     f"{steps} timed steps",
            "busiest_rank_bytes": busiest,
            "linear_block_bytes": round(measured),
            "linear_block_analytic_bytes": analytic,
            "linear_bytes_over_analytic": round(measured / analytic, 4),
            "linear_bytes_over_ring": round(measured / ring, 4),
            "step_s": {name: round(t, 3) for name, t in median.items()}}


def measure(quick: bool = True) -> dict:
    return {"one_process": one_process(3 if quick else 6),
            "context_parallel": context_parallel(2 if quick else 4)}


if __name__ == "__main__":
    print(json.dumps(measure(), indent=1))
