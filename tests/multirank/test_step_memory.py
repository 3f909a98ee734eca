"""Memory follows the layout, measured: what one simulated rank of a large world allocates.

Each case runs in a fresh spawned process that acts as one rank of a world through torch's fake
process group (collectives return at once, allocations are real):
- the saved activations autograd really keeps (torch.autograd.graph.saved_tensors_hooks, every
  storage once) against trainer.plan.activations' formula, by layout and recompute setting;
- a rank's build never creates a tensor anywhere near the size of a full 2-D weight;
- what the allocator really holds (torch's profiler memory events, trainer.train.allocations)
  during the micro-batches and during the optimizer update, against the plan's terms;
- the measured dry run (the real CLI, dry_run_rank) of a 64-rank world against the plan.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from multiprocessing import get_context

import pytest
import torch
import torch.distributed as dist

from parallel.layout import Layout
from trainer.config import (
    CPCommType,
    ModelConfig,
    OptimConfig,
    PeftConfig,
    Precision,
    RecomputeGranularity,
)
from trainer.parts.assembly import parameter_shapes
from trainer.parts.lora import Adapters
from trainer.plan.memory import memory_per_stage
from trainer.plan.options import EngineOptions
from trainer.plan.stage_plan import step_per_stage

from config_helpers import ROOT

MODEL = ModelConfig(name="llama", vocab_size=1024, hidden_size=256, num_layers=2, num_heads=4,
                    ffn_hidden_size=688, rope_theta=1e4, norm_eps=1e-5, init_std=0.02)
OPTIM = OptimConfig(name="adamw", weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8,
                    clip_grad=1.0)


_POOL: ProcessPoolExecutor | None = None  # one spawned worker for the module's cases


def simulated(world: int, rank: int, fn, *args):
    """fn(*args) in a spawned process (not this test process) acting as `rank` of a fake
    world of `world` ranks. One worker serves every case, each in a process group of its own:
    importing torch once instead of once a case saves seconds each."""
    global _POOL
    if _POOL is None:
        _POOL = ProcessPoolExecutor(1, mp_context=get_context("spawn"))
        atexit.register(_POOL.shutdown)
    return _POOL.submit(_in_fake_world, world, rank, fn, *args).result(timeout=240)


def _in_fake_world(world: int, rank: int, fn, *args):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # One thread, as the harness's ranks: two such workers (pytest -n 2) each spinning two
    # OpenMP threads on two cores ran this module 6.5 times slower than one process does.
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        return fn(rank, *args)
    finally:
        dist.destroy_process_group()


def saved_activation_bytes(rank: int, layout: Layout, options: EngineOptions,
                           model: ModelConfig = MODEL) -> int:
    """Bytes of every storage autograd keeps from one micro-batch's forward, weights excluded."""
    from trainer.train.batch import rank_micro_batches
    from trainer.train.engine import build_engine

    engine = build_engine(model, OPTIM, 0, layout, torch.device("cpu"), options,
                          peft=peft_of(options))
    fetch = lambda idx: torch.randint(0, model.vocab_size, (len(idx), layout.seq_length + 1))  # noqa: E731
    mb = rank_micro_batches(fetch, layout, rank, mtp_depths=model.mtp_num_layers or 0)[0]
    weights = {p.untyped_storage().data_ptr() for p in engine.model.parameters()}
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        # with multi-token prediction's ids ahead: the model's logits and each depth's
        out = engine.model.forward_chunk(0, mb.tokens, mb.positions, None,
                                         *(() if mb.ahead is None else (mb.ahead,)))
        logits, *ahead = out if isinstance(out, tuple) else (out,)
        labels = [mb.labels, *(() if mb.ahead_labels is None else mb.ahead_labels)]
        sum(engine.model.token_losses(x, y).sum() for x, y in zip([logits, *ahead], labels))
    return sum(kept.values())


def peft_of(options: EngineOptions) -> PeftConfig | None:
    """The peft=lora config a case's options.lora stands for (None: full training)."""
    lora = options.lora
    return None if lora is None else PeftConfig(
        "lora", lora.rank, 2.0 * lora.rank, lora.dropout, sorted(lora.targets),
        Precision.bf16 if lora.base_bf16 else Precision.fp32)


def planned(layout: Layout, options: EngineOptions, model: ModelConfig = MODEL
            ) -> dict[str, int]:
    shapes = parameter_shapes(model, peft_of(options))
    return step_per_stage(shapes, model, layout, options)[0]


FULL, SELECTIVE = RecomputeGranularity.full, RecomputeGranularity.selective
OVERLAPS = dict(overlap_param_gather=True, overlap_grad_reduce=True)
CASES = {  # name -> (world, Layout kwargs, EngineOptions kwargs)
    "one_process": (1, {}, {}),
    "tp2_sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True), {}),
    "tp2": (2, dict(tensor_model_parallel_size=2), {}),
    "tp2_sp_bf16": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True),
                    dict(precision=Precision.bf16)),
    "cp2": (2, dict(context_parallel_size=2), {}),  # p2p: the ring, the default
    "cp4_p2p_bf16": (4, dict(context_parallel_size=4), dict(precision=Precision.bf16)),
    "cp4_all_gather": (4, dict(context_parallel_size=4), dict(cp_comm_type=CPCommType.all_gather)),
    "cp4_a2a": (4, dict(context_parallel_size=4), dict(cp_comm_type=CPCommType.a2a)),
    "ws4_ss4": (4, dict(tensor_parallel_num_weight_shards=4,
                        tensor_parallel_num_sequence_shards=4), {}),
    "selective": (1, {}, dict(recompute_granularity=SELECTIVE)),
    "selective_cp2": (2, dict(context_parallel_size=2), dict(recompute_granularity=SELECTIVE)),
    "full": (1, {}, dict(recompute_granularity=FULL)),
    "full_first_block": (2, dict(tensor_parallel_num_weight_shards=2),
                         dict(recompute_granularity=FULL, recompute_num_layers=1)),
    "bf16": (1, {}, dict(precision=Precision.bf16)),
    "bf16_ws2": (2, dict(tensor_parallel_num_weight_shards=2), dict(precision=Precision.bf16)),
    # the trainer's defaults (parallel.overlap_param_gather and overlap_grad_reduce on): a
    # block's backward beside the previous block's prefetch (and the prefetch's packed input)
    # and the later blocks' reduce-scatters in flight
    "ws2_overlaps": (2, dict(tensor_parallel_num_weight_shards=2), OVERLAPS),
    "ws2_full_overlaps": (2, dict(tensor_parallel_num_weight_shards=2),
                          dict(OVERLAPS, recompute_granularity=FULL)),
}
# Grouped-query attention (8 heads, 2 K/V groups: k and v a quarter of q), with tied embeddings
# and a vocabulary of 1000 padded to 1024.
GQA = ModelConfig(name="llama", vocab_size=1000, hidden_size=256, num_layers=2, num_heads=8,
                  ffn_hidden_size=688, rope_theta=1e4, norm_eps=1e-5, init_std=0.02,
                  num_query_groups=2, tie_word_embeddings=True)
