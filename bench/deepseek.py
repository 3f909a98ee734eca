"""DeepSeek-V3's model: its step beside a Mixtral-style one, what multi-token prediction costs
against its share of the FLOPs, and the measured dry run of an MLA + MTP + EP layout against
its plan.

- DeepSeek over Mixtral-style: one process, one thread; DEEPSEEK (multi-latent attention with a
  compressed q, YaRN, a first dense block, sigmoid routing within groups with the expert bias,
  a shared expert) beside MIXTRAL_STYLE, the same model with grouped-query attention and a
  softmax top-k router over the same experts (the same active parameters to within the
  attentions' difference, both given); steps alternate, the median step time of DeepSeek over
  Mixtral-style, and where DeepSeek's step goes (torch.profiler's self CPU time by operator).
- MTP over none: DEEPSEEK with one multi-token prediction depth beside DEEPSEEK without, steps
  alternating; the step time ratio against the FLOP ratio the log's MFU counts
  (trainer.plan.cost.TokenFlops). Goal: time ratio over FLOP ratio within 0.9-1.1.
- measured dry run over plan: the real CLI's measured dry run (dry_run_rank=0) of a mid-sized
  DeepSeek-style model (MLA, MTP depth 1, 8 experts) under EP 4 and under TP 2 x SP x EP 2:
  the allocator's count of the step's peak over the planned peak (bench/memory.py's method).

    python bench/deepseek.py
"""
from __future__ import annotations

import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))
from memory import MID, measured_dry_run  # noqa: E402
from moe import MICRO, SEQ, _batch, _engine, _timed_steps  # noqa: E402
from ranks import run_ranks  # noqa: E402

from parallel.layout import Layout  # noqa: E402
from trainer.config import ModelConfig  # noqa: E402
from trainer.plan.cost import TokenFlops  # noqa: E402

DEEPSEEK = ModelConfig(
    name="deepseek_v3", vocab_size=512, hidden_size=256, num_layers=3, num_heads=8,
    ffn_hidden_size=688, rope_theta=1e4, norm_eps=1e-6, init_std=0.02,
    multi_latent_attention=True, q_lora_rank=96, kv_lora_rank=64, qk_head_dim=32,
    qk_pos_emb_head_dim=16, v_head_dim=32, rope_type="yarn", rotary_scaling_factor=40.0,
    original_max_position_embeddings=128, mscale_all_dim=1.0,
    num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=256,
    moe_shared_expert_intermediate_size=256, moe_layer_freq=[0, 1, 1],
    moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
    moe_router_topk_scaling_factor=2.5, moe_router_num_groups=2, moe_router_group_topk=1,
    moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4)
MIXTRAL_STYLE = replace(
    DEEPSEEK, name="llama", multi_latent_attention=False, rope_type="rope",
    moe_router_score_function="softmax", moe_router_enable_expert_bias=False,
    moe_router_topk_scaling_factor=None, moe_router_num_groups=None,
    moe_router_group_topk=None, moe_router_load_balancing_type="aux_loss",
    moe_aux_loss_coeff=0.01)
WITH_MTP = replace(DEEPSEEK, mtp_num_layers=1, mtp_loss_scaling_factor=0.3)
MID_DEEPSEEK = MID + [
    "model.name=deepseek_v3", "model.multi_latent_attention=true", "model.q_lora_rank=192",
    "model.kv_lora_rank=128", "model.qk_head_dim=64", "model.qk_pos_emb_head_dim=32",
    "model.v_head_dim=64", "model.rope_type=yarn", "model.mscale_all_dim=1.0",
    "model.num_moe_experts=8", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=688",
    "model.moe_shared_expert_intermediate_size=688", "model.moe_router_score_function=sigmoid",
    "model.moe_router_enable_expert_bias=true", "model.moe_layer_freq=[0,1,1,1]",
    "model.mtp_num_layers=1"]
