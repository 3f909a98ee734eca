"""Gemma 3's block trains the same model under every axis as one process: losses, gradient norms
and every weight (test_parity's method and tolerances), three steps on real gloo ranks.

The tiny model has each of Gemma 3's parts: zero-centred norms (the qk norms too) computed in
fp32, a norm after the attention and after the MLP (sandwich_norm), GeGLU, the embedding scaled
by sqrt(hidden), the windowed blocks' own rotary base and the global ones' linear scaling, a
softmax scale of its own, and 5:1 windowed to global blocks. What each layout reaches: the
post-norms are whole weights on the residual stream's tokens (their gradients summed over TP
under SP, over weight shards always); the scale multiplies the vocab-parallel embedding's
output on the first stage only; CP's window exchange serves the windowed blocks and the ring
the global one.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from trainer.config import CPCommType, Precision
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

# 6 blocks, 5 windowed (5 back) and block 5 global; 4 heads of 32 over 2 K/V groups; a softmax
# scale of 24 ** -0.5 where the heads are 32 wide (27B's query_pre_attn_scalar differs from
# its head_dim too).
GEMMA3 = replace(TINY, name="gemma3", num_layers=6, num_query_groups=2, kv_channels=32,
                 qk_layernorm=True, layernorm_zero_centered_gamma=True, sandwich_norm=True,
                 scale_embedding=True, activation_func="fast_gelu", rope_theta=1e6,
                 rotary_base_local=10000.0, seq_len_interpolation_factor=8.0,
                 softmax_scale=24 ** -0.5, window_size=5, window_attn_skip_freq=6,
                 tie_word_embeddings=True)
TP2_SP = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
LAYOUTS = LAYOUTS | {"pp2": (2, {"pipeline_model_parallel_size": 2})}
P2P = EngineOptions(cp_comm_type=CPCommType.p2p)
CASES = [  # (layout, options)
    ("tp2_sp", EngineOptions()),
    ("cp2", P2P),
    ("ws4_ss2", EngineOptions()),
    ("pp2", EngineOptions()),
    ("every_axis", P2P),  # TP 2 x SP x WS x SS x CP on 8 ranks
    ("cp2", EngineOptions(cp_comm_type=CPCommType.a2a)),
]


@pytest.fixture(scope="module")
def references():
    return reference_cache()


@pytest.mark.parametrize("name,options", [
    pytest.param(*c, id=f"{c[0]}_{c[1].cp_comm_type.value}" if "cp" in c[0] else c[0])
    for c in CASES])
def test_gemma3_matches_one_process(name, options, references):
    world, kwargs = LAYOUTS[name]
    layout = make_layout(world, kwargs)
    batches, ref = references(layout.global_batch_size, torch.float64, GEMMA3)
    results = run_ranks(world, train_rank, layout, batches, torch.float64, options, GEMMA3,
                        timeout=120)
    assert_parity(results, ref, torch.float64, f"gemma3 {name} (world {world})")
    # the zero-centred norms trained away from zero, the post-norms and qk norms included
    for norm in ("attn_norm", "post_attn_norm", "post_mlp_norm", "attn.q_norm"):
        assert ref["params"][f"layers.0.{norm}.weight"].abs().max() > 1e-4, norm


def test_bf16_gemma3_trains_close_to_fp32(references):
    """bf16 under TP with SP (test_parity's bound): the zero-centred norms in fp32, the
    embedding's scale rounded to bf16 (8.0 exactly here); close to fp32, and not equal."""
    world, kwargs = LAYOUTS["tp2_sp"]
    layout = make_layout(world, kwargs)
    batches, ref = references(layout.global_batch_size, torch.float32, GEMMA3)
    got = run_ranks(world, train_rank, layout, batches, torch.float32,
                    EngineOptions(Precision.bf16), GEMMA3, timeout=120)[0]
    assert_close_to_fp32(got, ref, "bf16 gemma3 tp2_sp")
