"""Multi-latent attention (DeepSeek-V3's, with YaRN) trains the same model under every axis as
one process: losses, gradient norms and every weight (test_parity's method and tolerances),
three steps on real gloo ranks.

What each layout reaches in the part: TP splits the up-projections by heads while the
down-projections stay whole (their gradients summed over TP under SP, not without); the shared
rotary key is gathered over SP or its gradient summed over TP (parallel.tensor._SharedOverTP);
context parallel's exchanges take values narrower than q and k (parallel.context.NarrowValues);
weight and sequence shards, pipeline stages and recompute take the part as any other. A
mixture of experts with MLA (tiny_deepseek's block) is test_moe_parity's "deepseek" model.
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

# 4 heads of 16 + 8 rotary dims, values of 16 (narrower than q and k: 24), latents 24 and 32,
# YaRN stretched 40 times over a 16-token original context (the 32-token sequences reach past
# it) with DeepSeek-V3's softmax correction.
MLA = replace(TINY, multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=32,
              qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, rope_type="yarn",
              rotary_scaling_factor=40.0, original_max_position_embeddings=16,
              mscale=1.0, mscale_all_dim=1.0)
MODELS = {
    "mla": MLA,
    "mla_q_direct": replace(MLA, q_lora_rank=None, rope_type="rope"),  # DeepSeek-V2-Lite's q
    "mla_4_layers": replace(MLA, num_layers=4),
}
TP2 = {"tensor_model_parallel_size": 2}
TP2_SP = TP2 | {"sequence_parallel": True}
P2P, ALL_GATHER, A2A = CPCommType.p2p, CPCommType.all_gather, CPCommType.a2a
SELECTIVE = EngineOptions(recompute_granularity=RecomputeGranularity.selective)
FULL = EngineOptions(recompute_granularity=RecomputeGranularity.full)
INTERLEAVED = EngineOptions(pipeline_schedule="interleaved_1f1b")
LAYOUTS = LAYOUTS | {
    "tp2_sp_cp2": (4, TP2_SP | {"context_parallel_size": 2}),
    "pp2_virtual2": (2, {"pipeline_model_parallel_size": 2,
                         "virtual_pipeline_model_parallel_size": 2}),
}
# fp32 within 1e-5 where the reduction order leaves Adam nothing to amplify. Two layouts run in
# fp64 only: in fp32, tp2_ws4 reaches 5.2e-5 and every_axis 2.2e-5 on layers.1.attn.o.weight
# (losses within 6e-8, norms 1.3e-7), from one element whose first gradient is 7.2e-9, under
# Adam's eps: its rounding under another sum order becomes a step (test_parity's note); fp64
# agrees to 1e-12.
CASES = [  # (layout, model, dtype, options)
    ("dp2", "mla", torch.float64, EngineOptions()),
    ("tp2_sp", "mla", torch.float64, EngineOptions()),
    ("tp2", "mla", torch.float64, EngineOptions()),  # whole weights' gradients not summed
    ("tp2_ws4", "mla", torch.float64, EngineOptions()),
    ("ws4_ss2", "mla", torch.float64, EngineOptions()),
    ("cp2", "mla", torch.float64, EngineOptions(cp_comm_type=P2P)),
    ("cp2", "mla", torch.float32, EngineOptions(cp_comm_type=ALL_GATHER)),
    ("cp2", "mla", torch.float64, EngineOptions(cp_comm_type=A2A)),
    ("tp2_sp_cp2", "mla_q_direct", torch.float64, EngineOptions(cp_comm_type=A2A)),
    ("every_axis", "mla", torch.float64, EngineOptions(cp_comm_type=P2P)),
    ("pp2_virtual2", "mla_4_layers", torch.float64, INTERLEAVED),
    ("tp2_sp", "mla", torch.float64, SELECTIVE),
    ("cp2_ws2_ss2", "mla", torch.float32, replace(FULL, cp_comm_type=ALL_GATHER)),
]


@pytest.fixture(scope="module")
def references():
    return reference_cache()


@pytest.mark.parametrize("name,model,dtype,options", [pytest.param(*c, id=case_id(c))
                                                       for c in CASES])
def test_multi_latent_attention_matches_one_process(name, model, dtype, options, references):
    world, kwargs = LAYOUTS[name]
    layout = make_layout(world, kwargs)
    cfg = MODELS[model]
    batches, ref = references(layout.global_batch_size, dtype, cfg)
    results = run_ranks(world, train_rank, layout, batches, dtype, options, cfg, timeout=120)
    assert_parity(results, ref, dtype, f"MLA {model} {name} (world {world})")
    # the whole down-projections trained too (every rank's copy is the one process's)
    assert relative(results[0]["params"]["layers.0.attn.kv_down.weight"],
                    ref["params"]["layers.0.attn.kv_down.weight"]) <= 1e-5


def test_bf16_multi_latent_attention_trains_close_to_fp32(references):
    """bf16 under TP with SP and CP a2a (test_parity's bound): close to fp32, and not equal."""
    world, kwargs = LAYOUTS["tp2_sp_cp2"]
    layout = make_layout(world, kwargs)
    batches, ref = references(layout.global_batch_size, torch.float32, MLA)
    got = run_ranks(world, train_rank, layout, batches, torch.float32,
                    EngineOptions(Precision.bf16, cp_comm_type=A2A), MLA, timeout=120)[0]
    assert_close_to_fp32(got, ref, "bf16 MLA tp2_sp_cp2 a2a")
