"""Qwen3-Next's hybrid trains the same model under the layout as one process: losses, gradient
norms and every weight (test_parity's method and tolerances: fp64 at 1e-10), three steps on
real gloo ranks.

The tiny hybrid has each of its parts: one gated full-attention block then three Gated DeltaNet
blocks (partial rotary, qk norms, zero-centred norms), experts with a gated shared expert in
every block. What each layout reaches: TP splits each of in_proj's six parts by heads (a key
head with its value heads), and each rank reads its heads' convolution channels,
A_log and dt_bias through heads_fn, their gradients (and the gated norm's) summed over TP; SP
gathers the sequence before the projections; GTP_remat shards the projections' rows; PP cuts
between linear and full blocks; EP (ETP = TP) splits the experts, the shared expert's gate
whole on every rank; recompute replays the convolution and the rule (selective: the hook).
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
    make_layout,
    reference_cache,
    train_rank,
)

HYBRID = replace(
    TINY, name="qwen3_next", num_layers=4, num_query_groups=2, kv_channels=16,
    qk_layernorm=True, attention_output_gate=True, rotary_percent=0.25,
    layernorm_zero_centered_gamma=True, norm_eps=1e-6,
    experimental_attention_variant="gated_delta_net", linear_attention_freq=[0, 1, 1, 1],
    linear_key_head_dim=16, linear_value_head_dim=8, linear_num_key_heads=2,
    linear_num_value_heads=4, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
    moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True)
LAYOUTS = LAYOUTS | {
    "pp2": (2, {"pipeline_model_parallel_size": 2}),
    "tp2_sp_ep2": (4, {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                       "expert_model_parallel_size": 2}),
}
SELECTIVE = EngineOptions(recompute_granularity=RecomputeGranularity.selective)
FULL = EngineOptions(recompute_granularity=RecomputeGranularity.full)
CASES = [  # (layout, options)
    ("tp2_sp_ep2", EngineOptions()),
    ("ws4_ss2", SELECTIVE),  # runtime CP 2 (sequence shards): the relay
    ("pp2", FULL),
    ("cp4", EngineOptions(cp_comm_type=CPCommType.p2p)),  # the relay up 4 ranks and back
    ("cp2", EngineOptions(cp_comm_type=CPCommType.a2a)),
    ("cp2", EngineOptions(cp_comm_type=CPCommType.all_gather)),
]


@pytest.fixture(scope="module")
def references():
    return reference_cache()


def case_id(name: str, options: EngineOptions) -> str:
    if options.recompute_granularity:
        return f"{name}_{options.recompute_granularity.value}"
    return f"{name}_{options.cp_comm_type.value}" if "cp" in name else name


@pytest.mark.parametrize("name,options", [pytest.param(*c, id=case_id(*c)) for c in CASES])
def test_hybrid_matches_one_process(name, options, references):
    world, kwargs = LAYOUTS[name]
    layout = make_layout(world, kwargs)
    batches, ref = references(layout.global_batch_size, torch.float64, HYBRID)
    results = run_ranks(world, train_rank, layout, batches, torch.float64, options, HYBRID,
                        timeout=180)
    assert_parity(results, ref, torch.float64, f"qwen3_next {name} (world {world})")
    # the whole per-head weights trained (their gradients reached every rank's heads)
    for weight in ("attn.conv_weight", "attn.A_log", "attn.dt_bias", "attn.norm.weight",
                   "mlp.shared_gate.weight"):
        assert ref["params"][f"layers.1.{weight}"].abs().max() > 1e-4, weight


def test_bf16_hybrid_trains_close_to_fp32(references):
    """bf16 under TP with SP (test_parity's bound): the rule in fp32, close to fp32."""
    world, kwargs = LAYOUTS["tp2_sp"]
    layout = make_layout(world, kwargs)
    batches, ref = references(layout.global_batch_size, torch.float32, HYBRID)
    got = run_ranks(world, train_rank, layout, batches, torch.float32,
                    EngineOptions(Precision.bf16), HYBRID, timeout=180)[0]
    assert_close_to_fp32(got, ref, "bf16 qwen3_next tp2_sp")