GQA_CASES = {
    "gqa_tp2_sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True), {}),
    "gqa_cp4_p2p": (4, dict(context_parallel_size=4), {}),
    "gqa_cp4_all_gather": (4, dict(context_parallel_size=4),
                           dict(cp_comm_type=CPCommType.all_gather)),
    "gqa_cp2_a2a": (2, dict(context_parallel_size=2), dict(cp_comm_type=CPCommType.a2a)),
    "gqa_bf16_ws2": (2, dict(tensor_parallel_num_weight_shards=2), dict(precision=Precision.bf16)),
}


# Qwen3's attention: heads wider than hidden / heads (model.kv_channels: q is 512 wide at
# hidden 256) and an RMSNorm over each head of q and k (model.qk_layernorm), with GQA.
QK = dataclasses.replace(GQA, kv_channels=64, qk_layernorm=True)
QK_CASES = {
    "qk_tp2_sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True), {}),
    "qk_cp2_a2a": (2, dict(context_parallel_size=2), dict(cp_comm_type=CPCommType.a2a)),
    "qk_selective_cp2": (2, dict(context_parallel_size=2), dict(recompute_granularity=SELECTIVE)),
    "qk_bf16_ws2": (2, dict(tensor_parallel_num_weight_shards=2), dict(precision=Precision.bf16)),
}
# A mixture of experts in every block (8 experts of 256, top 2), with the router's variants:
# the switch loss and the z-loss, the sigmoid with an expert bias and a shared expert, and the
# per-sequence loss under CP.
MOE = dataclasses.replace(MODEL, num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=256)
MOE_MODELS = {
    "moe": MOE,
    "moe_losses": dataclasses.replace(MOE, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3),
    "moe_sigmoid_shared": dataclasses.replace(
        MOE, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_shared_expert_intermediate_size=384),
    "moe_seq": dataclasses.replace(MOE, moe_aux_loss_coeff=0.01,
                                   moe_router_load_balancing_type="seq_aux_loss"),
    "moe_wide": dataclasses.replace(MOE, moe_ffn_hidden_size=512),  # experts wider than h
    # gpt-oss's biases (model.add_bias_linear): qkv, o, the router, each expert's two
    "moe_biased": dataclasses.replace(MOE, add_bias_linear=True),
}
MOE_TP2_SP = dict(tensor_model_parallel_size=2, sequence_parallel=True,
                  expert_tensor_parallel_size=1)
