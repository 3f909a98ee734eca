"""QK-clip: a step's largest logits come back to the threshold, and every layout clips as one
process does.

The formula, independent of the code: after a clip with the weights otherwise unchanged (lr 0),
the same batch's largest logit of each clip group is min(its old maximum, threshold), and each
head of a clipped group has its maximum scaled by the group's eta = threshold / group maximum
(q x eta^alpha and k x eta^(1 - alpha) scale every logit by eta; RoPE is linear). Then the
layouts: the recorded maxima are gathered over CP chunks, sequence shards, batch lanes and TP
heads, so each layout clips the same heads by the same factors as one process.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from parallel.layout import Layout
from trainer.config import CPCommType
from trainer.plan.options import EngineOptions
from trainer.train.batch import rank_micro_batches
from trainer.train.engine import build_engine
from trainer.train.step import train_step

from harness import run_ranks
from test_moe_parity import MODELS
from test_muon import MUON, one_process  # noqa: F401, F811  (a fixture)
from test_parity import OPTIM, SEED, TINY, make_data, make_layout, relative, train_rank

THRESHOLD = 0.05  # below the tiny models' first logits (about 0.1): every step clips
GQA = replace(TINY, num_heads=8, num_query_groups=2)
MLA = replace(MODELS["deepseek"], mtp_num_layers=None)


def _maxima(engine) -> dict[str, torch.Tensor]:
    return {name: module.max_logits.clone() for name, module, _, _ in
            engine.optimizer.qk_clip.targets}


def _clip_twice(rank: int, model, alpha: float) -> dict:
    torch.set_default_dtype(torch.float64)
    optim = replace(OPTIM, qk_clip_threshold=THRESHOLD, qk_clip_alpha=alpha)
    layout = Layout(1, micro_batch_size=2, seq_length=32, global_batch_size=2)
    engine = build_engine(model, optim, SEED, layout, torch.device("cpu"))
    batch = make_data(2, model)[0].clamp(min=0)
    micro = rank_micro_batches(lambda idx: batch[idx], layout, rank)
    params = dict(engine.model.module.named_parameters())
    qkv = params.get("layers.0.attn.qkv.weight")  # (multi-latent attention has none)
    weights = [qkv.detach().clone()] if qkv is not None else []
    first = train_step(engine.model, engine.optimizer, micro, 0.0)
    weights += [qkv.detach().clone()] if qkv is not None else []
    before = _maxima(engine)
    train_step(engine.model, engine.optimizer, micro, 0.0)
    return {"before": before, "after": _maxima(engine), "logged": first.max_attention_logit,
            "qkv": weights}


@pytest.mark.parametrize("model,groups,alpha", [(TINY, 4, 0.5), (GQA, 2, 0.5), (GQA, 2, 0.8),
                                                (MLA, 4, 0.5)], ids=["mha", "gqa", "gqa_alpha",
                                                                     "mla"])
def test_a_clip_brings_each_groups_largest_logit_to_the_threshold(model, groups, alpha):
    (got,) = run_ranks(1, _clip_twice, model, alpha)
    clipped = 0
    assert got["logged"] == max(m.max().item() for m in got["before"].values())
    # The first block's input (the embedding) is the same both times; a later block's is not:
    # the first's clipped attention changed it.
    for name in ("layers.0.attn",):
        before, after = got["before"][name], got["after"][name]
        group_before = before.view(groups, -1).amax(1)
        eta = (THRESHOLD / group_before).clamp(max=1.0)
        clipped += int((eta < 1).sum())
        expected = before * eta.repeat_interleave(before.numel() // groups)
        assert relative(after, expected) < 1e-12, (name, after, expected)
        assert torch.allclose(after.view(groups, -1).amax(1),
                              group_before.clamp(max=THRESHOLD), rtol=1e-12, atol=0)
        if got["qkv"]:  # q's rows of a group took eta^alpha, k's eta^(1 - alpha), v's none
            _assert_rows_scaled(*got["qkv"], model, eta, alpha)
    assert clipped > 0  # the threshold really was passed


def _assert_rows_scaled(old: torch.Tensor, new: torch.Tensor, model, eta: torch.Tensor,
                        alpha: float) -> None:
    head = model.hidden_size // model.num_heads
    groups = model.num_query_groups or model.num_heads
    q, k, v = old.split([model.num_heads * head, groups * head, groups * head])
    q_eta = (eta ** alpha).repeat_interleave(q.shape[0] // groups)[:, None]
    k_eta = (eta ** (1 - alpha)).repeat_interleave(head)[:, None]
    expected = torch.cat([q * q_eta, k * k_eta, v])
    assert relative(new, expected) < 1e-12, relative(new, expected)


CP2 = dict(context_parallel_size=2)
LAYOUTS = {  # name -> (world, Layout keywords, model, cp_comm_type)
    "tp2_sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True), GQA, "p2p"),
    "cp2_p2p": (2, CP2, GQA, "p2p"),
    "cp2_all_gather": (2, CP2, GQA, "all_gather"),
    "cp2_a2a": (2, CP2, GQA, "a2a"),
    # the window's own exchange (a window of 8 over chunks of 8) with learnable sinks
    "cp2_p2p_window_sinks": (2, CP2, replace(GQA, window_size=8, window_attn_skip_freq=2,
                                             softmax_type="learnable"), "p2p"),
    "ws2_ss2_dp2": (4, dict(tensor_parallel_num_weight_shards=2,
                            tensor_parallel_num_sequence_shards=2), TINY, "p2p"),
    "pp2": (2, dict(pipeline_model_parallel_size=2), TINY, "p2p"),
    "mla_tp2_sp_cp2_ep2": (4, dict(tensor_model_parallel_size=2, sequence_parallel=True,
                                   context_parallel_size=2, expert_model_parallel_size=2),
                           MLA, "p2p"),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_qk_clip_under_a_layout_matches_one_process(name, one_process):  # noqa: F811
    """Muon with QK-clip on every step, fp64: the layout's weights equal one process's to
    1e-10 after three steps."""
    world, kwargs, model, comm = LAYOUTS[name]
    optim = replace(MUON, qk_clip_threshold=THRESHOLD)
    layout = make_layout(world, kwargs)
    dtype = torch.float64
    batches, ref = one_process(model, layout, dtype, optim)
    results = run_ranks(world, train_rank, layout, batches, dtype,
                        EngineOptions(cp_comm_type=CPCommType(comm)), model, optim,
                        timeout=180)
    params = {}
    for result in results:
        params |= result["params"] or {}
    worst = {k: relative(params[k], v) for k, v in ref["params"].items()}
    print(f"\nQK-clip {name}: parameters {max(worst.values()):.2e} "
          f"(worst {max(worst, key=worst.get)})")
    assert max(worst.values()) <= 1e-10, worst