DRY_RUNS = {
    "ep4": ["cluster.procs_per_node=4", "parallel.expert_model_parallel_size=4"],
    "tp2_sp_ep2": ["cluster.procs_per_node=4", "parallel.tensor_model_parallel_size=2",
                   "parallel.sequence_parallel=true", "parallel.expert_tensor_parallel_size=1",
                   "parallel.expert_model_parallel_size=2"],
}


def active_parameters(model: ModelConfig) -> int:
    """The weights a token passes through (trainer.plan.cost.TokenFlops: 2 FLOPs each)."""
    token = TokenFlops.of(model, SEQ)
    return round((token.num_layers * token.block_linear + token.head + token.mtp) / 2)


def _side_by_side(rank: int, models: dict[str, ModelConfig], steps: int, profiled: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from trainer.train.batch import rank_micro_batches
    from trainer.train.step import train_step

    torch.set_num_threads(1)
    layout = Layout(1, micro_batch_size=MICRO, seq_length=SEQ)
    engines = {name: _engine(model, layout) for name, model in models.items()}
    batch = _batch(DEEPSEEK, layout.global_batch_size)
    times = _timed_steps(0, engines, batch, steps, mtp={
        name: model.mtp_num_layers or 0 for name, model in models.items()})
    micro = rank_micro_batches(lambda idx: batch[idx], layout, 0,
                               mtp_depths=models[profiled].mtp_num_layers or 0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_step(engines[profiled].model, engines[profiled].optimizer, micro, 1e-4)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return {"times": times,
            "where": {e.key: round(e.self_cpu_time_total / total, 3) for e in events[:6]}}


def deepseek_over_mixtral(steps: int) -> dict:
    models = {"deepseek": DEEPSEEK, "mixtral_style": MIXTRAL_STYLE}
    (result,) = run_ranks(1, _side_by_side, models, steps, "deepseek")
    median = {name: statistics.median(t) for name, t in result["times"].items()}
    return {"setup": f"one process, one thread, {MICRO} x {SEQ} tokens, {steps} timed steps "
                     f"each alternating; hidden {DEEPSEEK.hidden_size}, {DEEPSEEK.num_layers} "
                     f"blocks (the first dense), {DEEPSEEK.num_moe_experts} experts top "
                     f"{DEEPSEEK.moe_router_topk} and a shared expert; DeepSeek's MLA and "
                     f"grouped sigmoid router vs grouped-query attention and a softmax router",
            "active_parameters": {name: active_parameters(m) for name, m in models.items()},
            "step_s": {name: round(t, 4) for name, t in median.items()},
            "step_time_deepseek_over_mixtral_style": round(
                median["deepseek"] / median["mixtral_style"], 3),
            "deepseek_self_cpu_share_by_op": result["where"]}


def mtp_over_none(steps: int) -> dict:
    models = {"mtp1": WITH_MTP, "none": DEEPSEEK}
    (result,) = run_ranks(1, _side_by_side, models, steps, "mtp1")
    median = {name: statistics.median(t) for name, t in result["times"].items()}
    flops = {name: TokenFlops.of(m, SEQ).training for name, m in models.items()}
    time_ratio = median["mtp1"] / median["none"]
    flop_ratio = flops["mtp1"] / flops["none"]
    return {"setup": f"one process, one thread, {MICRO} x {SEQ} tokens, {steps} timed steps "
                     f"each alternating; the DeepSeek-style model with one MTP depth and "
                     f"without",
            "step_s": {name: round(t, 4) for name, t in median.items()},
            "step_time_ratio": round(time_ratio, 3), "flop_ratio": round(flop_ratio, 3),
            "time_ratio_over_flop_ratio": round(time_ratio / flop_ratio, 3),
            "mtp_self_cpu_share_by_op": result["where"]}


def dry_runs() -> dict:
    return {name: measured_dry_run(MID_DEEPSEEK + extra) for name, extra in DRY_RUNS.items()}


def measure(quick: bool = True) -> dict:
    steps = 3 if quick else 8
    return {"deepseek_over_mixtral": deepseek_over_mixtral(steps),
            "mtp_over_none": mtp_over_none(steps), "dry_run": dry_runs()}


if __name__ == "__main__":
    print(json.dumps(measure(), indent=1))