MOE_CASES = {  # name -> (world, Layout kwargs, EngineOptions kwargs, model)
    "moe_one_process": (1, {}, {}, "moe"),
    "moe_sigmoid_shared_ws2": (2, dict(tensor_parallel_num_weight_shards=2), {},
                               "moe_sigmoid_shared"),
    "moe_seq_cp2_a2a": (2, dict(context_parallel_size=2), dict(cp_comm_type=CPCommType.a2a),
                        "moe_seq"),
    "moe_selective": (1, {}, dict(recompute_granularity=SELECTIVE), "moe_losses"),
    "moe_full": (1, {}, dict(recompute_granularity=FULL), "moe"),
    "moe_full_bf16": (1, {}, dict(recompute_granularity=FULL, precision=Precision.bf16),
                      "moe_wide"),
    "moe_bf16": (1, {}, dict(precision=Precision.bf16), "moe_sigmoid_shared"),
    # Expert parallel: the fake process group's all-to-all delivers what a rank sends, the
    # plan's expected case (trainer.parts.moe). (Its all-gather gives every source this rank's
    # own rows, so the allgather dispatcher would run EP x its rows for its own experts, not
    # the expected case: not measured here.)
    "moe_ep2": (2, dict(expert_model_parallel_size=2), {}, "moe"),
    "moe_ep4_cp2_ws2_bf16": (8, dict(expert_model_parallel_size=4, context_parallel_size=2,
                                     tensor_parallel_num_weight_shards=2),
                             dict(precision=Precision.bf16), "moe_sigmoid_shared"),
    "moe_ep2_selective": (4, dict(expert_model_parallel_size=2),
                          dict(recompute_granularity=SELECTIVE), "moe_losses"),
    "moe_ep2_full_wide": (2, dict(expert_model_parallel_size=2),
                          dict(recompute_granularity=FULL), "moe_wide"),
    # TP with sequence parallel: each TP rank routes its part of the sequence (experts whole)
    "moe_tp2_sp_shared": (2, MOE_TP2_SP, {}, "moe_sigmoid_shared"),
    "moe_tp2_sp_ep2_bf16": (4, MOE_TP2_SP | dict(expert_model_parallel_size=2),
                            dict(precision=Precision.bf16), "moe_sigmoid_shared"),
    "moe_tp2_sp_selective": (2, MOE_TP2_SP, dict(recompute_granularity=SELECTIVE),
                             "moe_losses"),
    # Each expert split over ETP: every ETP peer's rows pass through this rank's slice
    "moe_etp2": (2, dict(expert_tensor_parallel_size=2), {}, "moe"),
    "moe_tp2_sp_etp2_ep2_bf16": (4, MOE_TP2_SP | dict(expert_tensor_parallel_size=2,
                                                      expert_model_parallel_size=2),
                                 dict(precision=Precision.bf16), "moe_sigmoid_shared"),
    "moe_etp2_full_wide": (2, dict(expert_tensor_parallel_size=2),
                           dict(recompute_granularity=FULL), "moe_wide"),
    "moe_etp4_full_wide": (4, dict(expert_tensor_parallel_size=4),
                           dict(recompute_granularity=FULL), "moe_wide"),
    # biases: a column one's rows of this TP rank, a row one's added after the reduce-scatter
    "moe_biased_tp2_sp": (2, MOE_TP2_SP, {}, "moe_biased"),
    "moe_biased_etp2_ep2_bf16": (4, dict(expert_tensor_parallel_size=2,
                                         expert_model_parallel_size=2),
                                 dict(precision=Precision.bf16), "moe_biased"),
}
# Multi-latent attention (DeepSeek-V3's): q and K/V through latents of 96 and 128, q and k heads
# of 64 + 32 rotary dims, values of 48 (narrower than q: padded to 96 for the fused kernels),
# YaRN; q projected directly (q_lora_rank null), and DeepSeek-V3's experts after a dense block.
MLA = ModelConfig(name="deepseek_v3", vocab_size=1024, hidden_size=256, num_layers=2,
                  num_heads=4, ffn_hidden_size=688, rope_theta=1e4, norm_eps=1e-5,
                  init_std=0.02, multi_latent_attention=True, q_lora_rank=96, kv_lora_rank=128,
                  qk_head_dim=64, qk_pos_emb_head_dim=32, v_head_dim=48, rope_type="yarn",
                  rotary_scaling_factor=4.0, original_max_position_embeddings=128,
                  mscale_all_dim=1.0)
MLA_MODELS = {
    "mla": MLA,
    "mla_direct_q": dataclasses.replace(MLA, q_lora_rank=None),
    "mla_moe": dataclasses.replace(
        MLA, num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=256,
        moe_layer_freq=[0, 1], moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=256,
        moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5),
}
TP2_SP = dict(tensor_model_parallel_size=2, sequence_parallel=True)
MLA_CASES = {  # name -> (world, Layout kwargs, EngineOptions kwargs, model)
    "mla_one_process": (1, {}, {}, "mla"),
    "mla_tp2_sp": (2, TP2_SP, {}, "mla_direct_q"),
    "mla_bf16": (1, {}, dict(precision=Precision.bf16), "mla"),
    "mla_selective": (1, {}, dict(recompute_granularity=SELECTIVE), "mla"),
    "mla_tp2_sp_selective": (2, TP2_SP, dict(recompute_granularity=SELECTIVE), "mla"),
    "mla_full": (1, {}, dict(recompute_granularity=FULL), "mla"),
    "mla_cp2_p2p": (2, dict(context_parallel_size=2), {}, "mla"),
    "mla_cp2_all_gather": (2, dict(context_parallel_size=2),
                           dict(cp_comm_type=CPCommType.all_gather), "mla"),
    "mla_cp2_a2a": (2, dict(context_parallel_size=2), dict(cp_comm_type=CPCommType.a2a),
                    "mla_direct_q"),
    "mla_selective_cp2": (2, dict(context_parallel_size=2),
                          dict(recompute_granularity=SELECTIVE), "mla"),
    "mla_full_cp2_a2a": (2, dict(context_parallel_size=2),
                         dict(recompute_granularity=FULL, cp_comm_type=CPCommType.a2a), "mla"),
    "mla_tp2_cp2_all_gather": (4, dict(tensor_model_parallel_size=2, context_parallel_size=2),
                               dict(cp_comm_type=CPCommType.all_gather), "mla_direct_q"),
    "mla_tp2_sp_cp2_bf16": (4, TP2_SP | dict(context_parallel_size=2),
                            dict(precision=Precision.bf16), "mla"),
    "mla_ws2_ss2_bf16": (2, dict(tensor_parallel_num_weight_shards=2,
                                 tensor_parallel_num_sequence_shards=2),
                         dict(precision=Precision.bf16), "mla"),
    "mla_moe_cp2_a2a": (2, dict(context_parallel_size=2), dict(cp_comm_type=CPCommType.a2a),
                        "mla_moe"),
}
# Multi-token prediction (trainer.parts.mtp): one or two depths after the blocks, each keeping
# its norms, eh_proj's input, a block of the last block's kind (its stream in the compute dtype),
# its norm, the head's input and its loss's softmax; and DeepSeek-V3's shape, multi-latent
# attention with a dense block then experts, predicting one token more.
MTP_MODELS = {
    "mtp": dataclasses.replace(MODEL, mtp_num_layers=1),
    "mtp2": dataclasses.replace(MODEL, mtp_num_layers=2),
    "mla_moe_mtp": dataclasses.replace(MLA_MODELS["mla_moe"], mtp_num_layers=1),
}
WS2 = dict(tensor_parallel_num_weight_shards=2)
FULL_BF16 = dict(recompute_granularity=FULL, precision=Precision.bf16)
MTP_CASES = {  # name -> (world, Layout kwargs, EngineOptions kwargs, model)
    "mtp_one_process": (1, {}, {}, "mtp"),
    "mtp2_one_process": (1, {}, {}, "mtp2"),
    "mtp_tp2_sp": (2, TP2_SP, {}, "mtp"),
    "mtp2_tp2_sp_bf16": (2, TP2_SP, dict(precision=Precision.bf16), "mtp2"),
    "mtp_cp2": (2, dict(context_parallel_size=2), {}, "mtp"),
    "mtp2_cp2_a2a": (2, dict(context_parallel_size=2), dict(cp_comm_type=CPCommType.a2a),
                     "mtp2"),
    "mtp_selective": (1, {}, dict(recompute_granularity=SELECTIVE), "mtp"),
    "mtp2_tp2_sp_selective": (2, TP2_SP, dict(recompute_granularity=SELECTIVE), "mtp2"),
    # full recompute: the peak is the depth's block rebuilt beside the model's kept head
    "mtp_full": (1, {}, dict(recompute_granularity=FULL), "mtp"),
    "mtp2_full": (1, {}, dict(recompute_granularity=FULL), "mtp2"),
    "mtp_bf16": (1, {}, dict(precision=Precision.bf16), "mtp"),
    "mtp_ws2_full_bf16": (2, WS2, FULL_BF16, "mtp"),
    "mtp2_ws2_full_bf16": (2, WS2, FULL_BF16, "mtp2"),
    "mla_moe_mtp_one_process": (1, {}, {}, "mla_moe_mtp"),
    "mla_moe_mtp_selective": (1, {}, dict(recompute_granularity=SELECTIVE), "mla_moe_mtp"),
    "mla_moe_mtp_cp2_a2a": (2, dict(context_parallel_size=2),
                            dict(cp_comm_type=CPCommType.a2a), "mla_moe_mtp"),
    # the measured dry run's shape of DeepSeek-V3: EP, full recompute, bf16, weight shards
    "mla_moe_mtp_ep2_full_bf16": (2, dict(expert_model_parallel_size=2), FULL_BF16,
                                  "mla_moe_mtp"),
    "mla_moe_mtp_ws2_ep2_full_bf16": (2, WS2 | dict(expert_model_parallel_size=2), FULL_BF16,
                                      "mla_moe_mtp"),
}
# Local attention (gpt-oss's pattern): block 0 windowed 48 back, block 1 global, sinks. Under
# CP 4 by p2p (chunks of 64) the windowed block's exchange receives chunks beside the ring's
# block's own: 2 at runtime CP position 1 (the most; rank 0 receives 1), measured there.
LOCAL = dataclasses.replace(GQA, window_size=48, window_attn_skip_freq=2,
                            softmax_type="learnable")
