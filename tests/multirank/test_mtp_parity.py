"""Multi-token prediction (model.mtp_num_layers): what one process computes, against the depths
composed here by hand from the model's own modules (the token k ahead embedded, normed and
concatenated before the hidden state, projected, one block, normed, the shared head; the loss
over the positions whose target exists, each depth's mean weighted mtp_loss_scaling_factor /
D); the labels across documents; and every layout against one process (losses, each depth's
loss, norms and every weight), on real gloo ranks with test_parity's tolerances.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from test_mla_parity import MLA

from trainer.config import CPCommType, RecomputeGranularity
from trainer.plan.options import EngineOptions
from trainer.train.batch import IGNORE, _ahead, rank_micro_batches
from trainer.train.engine import build_engine
from trainer.train.step import train_step

from harness import run_ranks
from test_parity import (
    LRS,
    MICRO,
    OPTIM,
    SEED,
    SEQ,
    TOLERANCE,
    make_data,
    make_layout,
    relative,
)

MTP = replace(MLA, mtp_num_layers=2, mtp_loss_scaling_factor=0.3)
# DeepSeek-V3's block: the depths' blocks are mixtures of experts with its router (no balance
# loss, whose sums depend on how a layout groups the micro-batch: test_moe_parity covers them)
DEEPSEEK = replace(MTP, num_layers=4, num_moe_experts=8, moe_router_topk=2,
                   moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32,
                   moe_layer_freq=[0, 1, 1, 1], moe_router_score_function="sigmoid",
                   moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5,
                   moe_router_num_groups=2, moe_router_group_topk=1, moe_aux_loss_coeff=0.0)
MODELS = {"mla": MTP, "deepseek": DEEPSEEK, "mla_4_layers": replace(MTP, num_layers=4)}


def _by_hand_and_by_the_step(rank: int) -> dict:
    torch.set_default_dtype(torch.float64)
    layout = make_layout(1, {}, 1)
    engine = build_engine(MTP, OPTIM, SEED, layout, torch.device("cpu"), EngineOptions())
    model = engine.model.module
    batch = torch.randint(0, MTP.vocab_size, (MICRO, SEQ + 1),
                          generator=torch.Generator().manual_seed(5))
    (mb,) = rank_micro_batches(lambda idx: batch[idx], layout, 0, mtp_depths=2)
    # by hand: depth k at positions i < SEQ - k, where token i + k + 1 exists
    with torch.no_grad():
        x = model.embed(batch[:, :SEQ])
        positions = torch.arange(SEQ).expand(MICRO, -1)
        for block in model.layers.values():
            x = block(x, positions)
        hidden = model.norm(x)
        main = F.cross_entropy(model.head(hidden).flatten(0, 1), batch[:, 1:].flatten())
        want = []
        for k, depth in enumerate(model.mtp.depths.values(), start=1):
            n = SEQ - k
            mixed = torch.cat((depth.enorm(model.embed(batch[:, k:k + n])),
                               depth.hnorm(hidden[:, :n])), dim=-1)
            hidden = depth.norm(depth.block(depth.eh_proj(mixed), positions[:, :n]))
            want.append(F.cross_entropy(model.head(hidden).flatten(0, 1),
                                        batch[:, k + 1:k + 1 + n].flatten()).item())
    result = train_step(engine.model, engine.optimizer, [mb], 1e-3)
    return {"loss": result.loss, "mtp": result.mtp_losses, "main": main.item(), "want": want}


def test_each_depth_predicts_the_token_k_plus_1_ahead_as_composed_by_hand():
    (got,) = run_ranks(1, _by_hand_and_by_the_step)
    assert relative(got["loss"], got["main"]) < 1e-12
    assert len(got["mtp"]) == 2
    for ours, expected in zip(got["mtp"], got["want"]):
        assert relative(ours, expected) < 1e-12, (got["mtp"], got["want"])
    assert abs(got["mtp"][0] - got["mtp"][1]) > 1e-3  # two different depths


def test_the_labels_ahead_stop_at_the_sample_end_and_at_a_document():
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15, 16]])  # seq 6
    labels = tokens[:, 1:].clone()
    labels[0, 2] = IGNORE  # the main loss ignores target 13
    begin = torch.tensor([[0, 0, 0, 0, 4, 4, 4]])  # a document starts at token 14
    (ahead1, ahead2), (target1, target2) = _ahead(tokens, labels, begin, 2)
    assert ahead1.tolist() == [[11, 12, 13, 14, 15, 16]]
    assert ahead2.tolist() == [[12, 13, 14, 15, 16, 0]]
    # depth 1 at i predicts token i + 2: 12; 13 the main loss ignores; 14 and 15 lie in the
    # next document (from 12 and 13); 16 from 14, within it; past the end nothing
    assert target1.tolist() == [[12, IGNORE, IGNORE, IGNORE, 16, IGNORE]]
    # depth 2 predicts token i + 3: 13 (ignored), then 14, 15, 16 from the first document
    assert target2.tolist() == [[IGNORE] * 6]
    (_, _), (plain, _) = _ahead(tokens, labels, None, 2)  # no documents known: only the end
    assert plain.tolist() == [[12, IGNORE, 14, 15, 16, IGNORE]]


def trained(rank: int, layout, batches, dtype, options, model) -> dict:
    torch.set_default_dtype(dtype)
    engine = build_engine(model, OPTIM, SEED, layout, torch.device("cpu"), options)
    losses, norms, depths = [], [], []
    for batch, lr in zip(batches, LRS):
        mbs = rank_micro_batches(lambda idx, b=batch: b[idx], layout, rank,
                                 mtp_depths=model.mtp_num_layers)
        for mb in mbs:
            mb.tokens = mb.tokens.clamp(min=0)
            mb.ahead = mb.ahead.clamp(min=0)
        result = train_step(engine.model, engine.optimizer, mbs, lr)
        losses.append(result.loss)
        norms.append(result.grad_norm)
        depths.append(result.mtp_losses)
    params = engine.model.full_state_dict()  # collective: every rank; this rank's stage
    first_of_stage = not any(layout.coords(rank)[:-1])
    return {"losses": losses, "norms": norms, "mtp": depths,
            "params": params if first_of_stage else None,
            "biases": {n: b.detach() for n, b in engine.model.module.named_buffers()}}


TP2_SP = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
LAYOUTS = {  # name -> (world, Layout keyword arguments, engine options[, model, dtype])
    "dp2": (2, {}, EngineOptions()),
    "tp2_sp": (2, TP2_SP, EngineOptions()),
    "cp2_p2p": (2, {"context_parallel_size": 2}, EngineOptions()),
    "tp2_sp_cp2_a2a": (4, TP2_SP | {"context_parallel_size": 2},
                       EngineOptions(cp_comm_type=CPCommType.a2a)),
    "ws4_ss2": (4, {"tensor_parallel_num_weight_shards": 4,
                    "tensor_parallel_num_sequence_shards": 2}, EngineOptions()),
    "pp2": (2, {"pipeline_model_parallel_size": 2}, EngineOptions()),
    "pp2_tp2_sp_cp2": (8, TP2_SP | {"pipeline_model_parallel_size": 2,
                                    "context_parallel_size": 2}, EngineOptions()),
    "pp2_full_recompute": (2, {"pipeline_model_parallel_size": 2}, EngineOptions(
        recompute_granularity=RecomputeGranularity.full)),
    "tp2_sp_selective": (2, TP2_SP, EngineOptions(
        recompute_granularity=RecomputeGranularity.selective)),
    "pp2_virtual2": (2, {"pipeline_model_parallel_size": 2,
                         "virtual_pipeline_model_parallel_size": 2},
                     EngineOptions(pipeline_schedule="interleaved_1f1b"), "mla_4_layers"),
    # fp32 within 1e-5
    "tp2_sp_fp32": (2, TP2_SP, EngineOptions(), "mla", torch.float32),
    "cp2_a2a_fp32": (2, {"context_parallel_size": 2}, EngineOptions(cp_comm_type=CPCommType.a2a),
                     "mla", torch.float32),
    # the depth's experts over EP (and each over ETP 2 with TP 2 x SP), the router identical
    "deepseek_ep2": (2, {"expert_model_parallel_size": 2}, EngineOptions(), "deepseek"),
    "deepseek_tp2_sp_etp2_ep2_pp2": (8, TP2_SP | {"expert_model_parallel_size": 2,
                                                  "pipeline_model_parallel_size": 2},
                                     EngineOptions(), "deepseek"),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_multi_token_prediction_matches_one_process(name):
    world, kwargs, options, *rest = LAYOUTS[name]
    model = MODELS[rest[0] if rest else "mla"]
    dtype = rest[1] if len(rest) > 1 else torch.float64
    layout = make_layout(world, kwargs)
    one = make_layout(1, {}, layout.global_batch_size // MICRO)
    batches = make_data(layout.global_batch_size, model)
    (ref,) = run_ranks(1, trained, one, batches, dtype, EngineOptions(), model)
    results = run_ranks(world, trained, layout, batches, dtype, options, model, timeout=180)
    for got in results:
        for ours, theirs in zip(got["mtp"], ref["mtp"]):
            assert max(relative(a, b) for a, b in zip(ours, theirs)) <= TOLERANCE[dtype]
    got = {}
    for result in results:
        got |= result["params"] or {}
    worst = max(relative(got[k], v) for k, v in ref["params"].items())
    print(f"\nMTP {name} (world {world}) {dtype}: params {worst:.1e}, losses "
          f"{max(relative(a, b) for a, b in zip(results[0]['losses'], ref['losses'])):.1e}")
    assert set(got) == set(ref["params"]) and worst <= TOLERANCE[dtype]
    for result in results:  # the routing: each expert bias (its stage's) moved exactly alike
        for key, bias in result["biases"].items():
            assert torch.equal(bias, ref["biases"][key]), key
    if model.moe_router_enable_expert_bias:  # the depth's router too, and they moved
        assert ref["biases"]["mtp.depths.0.block.mlp.router.expert_bias"].abs().max() > 0
    assert "mtp.depths.1.eh_proj.weight" in got and ref["mtp"][0][0] > 0
