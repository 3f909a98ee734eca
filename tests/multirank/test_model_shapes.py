"""Model shapes beyond multi-head attention train the same model as one process: grouped-query
attention with tied embeddings and Llama 3's rope scaling under TP, SP, weight shards,
sequence shards and every cp_comm_type, and a padded vocabulary (the parity suite's method
and tolerances, test_parity).

The padded model is compared with the *unpadded* one-process model: its padding rows are
never looked up and their logits are excluded from the loss, so the first vocab_size rows of
the embedding and head, and every other weight, train exactly as if the padding were absent.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from trainer.config import CPCommType
from trainer.plan.options import EngineOptions

from harness import run_ranks
from test_parity import LAYOUTS, TINY, assert_parity, make_layout, reference_cache, train_rank

# 8 query heads in 4 K/V groups (2 per TP rank under TP 2), head and embedding one weight,
# Llama 3's rope scaling (at global positions under CP, like the plain rotary embedding).
GQA_TIED = replace(TINY, num_heads=8, num_query_groups=4, tie_word_embeddings=True,
                   use_rope_scaling=True, rope_scaling_factor=32.0)
P2P, ALL_GATHER, A2A = CPCommType.p2p, CPCommType.all_gather, CPCommType.a2a
CASES = [("tp2_sp", P2P), ("tp2_ws4", P2P), ("ws4_ss2", P2P), ("cp2", P2P),
         ("cp2", ALL_GATHER), ("cp2", A2A), ("cp2_ws2_ss2", A2A), ("every_axis", P2P),
         ("every_axis", ALL_GATHER)]
# fp64 (to show the engine exact, as test_parity does) on the cases that reach every code path:
# the TP split of K/V groups, the ring's and a2a's grouped K/V, every axis at once.
FP64 = {("tp2_ws4", P2P), ("cp2", A2A), ("every_axis", P2P)}
PARAMS = [pytest.param(name, comm, dtype, id=f"{name}_{comm.value}-{label}")
          for name, comm in CASES
          for dtype, label in ((torch.float32, "fp32"), (torch.float64, "fp64"))
          if dtype == torch.float32 or (name, comm) in FP64]


@pytest.fixture(scope="module")
def references():
    return reference_cache()


@pytest.mark.parametrize("name,comm,dtype", PARAMS)
def test_grouped_query_attention_with_tied_embeddings_matches_one_process(name, comm, dtype,
                                                                          references):
    world, kwargs = LAYOUTS[name]
    layout = make_layout(world, kwargs)
    batches, ref = references(layout.global_batch_size, dtype, GQA_TIED)
    results = run_ranks(world, train_rank, layout, batches, dtype,
                        EngineOptions(cp_comm_type=comm), GQA_TIED, timeout=120)
    assert "head.weight" not in results[0]["params"]  # held once, as embed.weight
    assert results[0]["params"]["layers.0.attn.qkv.weight"].shape == (64 + 2 * 32, 64)
    assert_parity(results, ref, dtype, f"GQA tied {name} {comm.value} (world {world})")


@pytest.mark.parametrize("name", ["tp2", "tp2_ws4"])
def test_a_padded_vocabulary_trains_the_unpadded_model(name, references):
    """vocab 250 padded to 256: under TP 2 the second rank's last 6 logits are padding (and
    under weight shards its shard of them)."""
    unpadded = replace(TINY, vocab_size=250, make_vocab_size_divisible_by=1)
    padded = replace(TINY, vocab_size=250)
    assert padded.padded_vocab_size == 256
    world, kwargs = LAYOUTS[name]
    layout = make_layout(world, kwargs)
    batches, ref = references(layout.global_batch_size, torch.float64, unpadded)
    results = run_ranks(world, train_rank, layout, batches, torch.float64, EngineOptions(),
                        padded, timeout=120)
    for result in results:
        if result["params"] is not None:
            for key in ("embed.weight", "head.weight"):
                assert result["params"][key].shape == (256, 64)
                result["params"][key] = result["params"][key][:250]
    assert_parity(results, ref, torch.float64, f"padded vocabulary {name}")


# Qwen3's attention: heads wider than hidden / heads (model.kv_channels: q is 128 wide at
# hidden 64) and an RMSNorm over each head of q and of k (model.qk_layernorm), whose gradient
# each TP rank forms from its own heads, with or without SP.
QWEN3 = replace(TINY, num_heads=8, num_query_groups=4, kv_channels=16, qk_layernorm=True)
QK_CASES = [("tp2", P2P, torch.float64), ("tp2_cp2", A2A, torch.float32),
            ("ws4_ss2", P2P, torch.float32), ("every_axis", P2P, torch.float64)]


@pytest.mark.parametrize("name,comm,dtype", [
    pytest.param(n, c, d, id=f"{n}_{c.value}-{str(d).removeprefix('torch.')}")
    for n, c, d in QK_CASES])
def test_wide_heads_with_qk_layernorm_match_one_process(name, comm, dtype, references):
    world, kwargs = LAYOUTS[name]
    layout = make_layout(world, kwargs)
    batches, ref = references(layout.global_batch_size, dtype, QWEN3)
    results = run_ranks(world, train_rank, layout, batches, dtype,
                        EngineOptions(cp_comm_type=comm), QWEN3, timeout=120)
    assert results[0]["params"]["layers.0.attn.o.weight"].shape == (64, 128)
    assert results[0]["params"]["layers.0.attn.q_norm.weight"].shape == (16,)
    assert_parity(results, ref, dtype, f"kv_channels + qk_layernorm {name} {comm.value}")