LOCAL_CASES = {
    "local_one_process": (1, {}, {}),
    "local_cp4_p2p": (4, dict(context_parallel_size=4), {}),
    "local_cp4_p2p_bf16": (4, dict(context_parallel_size=4), dict(precision=Precision.bf16)),
    "local_cp4_all_gather": (4, dict(context_parallel_size=4),
                             dict(cp_comm_type=CPCommType.all_gather)),
    "local_cp2_a2a": (2, dict(context_parallel_size=2), dict(cp_comm_type=CPCommType.a2a)),
    "local_selective_cp4": (4, dict(context_parallel_size=4),
                            dict(recompute_granularity=SELECTIVE)),
}
# Gemma 3's block: zero-centred norms in fp32 whatever the compute dtype (qk norms included),
# a norm after each branch, GeGLU, a 5:1-style window (block 0 windowed, block 1 global).
# Under bf16 a post-norm's backward (fp32) is a block's largest moment under full recompute.
GEMMA = dataclasses.replace(QK, layernorm_zero_centered_gamma=True, sandwich_norm=True,
                            scale_embedding=True, activation_func="fast_gelu",
                            rotary_base_local=1e4, rope_theta=1e6,
                            seq_len_interpolation_factor=8.0, softmax_scale=48 ** -0.5,
                            window_size=48, window_attn_skip_freq=2)
GEMMA_CASES = {
    "gemma_bf16": (1, {}, dict(precision=Precision.bf16)),
    "gemma_tp2_sp_bf16": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True),
                          dict(precision=Precision.bf16)),
    "gemma_cp2_p2p_bf16": (2, dict(context_parallel_size=2), dict(precision=Precision.bf16)),
    "gemma_selective": (1, {}, dict(recompute_granularity=SELECTIVE)),
    "gemma_full_bf16": (1, {}, FULL_BF16),
    "gemma_ws2_bf16": (2, WS2, dict(precision=Precision.bf16)),
}
MEASURED_RANK = {"local_cp4_p2p": 1, "local_cp4_p2p_bf16": 1}
# gpt-oss's MLP: biases and the clamped SwiGLU (quick_gelu, an offset of 1, a clamp), dense and
# experts (with a shared expert), and the clamp without an offset (the clamped up kept).
GPT_OSS_MLP = dataclasses.replace(LOCAL, add_bias_linear=True, activation_func="quick_gelu",
                                  glu_linear_offset=1.0, activation_func_clamp_value=7.0)
GPT_OSS_MOE = dataclasses.replace(GPT_OSS_MLP, num_moe_experts=8, moe_router_topk=2,
                                  moe_ffn_hidden_size=256,
                                  moe_shared_expert_intermediate_size=128)
