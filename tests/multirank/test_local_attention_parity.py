"""Sliding windows and attention sinks train the same model under every axis as one process:
losses, gradient norms and every weight (test_parity's method and tolerances), three steps on
real gloo ranks. The one process itself is checked against a dense masked softmax with a sink
column in tests/unit/test_local_attention.py, and against transformers' gpt-oss.

What each layout reaches: p2p with a window that reaches at most two other chunks runs the
window's exchange (parallel/context/window.py: only the chunks it reaches, from their owners):
at runtime CP 2 (chunks of 8, a window of 5), 4 (chunks of 4, a window of 3) and 8 (chunks of
2, a window of 1); a longer window runs the ring, which skips the pairs it never reaches (CP 4
with a window of 5, and one past the sequence); all_gather and a2a run the window's calls over
the whole sequence; the sinks are
joined once after every merge, narrowed to a TP rank's heads (parallel.tensor._HeadsOfRank) and
under a2a to the context rank's; their gradients summed over TP as a per-head weight's.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from trainer.config import CPCommType, Precision, RecomputeGranularity
from trainer.plan.options import EngineOptions

from harness import run_ranks
from test_parity import (
    LAYOUTS,
    TINY,
    assert_close_to_fp32,
    assert_parity,
    case_id,
    make_layout,
    reference_cache,
    relative,
    train_rank,
)

# gpt-oss's pattern on a tiny model: block 0 windowed (5 back), block 1 global, a learnable
# sink per head, 8 heads over 4 K/V groups.
GPT_OSS = replace(TINY, num_heads=8, num_query_groups=4, window_size=5, window_attn_skip_freq=2,
                  softmax_type="learnable")
MODELS = {
    "gpt_oss": GPT_OSS,
    "window": replace(TINY, num_heads=8, window_size=5),  # every block windowed, no sinks
    "sinks": replace(TINY, num_heads=8, softmax_type="learnable"),  # sinks, full attention
    "off_by_one": replace(TINY, num_heads=8, window_size=3, softmax_type="off-by-one"),
    "wide": replace(GPT_OSS, window_size=40),  # reaches every chunk: the ring, with sinks
    "gpt_oss_w3": replace(GPT_OSS, window_size=3),  # CP 4's exchange
    "gpt_oss_w1": replace(GPT_OSS, window_size=1),  # runtime CP 8's exchange
    "gpt_oss_4_layers": replace(GPT_OSS, num_layers=4),
}
TP2 = {"tensor_model_parallel_size": 2}
P2P, ALL_GATHER, A2A = CPCommType.p2p, CPCommType.all_gather, CPCommType.a2a
SELECTIVE = EngineOptions(recompute_granularity=RecomputeGranularity.selective)
FULL = EngineOptions(recompute_granularity=RecomputeGranularity.full)
LAYOUTS = LAYOUTS | {
    "tp2_sp_cp2": (4, TP2 | {"sequence_parallel": True, "context_parallel_size": 2}),
    "pp2": (2, {"pipeline_model_parallel_size": 2}),
}
CASES = [  # (layout, model, dtype, options)
    ("dp2", "gpt_oss", torch.float64, EngineOptions()),
    ("tp2_sp", "gpt_oss", torch.float64, EngineOptions()),
    ("tp2", "sinks", torch.float64, EngineOptions()),
    ("ws4_ss2", "gpt_oss", torch.float64, EngineOptions()),
    ("cp2", "gpt_oss", torch.float64, EngineOptions(cp_comm_type=P2P)),
    ("cp4", "gpt_oss", torch.float64, EngineOptions(cp_comm_type=P2P)),
    ("runtime_cp8", "gpt_oss_w1", torch.float64, EngineOptions(cp_comm_type=P2P)),
    ("cp4", "gpt_oss_w3", torch.float64, EngineOptions(cp_comm_type=P2P)),
    ("cp4", "gpt_oss", torch.float32, EngineOptions(cp_comm_type=P2P)),
    ("cp4", "window", torch.float64, EngineOptions(cp_comm_type=P2P)),
    ("cp4", "off_by_one", torch.float64, EngineOptions(cp_comm_type=P2P)),
    ("cp4", "sinks", torch.float64, EngineOptions(cp_comm_type=P2P)),
    ("cp4", "wide", torch.float64, EngineOptions(cp_comm_type=P2P)),
    ("cp4", "gpt_oss", torch.float64, EngineOptions(cp_comm_type=ALL_GATHER)),
    ("cp2", "gpt_oss", torch.float64, EngineOptions(cp_comm_type=A2A)),
    ("tp2_sp_cp2", "gpt_oss", torch.float64, EngineOptions(cp_comm_type=A2A)),
    ("every_axis", "gpt_oss", torch.float64, EngineOptions(cp_comm_type=P2P)),
    ("pp2", "gpt_oss_4_layers", torch.float64, SELECTIVE),
    ("cp2_ws2_ss2", "gpt_oss", torch.float32, replace(FULL, cp_comm_type=P2P)),
]


@pytest.fixture(scope="module")
def references():
    return reference_cache()


@pytest.mark.parametrize("name,model,dtype,options", [pytest.param(*c, id=case_id(c))
                                                       for c in CASES])
def test_local_attention_matches_one_process(name, model, dtype, options, references):
    world, kwargs = LAYOUTS[name]
    layout = make_layout(world, kwargs)
    cfg = MODELS[model]
    batches, ref = references(layout.global_batch_size, dtype, cfg)
    results = run_ranks(world, train_rank, layout, batches, dtype, options, cfg, timeout=120)
    assert_parity(results, ref, dtype, f"{model} {name} (world {world})")
    if cfg.softmax_type == "learnable":  # the sinks trained, and alike on every rank
        for result in (r for r in results if "layers.0.attn.sinks" in (r["params"] or {})):
            assert relative(result["params"]["layers.0.attn.sinks"],
                            ref["params"]["layers.0.attn.sinks"]) <= 1e-5
        assert ref["params"]["layers.0.attn.sinks"].abs().min() > 0  # moved from zero


def test_bf16_local_attention_trains_close_to_fp32(references):
    """bf16 under TP with SP and CP p2p's window exchange (test_parity's bound): close to fp32,
    and not equal."""
    world, kwargs = LAYOUTS["tp2_sp_cp2"]
    layout = make_layout(world, kwargs)
    batches, ref = references(layout.global_batch_size, torch.float32, GPT_OSS)
    got = run_ranks(world, train_rank, layout, batches, torch.float32,
                    EngineOptions(Precision.bf16, cp_comm_type=P2P), GPT_OSS, timeout=120)[0]
    assert_close_to_fp32(got, ref, "bf16 gpt_oss tp2_sp_cp2 p2p")
