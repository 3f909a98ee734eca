"""The dry run's memory plan against what a rank really allocates, byte for byte: weight shards
whose rows GTP_remat pads (weight shards 3 over rows that 3 does not divide), the optimizer's
flat buffers padded to a multiple of the weight replicas, after one real step (Adam moments
exist). Planned from shapes and the Layout alone; measured on gloo ranks."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from trainer.checkpoint.dcp import TrainState, stage
from trainer.parts.assembly import parameter_shapes
from trainer.plan.memory import memory_per_stage
from trainer.plan.muon import muon_plan
from trainer.train.batch import rank_micro_batches
from trainer.train.engine import build_engine
from trainer.train.step import train_step

from harness import run_ranks
from test_muon import MUON
from test_parity import OPTIM, SEED, TINY, make_data, make_layout

FP32 = 4


# Grouped-query attention, tied embeddings and a vocabulary of 250 padded to 256.
GQA_TIED = replace(TINY, vocab_size=250, num_heads=8, num_query_groups=2,
                   tie_word_embeddings=True)
# Multi-latent attention at tiny_deepseek's shapes: its down-projections whole on every rank (the
# optimizer's WHOLE buffer), its up-projections split by heads; and q projected directly.
MLA = replace(TINY, name="deepseek_v3", multi_latent_attention=True, q_lora_rank=24,
              kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16)
MLA_DIRECT_Q = replace(MLA, q_lora_rank=None)
# Multi-token prediction: a depth's block, eh_proj (whole on every rank) and norms on the last
# stage, which under pipeline parallel also holds a copy of the embedding (its lookups).
MTP = replace(TINY, mtp_num_layers=1)
# gpt-oss's biases (model.add_bias_linear), whole on every rank (the NORMS buffer), and the
# experts' [E, out, 1] split over EP and ETP with their weights
BIASED = replace(GQA_TIED, add_bias_linear=True)
BIASED_MOE = replace(TINY, add_bias_linear=True, num_moe_experts=4, moe_ffn_hidden_size=48)


def held_after_one_step(rank, layout, batch, model=TINY, optim=OPTIM) -> dict:
    engine = build_engine(model, optim, SEED, layout, torch.device("cpu"))
    train_step(engine.model, engine.optimizer,
               rank_micro_batches(lambda i: batch[i], layout, rank,
                                  mtp_depths=model.mtp_num_layers or 0), 1e-3)
    opt, model = engine.optimizer, engine.model
    # the last stage's copy of a tied embedding lives outside the optimizer's flat buffers
    copies = sum(p.numel() for name, p in model.module.named_parameters()
                 if name in model.stage_copies)
    return {
        "parameters": sum(p.numel() for p in model.module.parameters()),
        "param_bytes": (sum(b.params.numel() for b in opt.buffers) + copies) * FP32,
        "grad_bytes": (sum(b.grads.numel() for b in opt.buffers) + copies) * FP32,
        "optim_bytes": (sum(t.numel() for state in opt.adam.state.values()
                            for key, t in state.items() if key != "step")
                        + sum(m.momentum.numel() for m in opt.muon)) * FP32,
        # what checkpoint.async_save copies to host memory: every rectangle the rank writes
        "staging_bytes": stage(engine, TrainState()).nbytes,
    }


@pytest.mark.parametrize("world, kwargs, model", [
    (3, dict(tensor_parallel_num_weight_shards=3), TINY),  # rows 256, 64, 352 padded to 3's
    (4, dict(tensor_model_parallel_size=2, sequence_parallel=True), TINY),  # DP 2 over TP 2
    (6, dict(tensor_parallel_num_weight_shards=3), TINY),  # padded shards, two replicas
    (4, dict(tensor_model_parallel_size=2, tensor_parallel_num_weight_shards=2), GQA_TIED),
    (4, dict(pipeline_model_parallel_size=2, tensor_parallel_num_weight_shards=2), GQA_TIED),
    (3, dict(tensor_parallel_num_weight_shards=3), MLA),  # kv_up's 128 rows padded to 3's
    (4, dict(tensor_model_parallel_size=2, tensor_parallel_num_weight_shards=2), MLA),
    (4, dict(tensor_model_parallel_size=2, sequence_parallel=True), MLA_DIRECT_Q),  # DP 2
    (3, dict(tensor_parallel_num_weight_shards=3), MTP),  # eh_proj in the WHOLE buffer
    (4, dict(pipeline_model_parallel_size=2, tensor_parallel_num_weight_shards=2), MTP),
    (4, dict(pipeline_model_parallel_size=2, tensor_model_parallel_size=2), MTP),
    (4, dict(tensor_model_parallel_size=2, tensor_parallel_num_weight_shards=2), BIASED),
    (4, dict(expert_tensor_parallel_size=2, expert_model_parallel_size=2,
             tensor_parallel_num_weight_shards=2), BIASED_MOE),
], ids=["ws3", "tp2_sp_dp2", "ws3_dp2", "gqa_tied_tp2_ws2", "gqa_tied_pp2_ws2", "mla_ws3",
        "mla_tp2_ws2", "mla_direct_q_tp2_sp_dp2", "mtp_ws3", "mtp_pp2_ws2", "mtp_pp2_tp2",
        "biased_tp2_ws2", "biased_moe_etp2_ep2_ws2"])
def test_planned_bytes_are_the_allocated_bytes(world, kwargs, model):
    layout = make_layout(world, kwargs)
    plans = memory_per_stage(parameter_shapes(model), model.num_layers, layout,
                             model.tie_word_embeddings)
    batch = make_data(layout.global_batch_size, model)[0]
    results = run_ranks(world, held_after_one_step, layout, batch, model, timeout=120)
    staged = [0] * layout.pp_size
    for rank, held in enumerate(results):
        plan = plans[layout.coords(rank).pp]  # the last stage holds the tied embedding's copy
        planned = {key: getattr(plan, key) for key in held}
        # A weight shard's padding rows are not written, so the rank with a shard's last rows
        # stages less: the plan is the stage's most.
        stage_bytes = held.pop("staging_bytes")
        staged[layout.coords(rank).pp] = max(staged[layout.coords(rank).pp], stage_bytes)
        assert stage_bytes <= planned.pop("staging_bytes"), (rank, stage_bytes)
        assert held == planned, (rank, held, planned)
    assert staged == [plan.staging_bytes for plan in plans]


# optim=muon: its matrices in three buffers of their own, one fp32 momentum per element (the
# sharded, whole and expert matrices; the rest with AdamW), each buffer padded on its own.
MUON_CASES = {
    "ws3": (3, dict(tensor_parallel_num_weight_shards=3), TINY),
    "tp2_sp_dp2": (4, dict(tensor_model_parallel_size=2, sequence_parallel=True), TINY),
    "mla_tp2_ws2": (4, dict(tensor_model_parallel_size=2, tensor_parallel_num_weight_shards=2),
                    MLA),
    "mtp_pp2_ws2": (4, dict(pipeline_model_parallel_size=2, tensor_parallel_num_weight_shards=2),
                    MTP),
    "biased_moe_etp2_ep2_ws2": (4, dict(expert_tensor_parallel_size=2,
                                        expert_model_parallel_size=2,
                                        tensor_parallel_num_weight_shards=2), BIASED_MOE),
}


@pytest.mark.parametrize("name", MUON_CASES)
def test_planned_bytes_under_muon_are_the_allocated_bytes(name):
    world, kwargs, model = MUON_CASES[name]
    layout = make_layout(world, kwargs)
    shapes = parameter_shapes(model)
    muon = muon_plan(model, MUON)
    plans = memory_per_stage(shapes, model.num_layers, layout, model.tie_word_embeddings, muon)
    adamw = memory_per_stage(shapes, model.num_layers, layout, model.tie_word_embeddings)
    batch = make_data(layout.global_batch_size, model)[0]
    results = run_ranks(world, held_after_one_step, layout, batch, model, MUON, timeout=120)
    for rank, held in enumerate(results):
        stage = layout.coords(rank).pp
        plan = plans[stage]
        planned = {key: getattr(plan, key) for key in held}
        stage_bytes = held.pop("staging_bytes")
        assert stage_bytes <= planned.pop("staging_bytes"), (rank, stage_bytes)
        assert held == planned, (rank, held, planned)
        assert plan.optim_bytes < adamw[stage].optim_bytes  # one momentum, not two moments