CLAMPED_SILU = dataclasses.replace(GQA, activation_func_clamp_value=7.0)
ACTIVATION_CASES = {  # name -> (world, Layout kwargs, EngineOptions kwargs, model)
    "gpt_oss_mlp_one_process": (1, {}, {}, GPT_OSS_MLP),
    "gpt_oss_mlp_tp2_sp_bf16": (2, TP2_SP, dict(precision=Precision.bf16), GPT_OSS_MLP),
    "gpt_oss_moe_one_process": (1, {}, {}, GPT_OSS_MOE),
    "gpt_oss_moe_ep2_cp2": (4, dict(expert_model_parallel_size=2, context_parallel_size=2), {},
                            GPT_OSS_MOE),
    "gpt_oss_moe_selective": (1, {}, dict(recompute_granularity=SELECTIVE), GPT_OSS_MOE),
    "clamped_silu_one_process": (1, {}, {}, CLAMPED_SILU),
}
# peft=lora: frozen weights keep no input for their gradient; the adapters' own tensors; the
# first block, fed by the frozen embedding, keeps less (most where its attention has none).
ALL_TARGETS = Adapters(16, frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                      "up_proj", "down_proj"}), 0.0)
LORA_CASES = {  # name -> (world, Layout kwargs, EngineOptions kwargs, model)
    "lora_one_process": (1, {}, dict(lora=ALL_TARGETS), MODEL),
    "lora_tp2_sp": (2, TP2_SP, dict(lora=ALL_TARGETS), MODEL),
    "lora_q_v_bf16": (1, {}, dict(precision=Precision.bf16,
                                  lora=Adapters(8, frozenset({"q_proj", "v_proj"}), 0.0)), GQA),
    "lora_o_down_dropout_tp2_sp": (2, TP2_SP, dict(
        lora=Adapters(8, frozenset({"o_proj", "down_proj"}), 0.1)), MODEL),
    "lora_selective_bf16": (2, TP2_SP, dict(precision=Precision.bf16,
                                            recompute_granularity=SELECTIVE, lora=ALL_TARGETS),
                            MODEL),
    "lora_mlp_one_process": (1, {}, dict(lora=Adapters(16, frozenset({"gate_proj", "up_proj"}),
                                                       0.0)), MODEL),
    # peft.base_precision=bf16: autocast keeps casts of the adapters alone
    "lora_bf16_base_tp2_sp": (2, TP2_SP, dict(precision=Precision.bf16, lora=replace(
        ALL_TARGETS, base_bf16=True)), MODEL),
    "lora_bf16_base_q_v": (1, {}, dict(precision=Precision.bf16, lora=Adapters(
        8, frozenset({"q_proj", "v_proj"}), 0.0, base_bf16=True)), GQA),
    # a mixture of experts: one adapter per routed expert (a shared expert takes none)
    "lora_moe_one_process": (1, {}, dict(lora=ALL_TARGETS), MOE_MODELS["moe_sigmoid_shared"]),
    # (EP 2 in bf16 with every target, +0.14% / -0.10%, left CI for its time in issue 44)
    "lora_moe_bf16_base_tp2_sp_etp2": (2, TP2_SP, dict(precision=Precision.bf16, lora=Adapters(
        8, frozenset({"q_proj", "up_proj"}), 0.0, base_bf16=True)), MOE_MODELS["moe"]),
}
# Qwen3-Next's hybrid: a Gated DeltaNet block (2 key heads shared by 4 value heads) before a
# gated full-attention block with partial rotary and zero-centred qk norms. What each
# cp_comm_type keeps of the linear block differs (trainer.parts.gdn.kept_bytes).
HYBRID = dataclasses.replace(
    MODEL, name="qwen3_next", num_query_groups=2, kv_channels=64, qk_layernorm=True,
    attention_output_gate=True, rotary_percent=0.25, layernorm_zero_centered_gamma=True,
    experimental_attention_variant="gated_delta_net", linear_attention_freq=[1, 0],
    linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2,
    linear_num_value_heads=4)
# Where a linear block's own moments are the step's peak (its backward's rule step, its chunk
# loop's forward): a full block then two linear ones (8 value heads of 64), a hidden size of
# 128, an MLP of 16 and a vocabulary of 128, so neither the MLP's nor the head's outgrow them.
LINEAR_HEAVY = dataclasses.replace(
    HYBRID, name="llama", vocab_size=128, hidden_size=128, ffn_hidden_size=16, num_layers=3,
    linear_attention_freq=[0, 1, 1], linear_num_key_heads=2, linear_num_value_heads=8)
HYBRID_CASES = {  # name -> (world, Layout kwargs, EngineOptions kwargs, model)
    "hybrid_one_process": (1, {}, {}, HYBRID),
    "hybrid_tp2_sp_bf16": (2, TP2_SP, dict(precision=Precision.bf16), HYBRID),
    "hybrid_cp2_a2a_bf16": (2, dict(context_parallel_size=2),
                            dict(cp_comm_type=CPCommType.a2a, precision=Precision.bf16), HYBRID),
    # the rule's backward step rebuilt (selective), or with the block (full, bf16)
    "linear_heavy_selective": (1, {}, dict(recompute_granularity=SELECTIVE), LINEAR_HEAVY),
    "linear_heavy_full_bf16": (1, {}, dict(recompute_granularity=FULL,
                                           precision=Precision.bf16), LINEAR_HEAVY),
    # p2p's relay: each chunk rebuilt, the states passed back; all_gather's forward
    "linear_heavy_cp2_p2p": (2, dict(context_parallel_size=2), {}, LINEAR_HEAVY),
    "linear_heavy_cp2_all_gather": (2, dict(context_parallel_size=2),
                                    dict(cp_comm_type=CPCommType.all_gather), LINEAR_HEAVY),
    # Qwen3-Next's experts: the shared expert's gate keeps its own copy of its input under SP
    "hybrid_moe_tp2_sp": (2, TP2_SP, {}, dataclasses.replace(
        HYBRID, num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=128,
        moe_shared_expert_intermediate_size=128, moe_shared_expert_gate=True)),
}
ALL_CASES = {**CASES, **GQA_CASES, **QK_CASES, **LOCAL_CASES, **GEMMA_CASES,
             **{n: c[:3] for n, c in (MOE_CASES | MLA_CASES | MTP_CASES
                                      | ACTIVATION_CASES | LORA_CASES | HYBRID_CASES).items()}}


def case(name: str) -> tuple[int, dict, dict, ModelConfig]:
    """(world, Layout kwargs, EngineOptions kwargs, model) of a named case."""
    if name in MOE_CASES:
        return (*ALL_CASES[name], MOE_MODELS[MOE_CASES[name][3]])
    if name in MLA_CASES:
        return (*ALL_CASES[name], MLA_MODELS[MLA_CASES[name][3]])
    if name in MTP_CASES:
        return (*ALL_CASES[name], MTP_MODELS[MTP_CASES[name][3]])
    if name in ACTIVATION_CASES | LORA_CASES | HYBRID_CASES:
        return (ACTIVATION_CASES | LORA_CASES | HYBRID_CASES)[name]
    model = QK if name in QK_CASES else GQA if name in GQA_CASES else \
        LOCAL if name in LOCAL_CASES else GEMMA if name in GEMMA_CASES else MODEL
    return (*ALL_CASES[name], model)


@pytest.mark.parametrize("name", ALL_CASES)
def test_planned_activations_are_what_autograd_keeps(name):
    world, layout_kwargs, option_kwargs, model = case(name)
    layout = Layout(world, micro_batch_size=2, seq_length=512, **layout_kwargs)
    options = EngineOptions(**option_kwargs)
    measured = simulated(world, MEASURED_RANK.get(name, 0), saved_activation_bytes, layout,
                         options, model)
    plan = planned(layout, options, model)
    # autocast's bf16 copies of unsharded weights are kept for backward like activations
    expected = plan["activation_bytes"] + plan["autocast_weight_bytes"]
    print(f"\n{name}: saved {measured:,} B, planned {expected:,} B "
          f"({measured / expected - 1:+.2%})")
    # What the formula leaves out is a few id and mask tensors of T elements each.
    assert abs(measured / expected - 1) < 0.01


def allocated_transients(rank: int, layout: Layout, options: EngineOptions,
                         model: ModelConfig = MODEL) -> tuple[int, int]:
    """(the micro-batches' transient, the update's) of a second step, counted by the
    allocator above what the rank held before each part (its state made by the first)."""
    from trainer.train.allocations import Allocations
    from trainer.train.batch import rank_micro_batches
    from trainer.train.engine import build_engine
    from trainer.train.step import train_step

    engine = build_engine(model, OPTIM, 0, layout, torch.device("cpu"), options,
                          peft=peft_of(options))
    fetch = lambda idx: torch.randint(0, model.vocab_size, (len(idx), layout.seq_length + 1))  # noqa: E731
    micro_batches = rank_micro_batches(fetch, layout, rank, mtp_depths=model.mtp_num_layers or 0)
    train_step(engine.model, engine.optimizer, micro_batches, 1e-4)
    with Allocations() as counted:
        train_step(engine.model, engine.optimizer, micro_batches, 1e-4, counted.mark)
    return (counted.phase("micro_batches").transient_bytes,
            counted.phase("update").transient_bytes)


@pytest.mark.parametrize("name", ALL_CASES)
def test_allocator_counted_transients_against_the_plan(name):
    """What the allocator holds at most during the micro-batches (above the state) is the
    plan's step transients within 2%, and during the update its update term within 2%."""
    world, layout_kwargs, option_kwargs, model = case(name)
    layout = Layout(world, micro_batch_size=2, seq_length=512, **layout_kwargs)
    options = EngineOptions(**option_kwargs)
    step, update = simulated(world, 0, allocated_transients, layout, options, model)
    plan = planned(layout, options, model)
    (state,) = memory_per_stage(parameter_shapes(model, peft_of(options)), model.num_layers,
                                layout, model.tie_word_embeddings, lora=options.lora is not None)
    transients = plan["transient_bytes"]  # the micro-batches' (the update's is below)
    phase = "head" if plan["head_phase_bytes"] >= plan["block_phase_bytes"] else "block"
    print(f"\n{name}: micro-batches {step:,} B, planned {transients:,} B ({phase} phase, "
          f"{transients / step - 1:+.2%}); update {update:,} B, planned "
          f"{state.update_bytes:,} B ({update / state.update_bytes - 1:+.2%})")
    assert abs(update / state.update_bytes - 1) < 0.02
    assert abs(transients / step - 1) < 0.02


# Four blocks over two stages, four micro-batches: messages in flight in both directions.
PP_MODEL = dataclasses.replace(MODEL, num_layers=4)
PP_MOE = dataclasses.replace(MOE_MODELS["moe_seq"], num_layers=4, moe_layer_freq=[1, 0, 1, 1])
PP_CASES = {  # name -> (world, Layout kwargs, schedule, model[, EngineOptions kwargs])
    "pp2_1f1b": (2, dict(pipeline_model_parallel_size=2), "1f1b", PP_MODEL),
    "pp2_interleaved": (2, dict(pipeline_model_parallel_size=2,
                                virtual_pipeline_model_parallel_size=2), "interleaved_1f1b",
                        PP_MODEL),
    # a mixture of experts in stages, its experts over EP 2 (a dense block on stage 0)
    "pp2_moe_ep2": (4, dict(pipeline_model_parallel_size=2, expert_model_parallel_size=2),
                    "1f1b", PP_MOE),
    # multi-token prediction's depth on the last stage, beside its copy of the embedding
    "pp2_mtp": (2, dict(pipeline_model_parallel_size=2), "1f1b",
                dataclasses.replace(PP_MODEL, mtp_num_layers=1)),
    # peft=lora: the model's first block (fed by the frozen embedding) on stage 0 only
    "pp2_lora": (2, dict(pipeline_model_parallel_size=2), "1f1b", PP_MODEL),
    # the zero-bubble schedules: what W needs kept from I; a V's turn on stage 1, the head on 0
    "pp2_zb_h1": (2, dict(pipeline_model_parallel_size=2), "zb_h1", PP_MODEL),
    "pp2_zbv": (2, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
                "zbv", PP_MODEL),
}
# bf16: autocast's weight copies, made anew by each micro-batch's forward, kept by each pair
# in flight (two on stage 0; a chunk's own on each of a V's turns)
PP_BF16 = dict(precision=Precision.bf16)
PP_CASES |= {
    "pp2_1f1b_bf16": (*PP_CASES["pp2_1f1b"], PP_BF16),
    "pp2_interleaved_bf16": (*PP_CASES["pp2_interleaved"], PP_BF16),
    "pp2_zb_h1_tp2_sp_bf16": (4, dict(pipeline_model_parallel_size=2, **TP2_SP), "zb_h1",
                              PP_MODEL, PP_BF16),
    "pp2_zbv_bf16": (*PP_CASES["pp2_zbv"], PP_BF16),
    # a split backward under full recompute: W holds the rebuilt linears' inputs while the
    # I rebuilds the blocks before; under weight sharding W forms the gradient messages
    "pp2_zb_h1_full": (*PP_CASES["pp2_zb_h1"], dict(recompute_granularity=FULL)),
    "pp2_zbv_ws2": (4, dict(PP_CASES["pp2_zbv"][1], **WS2), "zbv", PP_MODEL),
    "pp2_zbv_ws2_full": (4, dict(PP_CASES["pp2_zbv"][1], **WS2), "zbv", PP_MODEL,
                         dict(recompute_granularity=FULL)),
}
PP_LORA = {"pp2_lora": ALL_TARGETS}


@pytest.mark.parametrize("name", PP_CASES)
@pytest.mark.parametrize("stage", [0, 1])
def test_allocator_counted_transients_of_pipeline_stages(name, stage):
    """A simulated rank of each stage, its schedule's micro-batches and messages in flight:
    what the allocator holds at most is the stage's planned transients (activations of every
    pair in flight, the messages it holds, a backward's moment)."""
    world, layout_kwargs, schedule, model, *option_kwargs = PP_CASES[name]
    layout = Layout(world, micro_batch_size=2, seq_length=512, global_batch_size=4 * world,
                    **layout_kwargs)
    options = EngineOptions(pipeline_schedule=schedule, lora=PP_LORA.get(name),
                            **(option_kwargs[0] if option_kwargs else {}))
    rank = layout.groups("pp")[0][stage]
    step, update = simulated(world, rank, allocated_transients, layout, options, model)
    shapes = parameter_shapes(model, peft_of(options))
    plan = step_per_stage(shapes, model, layout, options)[stage]
    state = memory_per_stage(shapes, model.num_layers, layout, lora=options.lora is not None,
                             v_shape=schedule == "zbv")[stage]
    transients = plan["peak_bytes"] - state.total_bytes
    print(f"\n{name} stage {stage}: micro-batches {step:,} B, planned {transients:,} B "
          f"({transients / step - 1:+.2%}, messages {plan['message_bytes']:,} B); update "
          f"{update:,} B, planned {state.update_bytes:,} B")
    assert plan["message_bytes"] > 0
    assert abs(transients / step - 1) < 0.02
    assert abs(update / state.update_bytes - 1) < 0.02


def context_bytes(rank: int, layout: Layout, options: EngineOptions, model: ModelConfig
                  ) -> tuple[int, int]:
    """Bytes one rank sends over its context group in a micro-batch's forward, and in its
    backward (the group's own counters, parallel.comm)."""
    from trainer.train.batch import rank_micro_batches
    from trainer.train.engine import build_engine

    engine = build_engine(model, OPTIM, 0, layout, torch.device("cpu"), options,
                          peft=peft_of(options))
    fetch = lambda idx: torch.randint(0, model.vocab_size, (len(idx), layout.seq_length + 1))  # noqa: E731
    mb = rank_micro_batches(fetch, layout, rank)[0]
    stats = engine.groups.stats

    def sent() -> int:
        return sum(n for (group, _), n in stats.bytes.items() if group == "context")

    stats.reset()
    loss = engine.model.token_losses(engine.model(mb.tokens, mb.positions), mb.labels).sum()
    forward = sent()
    stats.reset()
    loss.backward()
    return forward, sent()


@pytest.mark.parametrize("precision", list(Precision))
@pytest.mark.parametrize("comm", list(CPCommType))
@pytest.mark.parametrize("model", ["llama", "mla"])
def test_planned_context_exchange_is_what_the_context_group_sends(model, comm, precision):
    """The cost model's K/V exchange of a block (trainer.plan.axis_costs.context), timed on a
    link of 1 B/s without latency, is the bytes the context group sends, forward and backward:
    multi-latent attention's v padded to q's width, a2a's (C-1)/C of each local tensor."""
    from trainer.plan.axis_costs.context import context_seconds
    from trainer.plan.hardware import Hardware

    config = MODEL if model == "llama" else MLA
    layout = Layout(4, micro_batch_size=2, seq_length=512, context_parallel_size=4)
    options = EngineOptions(precision, cp_comm_type=comm)
    forward, backward = simulated(4, 0, context_bytes, layout, options, config)
    byte_a_second = Hardware(80, 0.1, 1, 1, 1, nvlink_bandwidth_gbs=1e-9,
                             network_bandwidth_gbs=1e-9, link_latency_us=0.0,
                             gpus_per_nvlink_domain=8)
    e = 2 if precision is Precision.bf16 else 4
    planned = context_seconds(config, layout, comm, byte_a_second, layout.micro_batch_size
                              * layout.context_local_length, e, 0.0, False)
    blocks = config.num_layers
    print(f"\n{model} {comm.value} {precision.value}: sent {forward // blocks:,} B forward, "
          f"{backward // blocks:,} B backward a block; planned {planned[0]:,.0f}, "
          f"{planned[1]:,.0f}")
    assert planned == pytest.approx((forward / blocks, backward / blocks), rel=1e-9)


def largest_tensor_of_build(rank: int, layout: Layout) -> int:
    """Elements of the largest tensor any operation creates while the rank builds its engine."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from trainer.train.engine import build_engine

    largest = [0]

    class Census(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                    largest[0] = max(largest[0], tensor.numel())
            return out

    with Census():
        build_engine(MODEL, OPTIM, 0, layout, torch.device("cpu"))
    return largest[0]


def test_a_rank_never_builds_a_full_weight():
    """Rank 5 of 64, weights sharded 64 ways: the largest tensor of the build is the rank's
    own flat buffer of shards (1/64 of the model's 2-D weights, optimizer.FlatBuffer), smaller
    than any single full 2-D weight."""
    layout = Layout(64, tensor_parallel_num_weight_shards=64,
                    tensor_parallel_num_sequence_shards=64, seq_length=512)
    shapes = parameter_shapes(MODEL)
    smallest = min(a * b for a, b in (s for s in shapes.values() if len(s) == 2))
    own = sum(a * -(-b // 64) for b, a in (s for s in shapes.values() if len(s) == 2))
    largest = simulated(64, 5, largest_tensor_of_build, layout)
    print(f"\nlargest tensor of the build: {largest:,} elements; the rank's shards {own:,}; "
          f"smallest full weight {smallest:,}")
    assert 0 < largest <= own < smallest


WORLD_64 = ["cluster.num_nodes=8", "cluster.procs_per_node=8",
            "parallel.tensor_parallel_num_weight_shards=8",
            "parallel.tensor_parallel_num_sequence_shards=8", "parallel.context_parallel_size=2",
            "model.hidden_size=512", "model.num_heads=8", "model.ffn_hidden_size=1376",
            "train.seq_length=8192", "train.micro_batch_size=2", "train.eval_interval=null"]
# gpt-oss's dense block at that size: windows 255 back in every other block (runtime CP 16,
# chunks of 256: the window's exchange), sinks, biases, the clamped SwiGLU, YaRN
GPT_OSS_DENSE = ["model=tiny_gpt_oss", "model.name=llama", "model.num_moe_experts=null",
                 "model.moe_ffn_hidden_size=null", "model.moe_aux_loss_coeff=0.0",
                 "model.kv_channels=64", "model.num_query_groups=4", "model.window_size=255",
                 "model.original_max_position_embeddings=4096"]


# Qwen3-Next's hybrid at that size (dense): a full block then three Gated DeltaNet blocks of 8
# value heads of 64, the relay passing their states along runtime CP 16
QWEN3_NEXT_DENSE = ["model=tiny_qwen3_next", "model.num_moe_experts=null",
                    "model.moe_ffn_hidden_size=null",
                    "model.moe_shared_expert_intermediate_size=null",
                    "model.moe_shared_expert_gate=false", "model.moe_aux_loss_coeff=0.0",
                    "model.kv_channels=64", "model.linear_key_head_dim=64",
                    "model.linear_value_head_dim=64", "model.linear_num_key_heads=4",
                    "model.linear_num_value_heads=8"]


@pytest.mark.parametrize("model", [[], GPT_OSS_DENSE, QWEN3_NEXT_DENSE],
                         ids=["llama", "gpt_oss_dense", "qwen3_next_dense"])
def test_measured_dry_run_of_a_64_rank_world_matches_the_plan(tmp_path, model):
    """The real CLI: rank 9 of 64 (WS 8, SS 8, CP 2, DP 4), its engine built and one step run
    in this one process; the state it allocated is the plan's to the byte, what its allocator
    held is the plan's terms, and its resident peak is near the planned peak."""
    run_dir = tmp_path / "run"
    overrides = [*model, *WORLD_64]
    result = subprocess.run(
        [sys.executable, "launch.py", *overrides, "dry_run=true", "dry_run_rank=9",
         f"hydra.run.dir={run_dir}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "measured (rank 9 of a simulated world of 64" in result.stdout
    record = json.loads((run_dir / "layout.json").read_text())
    measured, plan = record["measured"], record["memory"]["per_stage"][0]
    print(f"\nmeasured {measured}\nplanned peak {plan['peak_bytes']:,}, state "
          f"{plan['total_bytes']:,}")
    assert measured["rank"] == 9 and measured["world_size"] == 64
    assert measured["state_bytes"] == plan["total_bytes"]
    # Resident memory is the end-to-end figure, glibc's mmap threshold fixed (measured_rank.py):
    # above the allocator's count by small blocks kept in the heap and the kernels' code paged in
    # on the first step (1.15 here, three runs; 1.35 to 1.55 with glibc's moving threshold).
    assert 1.0 <= measured["step_peak_bytes"] / plan["peak_bytes"] <= 1.25
    # Counted by the allocator: the update's transient and the micro-batches' (here a block's
    # backward with GTP_remat's gathers and the ring's) are the plan's terms within 2%.
    assert abs(measured["update_transient_bytes"] / plan["update_bytes"] - 1) < 0.02
    planned_step = plan["peak_bytes"] - plan["total_bytes"]
    print(f"step transients {measured['step_transient_bytes']:,} B, planned {planned_step:,} B")
    assert abs(planned_step / measured["step_transient_bytes"] - 1) < 0.02
    # (Build peak over state is a bench figure at the seed's scale: here the state is 7 MiB
    # and fixed costs such as the CP mask dominate it.)
    assert 0 < measured["build_peak_bytes"] < measured["step_peak_bytes"]
