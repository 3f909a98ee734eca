"""The product promise, row by row: a wrong run fails in a second, before anything starts, with
one line naming the key, the value and the fix, no traceback and a non-zero exit code.

Every row runs the real CLI, `python launch.py <overrides> dry_run=true hydra.run.dir=<tmp>`
(START rows leave dry_run out: a real start, for what is only checked at start). The table runs
as one batch; each row is then its own test. Rows refused before torch run the CLI in forks of
one interpreter that did launch.py's imports once (warm_cli.py: 0.3 s of a 0.7 s row); the
rest are new interpreters.

How the lines are counted. Hydra frames every error the job raises: a header echoing the
overrides ("Error executing job with overrides: [...]") and, last, the hint "Set the environment
variable HYDRA_FULL_ERROR=1 for a complete stack trace." Both are Hydra's, printed for any
error, and say nothing of the problem. The test strips exactly those two lines (and blank ones)
and then requires exactly ONE line: the message, which names the key and value and says "Fix:".
Errors Hydra would report while composing (wrong types, unknown keys without `+`, unknown group
options, sweeps without -m, unparsable overrides) are OURS rows too: launch.py checks the
overrides before Hydra composes them (trainer/compose/overrides.py), so they are one line as well
instead of Hydra's several. The HYDRA kind (Hydra's own several-line message, asserting only that
the key and value are named) is kept for a case we cannot reach; no row needs it today. Rows
rejected at compose time run with `torch` made unimportable, so every check is proven
torch-free (a check that leaked to a later stage would fail the row with an ImportError).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from config_helpers import ROOT
from warm_cli import run_warm

HYDRA_HEADER = "Error executing job with overrides: "
HYDRA_HINT = "Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace."
OURS, HYDRA, OK = "ours", "hydra", "accepted"
TP2 = ("parallel.tensor_model_parallel_size=2 parallel.sequence_parallel=true "
       "cluster.procs_per_node=2")
TP4 = ("parallel.tensor_model_parallel_size=4 parallel.sequence_parallel=true "
       "cluster.procs_per_node=4")
# DPO's data flags: a row past them reaches the data and dpo.* checks
DPO_DATA = "data.pack=true data.reset_attention_mask=true data.reset_position_ids=true"
SHORT = "train.train_samples=64"  # a real start that wrongly passed would still end soon
PP2 = "cluster.procs_per_node=2 parallel.pipeline_model_parallel_size=2"


@dataclass(frozen=True)
class Row:
    overrides: str  # {ds} {notds} {trunc} {empty} {file} {chat...}: what `paths` makes
    named: tuple[str, ...]  # must appear in the message line: the key and its value
    kind: str = OURS
    start: bool = False  # a real start (no dry_run=true)
    torch: bool = False  # torch may be imported (accepted dry runs, checks made at start)


R = Row
TABLE = [
    # parallel layout rules (parallel/layout/__init__.py)
    R("parallel.tensor_model_parallel_size=2", ("world_size=1", "x PP = 2 x 1 x 1 x 1 = 2")),
    R("parallel.context_parallel_size=2", ("world_size=1", "x PP = 1 x 1 x 2 x 1 = 2")),
    R("cluster.procs_per_node=2 parallel.tensor_model_parallel_size=2 "
      "parallel.tensor_parallel_num_weight_shards=3", ("tensor_parallel_num_weight_shards=3",)),
    R(f"{TP2} parallel.tensor_parallel_num_sequence_shards=3",
      ("tensor_parallel_num_sequence_shards=3",)),
    R("cluster.procs_per_node=8 parallel.tensor_model_parallel_size=2 "
      "parallel.tensor_parallel_num_weight_shards=8 parallel.tensor_parallel_num_sequence_shards=2",
      ("tensor_parallel_num_sequence_shards=2", "sequence_parallel")),
    R("cluster.procs_per_node=4 parallel.tensor_parallel_num_weight_shards=4 "
      "parallel.tensor_parallel_num_sequence_shards=3", ("tensor_parallel_num_sequence_shards=3",)),
    R("train.global_batch_size=12", ("train.global_batch_size=12",)),
    R("cluster.procs_per_node=2 parallel.context_parallel_size=2 train.seq_length=126",
      ("train.seq_length=126",)),
    R("parallel.tensor_model_parallel_size=0", ("parallel.tensor_model_parallel_size=0",)),
    R("parallel.context_parallel_size=0", ("parallel.context_parallel_size=0",)),
    R("parallel.pipeline_model_parallel_size=0", ("parallel.pipeline_model_parallel_size=0",)),
    R("parallel.tensor_parallel_num_weight_shards=0", ("tensor_parallel_num_weight_shards=0",)),
    R("parallel.tensor_parallel_num_sequence_shards=0", ("tensor_parallel_num_sequence_shards=0",)),
    R("train.micro_batch_size=0", ("train.micro_batch_size=0",)),
    R("train.global_batch_size=0", ("train.global_batch_size=0",)),
    R("train.seq_length=0", ("train.seq_length=0",)),
    # the model against the layout, and the model's own shape
    R(f"model.num_heads=2 {TP4}", ("model.num_heads=2", "tensor_model_parallel_size=4")),
    R(f"model.vocab_size=257 model.make_vocab_size_divisible_by=1 {TP2}",
      ("model.vocab_size=257", "make_vocab_size_divisible_by=1", "tensor_model_parallel_size=2")),
    R(f"model.make_vocab_size_divisible_by=6 {TP4}",
      ("make_vocab_size_divisible_by=6", "is 258", "a multiple of 4")),
    R("model.make_vocab_size_divisible_by=0", ("model.make_vocab_size_divisible_by=0",)),
    R("model.use_rope_scaling=true model.rope_scaling_factor=0.5",
      ("model.rope_scaling_factor=0.5",)),
    R("model.num_query_groups=3", ("model.num_query_groups=3", "model.num_heads=4")),
    R("model.kv_channels=0", ("model.kv_channels=0",)),
    # a mixture of experts (trainer/checks.py check_moe; its layouts: trainer/plan/axis_costs)
    R("model.num_moe_experts=0", ("model.num_moe_experts=0",)),
    R("model.num_moe_experts=4 model.moe_router_topk=5", ("model.moe_router_topk=5", "=4")),
    R("model.num_moe_experts=4 model.moe_layer_freq=[1,0,1]",
      ("model.moe_layer_freq=[1, 0, 1]", "model.num_layers=2")),
    R("model.num_moe_experts=4 model.moe_layer_freq=0", ("model.moe_layer_freq=0",)),
    R("model.num_moe_experts=4 model.moe_layer_freq=[0,0]", ("model.moe_layer_freq=[0, 0]",)),
    R("model.num_moe_experts=4 model.moe_router_score_function=relu",
      ("model.moe_router_score_function='relu'",)),
    R("model.num_moe_experts=4 model.moe_router_score_function=sigmoid "
      "model.moe_router_pre_softmax=true", ("model.moe_router_pre_softmax=true",)),
    R("model.num_moe_experts=4 model.moe_router_enable_expert_bias=true",
      ("model.moe_router_enable_expert_bias=true", "sigmoid")),
    R("model.num_moe_experts=4 model.moe_router_load_balancing_type=none "
      "model.moe_aux_loss_coeff=0.1", ("model.moe_aux_loss_coeff=0.1", "=none")),
    R("model.num_moe_experts=4 model.moe_aux_loss_coeff=-1", ("model.moe_aux_loss_coeff=-1",)),
    R("model.moe_aux_loss_coeff=0.1", ("model.moe_aux_loss_coeff=0.1", "num_moe_experts=null")),
    # TP with experts: sequence parallel (each TP rank routes its part), experts whole (ETP 1)
    R("model.num_moe_experts=4 cluster.procs_per_node=2 parallel.tensor_model_parallel_size=2 "
      "parallel.expert_tensor_parallel_size=1",
      ("model.num_moe_experts=4", "tensor_model_parallel_size=2", "sequence_parallel=true")),
    R(f"model.num_moe_experts=4 model.moe_ffn_hidden_size=49 {TP2}",
      ("parallel.expert_tensor_parallel_size=None", "null = TP = 2", "FFN of 49", "[1, 7, 49]")),
    R("model.num_moe_experts=4 parallel.pipeline_model_parallel_size=2 "
      "cluster.procs_per_node=2", (), OK, torch=True),  # experts in pipeline stages
    R("model.num_moe_experts=4 model.moe_layer_freq=[0,1] model.moe_router_score_function="
      "sigmoid model.moe_router_enable_expert_bias=true", (), OK, torch=True),
    # expert parallel (parallel/layout/axes/expert.py; its model rules:
    # trainer/plan/axis_costs/expert.py)
    R("parallel.expert_model_parallel_size=0", ("parallel.expert_model_parallel_size=0",)),
    R("parallel.expert_tensor_parallel_size=1.5", ("parallel.expert_tensor_parallel_size=1.5",)),
    R("parallel.expert_tensor_parallel_size=0", ("parallel.expert_tensor_parallel_size=0",)),
    R("model.num_moe_experts=4 cluster.procs_per_node=6 parallel.expert_tensor_parallel_size=4",
      ("world_size=6", "ETP x EP x PP = 4 x 1 x 1 = 4")),
    R("model.num_moe_experts=4 parallel.expert_model_parallel_size=2",
      ("world_size=1", "ETP x EP x PP = 1 x 2 x 1 = 2")),
    R("cluster.procs_per_node=2 parallel.expert_model_parallel_size=2",
      ("parallel.expert_model_parallel_size=2", "model.num_moe_experts=null")),
    R("cluster.procs_per_node=2 parallel.expert_tensor_parallel_size=2",
      ("parallel.expert_tensor_parallel_size=2", "model.num_moe_experts=null")),
    R("model.moe_router_bias_update_rate=0.01", ("model.moe_router_bias_update_rate=0.01",
                                                 "dense model")),
    R("model=tiny_moe model.moe_router_bias_update_rate=0.01",
      ("model.moe_router_bias_update_rate=0.01", "moe_router_enable_expert_bias=false")),
    R("model.num_moe_experts=6 cluster.procs_per_node=4 parallel.expert_model_parallel_size=4",
      ("parallel.expert_model_parallel_size=4", "model.num_moe_experts=6", "[1, 2, 3, 6]")),
    R("model.num_moe_experts=4 model.moe_ffn_hidden_size=50 cluster.procs_per_node=4 "
      "parallel.expert_tensor_parallel_size=4",
      ("parallel.expert_tensor_parallel_size=4", "FFN of 50", "[1, 2, 5, 10, 25, 50]")),
    R("model.num_moe_experts=4 cluster.procs_per_node=4 parallel.expert_model_parallel_size=4",
      (), OK, torch=True),
    R("model.num_moe_experts=4 model.moe_token_dispatcher_type=ring",
      ("model.moe_token_dispatcher_type='ring'", "alltoall, allgather")),
    R("model.moe_token_dispatcher_type=allgather",
      ("model.moe_token_dispatcher_type=allgather", "num_moe_experts=null")),
    R("model.num_moe_experts=4 model.moe_expert_capacity_factor=0",
      ("model.moe_expert_capacity_factor=0", "null for dropless")),
    # group-limited routing (trainer/parts/moe.py check_groups)
    R("model.num_moe_experts=4 model.moe_router_num_groups=2",
      ("model.moe_router_group_topk=null", "needs both", "Fix: set model.moe_router_group_topk")),
    R("model.num_moe_experts=4 model.moe_router_num_groups=3 model.moe_router_group_topk=1",
      ("model.moe_router_num_groups=3", "model.num_moe_experts=4")),
    R("model.num_moe_experts=4 model.moe_router_num_groups=2 model.moe_router_group_topk=3",
      ("model.moe_router_group_topk=3", "[1, model.moe_router_num_groups=2]")),
    R("model.num_moe_experts=8 model.moe_router_topk=1 model.moe_router_num_groups=4 "
      "model.moe_router_group_topk=2", ("model.moe_router_topk=1", "a topk in [2, 4]")),
    R("model.moe_router_num_groups=2", ("model.moe_router_num_groups=2", "num_moe_experts=null")),
    R("model.moe_expert_capacity_factor=1.25",
      ("model.moe_expert_capacity_factor=1.25", "num_moe_experts=null")),
    R("model.kv_channels=15", ("model.kv_channels=15", "odd")),
    R("model.num_heads=3 model.kv_channels=16", (), OK, torch=True),  # heads need not divide h
    R(f"model.num_heads=8 model.num_query_groups=2 {TP4}",
      ("model.num_query_groups=2", "tensor_model_parallel_size=4")),
    R("model.num_heads=8 model.num_query_groups=2 cluster.procs_per_node=4 "
      "parallel.context_parallel_size=4 parallel.cp_comm_type=a2a",
      ("parallel.cp_comm_type=a2a", "model.num_query_groups=2", "runtime CP = 4")),
    R(f"model.ffn_hidden_size=177 {TP2}", ("model.ffn_hidden_size=177",)),
    # pipeline stages: the layer split, the schedule and its micro-batches
    R("model.num_layers=3 cluster.procs_per_node=2 parallel.pipeline_model_parallel_size=2",
      ("model.num_layers=3", "2 pipeline stage(s)")),
    R("model.num_layers=4 cluster.procs_per_node=2 parallel.pipeline_model_parallel_size=2 "
      "parallel.num_layers_in_first_pipeline_stage=5",
      ("num_layers_in_first_pipeline_stage=5", "model.num_layers=4", "add up to 5")),
    R("parallel.num_layers_in_last_pipeline_stage=1",
      ("num_layers_in_last_pipeline_stage=1", "pipeline_model_parallel_size > 1")),
    R("parallel.num_layers_in_first_pipeline_stage=0", ("num_layers_in_first_pipeline_stage=0",)),
    R("parallel.pipeline_schedule=zigzag", ("parallel.pipeline_schedule='zigzag'", "gpipe")),
    R(f"{PP2} parallel.pipeline_schedule=interleaved_1f1b",
      ("interleaved_1f1b", "virtual_pipeline_model_parallel_size >= 2")),
    R(f"{PP2} model.num_layers=4 parallel.virtual_pipeline_model_parallel_size=2 "
      "train.global_batch_size=16",
      ("virtual_pipeline_model_parallel_size=2", "pipeline_schedule=interleaved_1f1b")),
    R(f"{PP2} model.num_layers=4 parallel.virtual_pipeline_model_parallel_size=2 "
      "parallel.pipeline_schedule=interleaved_1f1b train.global_batch_size=24",
      ("virtual_pipeline_model_parallel_size=2", "(3 =", "global_batch_size to 16 or 32")),
    R(f"{PP2} parallel.virtual_pipeline_model_parallel_size=2 "
      "parallel.pipeline_schedule=interleaved_1f1b train.global_batch_size=16",
      ("pipeline stage 0 gets 1 layer(s)", "virtual_pipeline_model_parallel_size=2")),
    R(f"{PP2} model.num_layers=4 parallel.virtual_pipeline_model_parallel_size=2 "
      "parallel.pipeline_schedule=interleaved_1f1b train.global_batch_size=16 "
      "model.tie_word_embeddings=true", (), OK, torch=True),
    # zero bubble: zbv's V is two chunks a stage; its first stage holds both ends; a split
    # backward and compiled blocks do not go together
    R(f"{PP2} parallel.pipeline_schedule=zbv",
      ("pipeline_schedule=zbv", "virtual_pipeline_model_parallel_size=2", "zb_h1")),
    R(f"{PP2} model.num_layers=4 parallel.virtual_pipeline_model_parallel_size=2 "
      "parallel.pipeline_schedule=zbv train.global_batch_size=16 "
      "parallel.num_layers_in_first_pipeline_stage=2",
      ("num_layers_in_first_pipeline_stage=2", "zbv", "=null")),
    R(f"{PP2} parallel.pipeline_schedule=zb_h1 train.compile=blocks",
      ("pipeline_schedule=zb_h1", "train.compile=none")),
    R(f"{PP2} parallel.pipeline_schedule=zb_h1", (), OK),
    R("model.num_layers=0", ("model.num_layers=0",)),
    R("model.vocab_size=0", ("model.vocab_size=0",)),
    R("model.vocab_size=200", ("model.vocab_size=200", "256")),
    R("model.hidden_size=-64", ("model.hidden_size=-64",)),
    R("model.num_heads=0", ("model.num_heads=0",)),
    R("model.ffn_hidden_size=0", ("model.ffn_hidden_size=0",)),
    R("model.num_heads=3", ("model.hidden_size=64", "model.num_heads=3")),
    R("model.hidden_size=60", ("model.hidden_size=60", "model.num_heads=4", "odd")),
    R("model.name=gpt", ("model.name='gpt'",)),
    # a family's own rules (trainer/parts/families.py): what it requires of the keys
    R("model.name=qwen3", ("model.name=qwen3", "model.qk_layernorm=true")),
    R("model.name=mixtral", ("model.name=mixtral", "model.num_moe_experts")),
    R("model.rope_theta=0", ("model.rope_theta=0",)),
    # sliding windows and attention sinks (trainer/parts/attention.py local_rules)
    R("model.window_size=0", ("model.window_size=0",)),
    R("model.window_size=-4", ("model.window_size=-4",)),
    R("model.window_attn_skip_freq=2", ("model.window_attn_skip_freq=2", "model.window_size=null")),
    R("model.window_size=8 model.window_attn_skip_freq=1", ("model.window_attn_skip_freq=1",)),
    R("model.window_size=8 model.window_attn_skip_freq=[0,0]",
      ("model.window_attn_skip_freq=[0, 0]", "no block windowed")),
    R("model.window_size=8 model.window_attn_skip_freq=[1,0,1]",
      ("model.window_attn_skip_freq=[1, 0, 1]", "model.num_layers=2")),
    R("model.softmax_type=sink", ("model.softmax_type='sink'",)),
    R("model=tiny_deepseek model.window_size=8",
      ("model.window_size=8", "multi_latent_attention=true")),
    R("model.window_size=8 model.window_attn_skip_freq=2 model.softmax_type=learnable "
      "parallel.context_parallel_size=2 cluster.procs_per_node=2 dry_run=true", (), OK),
    # the gated MLP's activation (trainer/parts/mlp.py activation_rules), dense and experts
    R("model.activation_func=relu", ("model.activation_func='relu'", "silu")),
    R("model=tiny_moe model.activation_func=gelu", ("model.activation_func='gelu'",)),
    R("model.glu_linear_offset=inf", ("model.glu_linear_offset=inf",)),
    R("model.activation_func_clamp_value=0", ("model.activation_func_clamp_value=0",)),
    R("model=tiny_moe model.activation_func_clamp_value=-7", (
        "model.activation_func_clamp_value=-7",)),
    R("model=tiny_moe model.activation_func=quick_gelu model.glu_linear_offset=1.0 "
      "model.activation_func_clamp_value=7.0 dry_run=true", (), OK),
    # linear biases (gpt-oss's; trainer/parts/mla.py refuses them)
    R("model=tiny_deepseek model.add_bias_linear=true",
      ("model.add_bias_linear=true", "multi_latent_attention=true")),
    R("model=tiny_deepseek model.add_qkv_bias=true", ("model.add_qkv_bias=true",)),
    R(f"{TP2} model.add_bias_linear=true dry_run=true", (), OK),
    # gpt-oss's family and YaRN's unrounded ramp (trainer/parts/families.py, attention.py)
    R("model.yarn_correction_range_round_to_int=false",
      ("model.yarn_correction_range_round_to_int=false", "model.rope_type=rope")),
    R("model=tiny_gpt_oss model.add_bias_linear=false",
      ("model.name=gpt_oss", "model.add_bias_linear=True")),
    R("model=tiny_gpt_oss model.moe_layer_freq=[1,0,1,1]",
      ("model.name=gpt_oss", "model.moe_layer_freq=[1, 0, 1, 1]")),
    R("model=tiny_gpt_oss parallel.expert_model_parallel_size=2 cluster.procs_per_node=2 "
      "dry_run=true", (), OK),
    # Qwen3-Next's hybrid (trainer/parts/gdn.py, trainer/plan/axis_costs/context.py, tensor.py)
    R("model=tiny_qwen3_next model.linear_attention_freq=[1,1,1,1]",
      ("model.linear_attention_freq=[1, 1, 1, 1]", "no full-attention block")),
    R(f"model=tiny_qwen3_next {TP2} model.linear_num_key_heads=1 "
      "model.linear_num_value_heads=2", ("model.linear_num_key_heads=1",
                                          "parallel.tensor_model_parallel_size=2")),
    R("model=tiny_qwen3_next parallel.context_parallel_size=2 cluster.procs_per_node=2 "
      "parallel.cp_comm_type=a2a model.linear_num_key_heads=1 model.linear_num_value_heads=2",
      ("parallel.cp_comm_type=a2a", "model.linear_num_key_heads=1")),
    R("model=tiny_qwen3_next parallel.context_parallel_size=2 cluster.procs_per_node=2 "
      "train.seq_length=8", ("model.linear_conv_kernel_dim=4", "train.seq_length=8")),
    R("model=tiny_qwen3_next model.attention_output_gate=false",
      ("model.name=qwen3_next", "model.attention_output_gate=True")),
    R("model.rotary_percent=0.1", ("model.rotary_percent=0.1",)),
    R("model=tiny_qwen3_next parallel.context_parallel_size=4 cluster.procs_per_node=4 "
      "data.reset_attention_mask=true dry_run=true", (), OK),
    # Gemma 3's block (trainer/parts/norm.py, attention.py gemma_rules, families.py)
    R("model.sandwich_norm=true", ("model.sandwich_norm=true",
                                   "model.layernorm_zero_centered_gamma=true")),
    R("model=tiny_deepseek model.layernorm_zero_centered_gamma=true",
      ("model.layernorm_zero_centered_gamma=true", "model.mtp_num_layers=1")),
    R("model=tiny_gemma3 model.rotary_base_local=0", ("model.rotary_base_local=0",)),
    R("model.rotary_base_local=10000.0", ("model.rotary_base_local=10000.0",
                                          "model.window_size=null")),
    R("model.seq_len_interpolation_factor=0.5", ("model.seq_len_interpolation_factor=0.5",)),
    R("model.seq_len_interpolation_factor=8.0 model.use_rope_scaling=true",
      ("model.seq_len_interpolation_factor=8.0", "model.use_rope_scaling=true")),
    R("model.softmax_scale=-0.1", ("model.softmax_scale=-0.1",)),
    R("model=tiny_deepseek model.mtp_num_layers=null model.softmax_scale=0.1",
      ("model.softmax_scale=0.1", "multi_latent_attention=true")),
    R("model=tiny_gemma3 model.sandwich_norm=false",
      ("model.name=gemma3", "model.sandwich_norm=True")),
    R("model=tiny_gemma3 model.activation_func=silu",
      ("model.name=gemma3", "model.activation_func='fast_gelu'")),
    R("model=tiny_gemma3 parallel.tensor_model_parallel_size=2 parallel.sequence_parallel=true "
      "parallel.context_parallel_size=2 cluster.procs_per_node=4 dry_run=true", (), OK),
    # multi-latent attention and YaRN (trainer/parts/mla.py, trainer/parts/attention.py)
    R("model=tiny_deepseek model.kv_lora_rank=0", ("model.kv_lora_rank=0",)),
    R("model=tiny_deepseek model.q_lora_rank=-8", ("model.q_lora_rank=-8",)),
    R("model=tiny_deepseek model.qk_pos_emb_head_dim=7", ("model.qk_pos_emb_head_dim=7", "odd")),
    R("model=tiny_deepseek model.num_query_groups=2",
      ("model.num_query_groups=2", "multi_latent_attention=true")),
    R("model=tiny_deepseek model.qk_layernorm=true", ("model.qk_layernorm=true",)),
    R("model=tiny_deepseek model.multi_latent_attention=false",
      ("model.name=deepseek_v3", "model.multi_latent_attention=false")),
    R("model=tiny_moe model.name=mixtral model.multi_latent_attention=true",
      ("model.name=mixtral", "model.multi_latent_attention=true")),
    R("model.rope_type=ntk", ("model.rope_type='ntk'", "yarn")),
    R("model.rope_type=yarn model.rotary_scaling_factor=0.5",
      ("model.rotary_scaling_factor=0.5",)),
    R("model.rope_type=yarn model.beta_fast=0.5", ("model.beta_fast=0.5", "beta_slow=1.0")),
    R("model=tiny_deepseek model.mtp_num_layers=0", ("model.mtp_num_layers=0",)),
    R("model=tiny_deepseek model.mtp_num_layers=1 model.mtp_loss_scaling_factor=-1",
      ("model.mtp_loss_scaling_factor=-1",)),
    R("model=tiny_deepseek model.mtp_num_layers=8 train.seq_length=8",
      ("model.mtp_num_layers=8", "train.seq_length=8")),
    R("model.rope_type=yarn model.use_rope_scaling=true",
      ("model.use_rope_scaling=true", "model.rope_type=yarn")),
    R("model=tiny_deepseek model.mscale_all_dim=-1", ("model.mscale_all_dim=-1",)),
    R("model=tiny_deepseek cluster.procs_per_node=8 parallel.tensor_model_parallel_size=8 "
      "parallel.sequence_parallel=true", ("num_heads=4", "tensor_model_parallel_size=8")),
    R("model.norm_eps=0", ("model.norm_eps=0",)),
    R("model.init_std=nan", ("model.init_std=nan",)),
    # activation recompute, communication dtype, the measured dry run
    R("train.recompute_num_layers=1", ("train.recompute_num_layers=1", "recompute_granularity")),
    R("train.recompute_granularity=full train.recompute_num_layers=3",
      ("train.recompute_num_layers=3", "model.num_layers=2")),
    R("train.recompute_granularity=full train.recompute_num_layers=0",
      ("train.recompute_num_layers=0",)),
    R("train.recompute_granularity=partial",
      ("train.recompute_granularity=partial", "selective, full or null")),
    R("parallel.grad_reduce_in_bf16=true", ("parallel.grad_reduce_in_bf16=true",
                                            "train.precision=fp32")),
    R("dry_run_rank=0", ("dry_run_rank=0", "dry_run=true"), start=True),
    # context-parallel attention
    R("parallel.cp_comm_type=ring", ("parallel.cp_comm_type=ring", "p2p, all_gather, a2a")),
    R("cluster.procs_per_node=8 parallel.context_parallel_size=8 parallel.cp_comm_type=a2a",
      ("parallel.cp_comm_type=a2a", "model.num_heads=4", "runtime CP = 8")),
    R("dry_run_rank=1", ("dry_run_rank=1", "world_size=1")),
    # optimizer and schedule
    R("optim.name=sgd", ("optim.name='sgd'",)),
    R("optim.clip_grad=0", ("optim.clip_grad=0",)),
    R("optim.clip_grad=-1", ("optim.clip_grad=-1",)),
    R("optim.clip_grad=nan", ("optim.clip_grad=nan",)),
    R("optim.weight_decay=-0.1", ("optim.weight_decay=-0.1",)),
    R("optim.beta1=1.5", ("optim.beta1=1.5",)),
    R("optim.beta1=-0.1", ("optim.beta1=-0.1",)),
    R("optim.beta2=1.0", ("optim.beta2=1.0",)),
    R("optim.eps=0", ("optim.eps=0",)),
    R("optim.eps=inf", ("optim.eps=inf",)),
    # optim=muon's keys (trainer.checks.check_optim, check_muon_params)
    R("optim=muon optim.muon_momentum=1.0", ("optim.muon_momentum=1.0", "[0, 1)")),
    R("optim=muon optim.muon_num_ns_steps=0", ("optim.muon_num_ns_steps=0", ">= 1")),
    R("optim=muon optim.muon_scale_mode=rms", ("optim.muon_scale_mode='rms'", "spectral")),
    R("optim=muon optim.muon_ns_dtype=fp16", ("optim.muon_ns_dtype='fp16'", "bf16")),
    R("optim=muon optim.muon_extra_scale_factor=0", ("optim.muon_extra_scale_factor=0.0",
                                                     "0.2")),
    R("optim=muon optim.adamw_params=[layers.*.atn.*]",
      ("optim.adamw_params has 'layers.*.atn.*'", "matches no parameter")),
    R("optim.muon_momentum=0.9", ("optim.muon_momentum=0.9 applies to Muon only",
                                  "optim=muon")),
    R("optim=muon dry_run_rank=0", ("dry_run_rank=0 with optim=muon", "optim=adamw")),
    R("optim.qk_clip_threshold=0", ("optim.qk_clip_threshold=0.0", "100")),
    R("optim.qk_clip_threshold=100 optim.qk_clip_alpha=1.5", ("optim.qk_clip_alpha=1.5",)),
    R("optim.qk_clip_threshold=100 model.qk_layernorm=true",
      ("optim.qk_clip_threshold=100.0 with model.qk_layernorm=true", "Fix:")),
    # peft=lora's keys (trainer.parts.lora.check_peft, the null group's keys)
    R("peft=lora peft.target_modules=[q_a_proj]",
      ("peft.target_modules: 'q_a_proj'", "q_proj", "Fix:")),
    R("peft=lora model=tiny_deepseek peft.target_modules=[q_proj]",
      ("peft.target_modules: 'q_proj'", "it has down_proj")),
    R("peft=lora peft.target_modules=[]", ("peft.target_modules is empty",)),
    R("peft=lora peft.lora_rank=0", ("peft.lora_rank=0", "[1, 64]")),
    R("peft=lora peft.lora_alpha=0", ("peft.lora_alpha=0.0", "> 0")),
    R("peft=lora peft.lora_dropout=1.0", ("peft.lora_dropout=1.0", "[0, 1)")),
    R("peft=lora peft.base_precision=bf16",
      ("peft.base_precision=bf16 with train.precision=fp32", "train.precision=bf16")),
    R("peft=lora optim=muon", ("peft=lora with optim=muon", "optim=adamw")),
    R("peft=lora peft.lora_dropout=0.1 cluster.procs_per_node=2 "
      "parallel.tensor_model_parallel_size=2",
      ("peft.lora_dropout=0.1 under tensor parallel", "sequence_parallel=true")),
    R("peft=lora model=tiny_moe peft.lora_dropout=0.1 cluster.procs_per_node=2 "
      "parallel.tensor_model_parallel_size=2 parallel.sequence_parallel=true",
      ("peft.lora_dropout=0.1 with the routed experts adapted under expert tensor parallel",
       "expert_tensor_parallel_size=1")),
    R("peft.lora_rank=8", ("peft.lora_rank=8: peft is null", "peft=lora")),
    # train.objective=dpo and dpo.* (trainer.checks.check_objective, trainer.data.source)
    R("train.objective=ppo", ("train.objective='ppo'", "lm, dpo")),
    R("train.objective=dpo", ("train.objective=dpo with data.pack=false",
                              "data.reset_attention_mask=true")),
    R(f"train.objective=dpo {DPO_DATA}",
      ("train.objective=dpo reads preference pairs", "the built-in corpus", "--preference")),
    R(f"train.objective=dpo {DPO_DATA} dpo.beta=0", ("dpo.beta=0.0",)),
    R(f"train.objective=dpo {DPO_DATA} dpo.loss_type=hinge", ("dpo.loss_type='hinge'", "ipo")),
    R(f"train.objective=dpo {DPO_DATA} dpo.loss_type=ipo dpo.label_smoothing=0.1",
      ("dpo.label_smoothing=0.1 with dpo.loss_type=ipo",)),
    R(f"train.objective=dpo {DPO_DATA} model=tiny_deepseek",
      ("model.mtp_num_layers=1", "multi-token prediction")),
    R("schedule.lr=nan", ("schedule.lr=nan",)),
    R("schedule.lr=-1", ("schedule.lr=-1",)),
    R("schedule.lr=inf", ("schedule.lr=inf",)),
    R("schedule.min_lr=0.01", ("schedule.min_lr=0.01", "schedule.lr=0.001")),
    R("schedule.min_lr=-1", ("schedule.min_lr=-1",)),
    R("schedule.lr=0 schedule.min_lr=0", ("schedule.lr=0", "trains nothing")),
    R("schedule.lr_warmup_samples=10", ("lr_warmup_samples=10", "lr_warmup_fraction=0.0625")),
    R("schedule.lr_warmup_fraction=1.0", ("schedule.lr_warmup_fraction=1.0",)),
    R("schedule.lr_warmup_fraction=null schedule.lr_warmup_samples=-1",
      ("schedule.lr_warmup_samples=-1",)),
    R("schedule.lr_warmup_fraction=null schedule.lr_warmup_samples=16384",
      ("schedule.lr_warmup_samples=16384",)),
    R("schedule.lr_warmup_fraction=-0.1", ("schedule.lr_warmup_fraction=-0.1",)),
    R("schedule.lr_decay_style=constant schedule.lr_warmup_fraction=null "
      "schedule.lr_warmup_samples=20000", ("schedule.lr_warmup_samples=20000", "not below")),
    R("schedule.lr_decay_samples=0", ("schedule.lr_decay_samples=0",)),
    R("schedule.lr_wsd_decay_samples=100", ("lr_wsd_decay_samples=100", "cosine")),
    R("schedule=wsd schedule.lr_wsd_decay_samples=null", ("lr_wsd_decay_samples=null",)),
    R("schedule=wsd schedule.lr_wsd_decay_samples=0", ("schedule.lr_wsd_decay_samples=0",)),
    R("schedule=wsd schedule.lr_wsd_decay_samples=20000", ("lr_wsd_decay_samples=20000",)),
    # Megatron's schedule keys (trainer/plan/lr_schedule.py)
    R("schedule.lr_warmup_init=-1", ("schedule.lr_warmup_init=-1",)),
    R("schedule.lr_warmup_init=0.01", ("schedule.lr_warmup_init=0.01", "schedule.lr=0.001")),
    R("schedule.lr_warmup_init=1e-4 schedule.lr_warmup_fraction=null",
      ("schedule.lr_warmup_init=0.0001", "no warmup")),
    R("schedule.lr_wsd_decay_style=cosine", ("schedule.lr_wsd_decay_style=cosine", "only WSD")),
    R("schedule.lr_wsd_decay_style=quadratic",
      ("schedule.lr_wsd_decay_style=quadratic", "minus_sqrt")),
    R("schedule.lr_decay_style=constant schedule.lr_decay_samples=1000 "
      "schedule.lr_warmup_fraction=null", ("schedule.lr_decay_samples=1000", "constant")),
    R("schedule.lr_decay_style=inverse-square-root", (), OK, torch=True),
    R("schedule=wsd schedule.lr_wsd_decay_style=minus_sqrt", (), OK, torch=True),
    R("optim.weight_decay_incr_style=linear", ("optim.weight_decay_incr_style=linear",
                                               "both ends")),
    R("optim.start_weight_decay=0.0", ("optim.start_weight_decay=0.0", "ignored")),
    R("optim.weight_decay_incr_style=cosine optim.start_weight_decay=0.2 "
      "optim.end_weight_decay=0.1", ("optim.end_weight_decay=0.1", "below")),
    R("optim.weight_decay_incr_style=sqrt", ("optim.weight_decay_incr_style=sqrt", "cosine")),
    R("optim.weight_decay_incr_style=linear optim.start_weight_decay=0 "
      "optim.end_weight_decay=0.1", (), OK, torch=True),
    # batch-size ramp-up (trainer/plan/rampup.py)
    R("train.rampup_batch_size=[4,4]", ("train.rampup_batch_size=[4, 4]", "three")),
    R("train.rampup_batch_size=abc", ("train.rampup_batch_size=abc", "a list")),
    R("train.rampup_batch_size=[8,8,1000]", ("train.rampup_batch_size=[8, 8, 1000]",
                                             "train.global_batch_size=8")),
    R("train.rampup_batch_size=[4,4,0] train.global_batch_size=16",
      ("train.rampup_batch_size=[4, 4, 0]", ">= 1")),
    R("train.rampup_batch_size=[4,8,100] train.global_batch_size=16",
      ("train.rampup_batch_size=[4, 8, 100]", "increments of 8")),
    R("train.rampup_batch_size=[2,2,100] train.micro_batch_size=4 train.global_batch_size=16",
      ("train.rampup_batch_size=[2, 2, 100]", "global batch of 2")),
    R("train.rampup_batch_size=[4,4,100] train.micro_batch_size=4 train.global_batch_size=16",
      ("train.train_samples=16384", "after the ramp-up", "16376 or 16392")),
    R("train.rampup_batch_size=[4,4,100] train.micro_batch_size=4 train.global_batch_size=16 "
      "train.train_samples=1000", (), OK, torch=True),
    # sample accounting, seeds, intervals
    R("train.train_samples=100", ("train.train_samples=100", "96")),
    R("train.train_samples=0", ("train.train_samples=0",)),
    R("train.eval_interval=0", ("train.eval_interval=0",)),
    R("train.eval_samples=3", ("train.eval_samples=3",)),
    R("train.eval_samples=0", ("train.eval_samples=0",)),
    R("train.seed=-1", ("train.seed=-1",)),
    # packed documents
    R("data.reset_position_ids=true", ("data.reset_position_ids=true",
                                       "data.reset_attention_mask=true")),
    R("data.eod_mask_loss=true", ("data.eod_mask_loss=true", "data.tokenizer=byte")),
    R("data.eod_mask_loss=true data.path={ds}", ("data.eod_mask_loss=true", "data.path=")),
    R(f"data.seed={2**32}", (f"data.seed={2**32}",)),
    R("checkpoint.save_interval=0", ("checkpoint.save_interval=0",)),
    R("checkpoint.save_interval=-5", ("checkpoint.save_interval=-5",)),
    R("checkpoint.dir=/proc/forbidden", ("checkpoint.dir=/proc/forbidden",)),
    R("checkpoint.load=/nonexistent/ckpt", ("checkpoint.load=/nonexistent/ckpt",)),
    R("checkpoint.finetune=true", ("checkpoint.finetune=true", "checkpoint.load")),
    R("checkpoint.finetune=true checkpoint.load={empty} checkpoint.dir={empty}",
      ("checkpoint.finetune=true", "checkpoint.dir=checkpoint.load=")),
    R(f"checkpoint.load={{empty}} data.path={{ds}} {SHORT}", ("checkpoint.load=", "empty", "Fix:"),
      start=True, torch=True),
    # a checkpoint that fits the shapes but not the model (trainer/checkpoint/match.py)
    R(f"checkpoint.load={{untied}} checkpoint.finetune=true model.tie_word_embeddings=true "
      f"data.path={{ds}} {SHORT}", ("'head.weight'", "model.tie_word_embeddings=false",
                                    "model.tie_word_embeddings=true"), start=True, torch=True),
    R(f"checkpoint.load={{tied}} data.path={{ds}} {SHORT}",
      ("no 'head.weight'", "model.tie_word_embeddings=true", "model.tie_word_embeddings=false",
       "checkpoint.finetune=true"), start=True, torch=True),
    R(f"checkpoint.load={{untied}} model.rope_theta=500000 data.path={{ds}} {SHORT}",
      ("model.rope_theta=500000.0 (the checkpoint's 10000.0)", "checkpoint.finetune=true"),
      start=True, torch=True),
    R(f"checkpoint.load={{moe}} model=tiny_moe model.moe_router_topk=1 data.path={{ds}} {SHORT}",
      ("model.moe_router_topk=1 (the checkpoint's 2)", "checkpoint.finetune=true"), start=True,
      torch=True),
    R(f"checkpoint.load={{moe}} model=tiny_moe model.moe_router_score_function=sigmoid "
      f"model.moe_router_enable_expert_bias=true data.path={{ds}} {SHORT}",
      ("has no expert bias", "model.moe_router_enable_expert_bias=false",
       "checkpoint.finetune=true"), start=True, torch=True),
    R(f"cluster.num_nodes=2 data.path={{ds}} {SHORT}", ("cluster.num_nodes=2",), start=True,
      torch=True),  # launch.py starts ranks on this machine only (a dry run may plan 2 nodes)
    R("logger.log_interval=0", ("logger.log_interval=0",)),
    R("logger.sample_prompts=[hi] train.eval_interval=null",
      ("logger.sample_prompts=['hi']", "train.eval_interval")),
    R(f"logger.sample_prompts=[hi] {PP2}", ("logger.sample_prompts=['hi']",
                                           "pipeline_model_parallel_size=2")),
    R("logger.project=x", ("logger.project='x'", "logger=console")),
    R("cluster.max_restarts=-1", ("cluster.max_restarts=-1", "count >= 0")),
    R("train.compile=true", ("train.compile=True", "train.compile=blocks")),
    R("train.compile=blocks model=tiny_moe", ("train.compile=blocks", "model.num_moe_experts=",
                                              "train.precision=bf16")),
    R("cluster.max_restarts=2 checkpoint.resume=false",
      ("cluster.max_restarts=2", "checkpoint.resume=false", "set checkpoint.resume=true")),
    R("cluster.num_nodes=0", ("cluster.num_nodes=0",)),
    R("cluster.procs_per_node=0", ("cluster.procs_per_node=0",)),
    R("cluster.gpus_per_nvlink_domain=0", ("cluster.gpus_per_nvlink_domain=0",)),
    R("cluster.timeout_s=0", ("cluster.timeout_s=0",)),
    R("cluster.device_memory_gib=0", ("cluster.device_memory_gib=0", "datasheet")),
    R("cluster.cpu_cores_per_node=0", ("cluster.cpu_cores_per_node=0", "null")),
    # data
    R("data.path=/nonexistent", ("data.path=/nonexistent",)),
    R("data.path={file}", ("data.path=", "is a file")),
    R(f"data.path={{notds}} {SHORT}", ("data.path=", "meta.json"), start=True),
    R(f"data.path={{trunc}} {SHORT}", ("data.path=", "tokens.bin", "truncated"), start=True),
    # a loss mask that trains nothing: ranks started, then "no loss tokens" in 18 lines
    R(f"data.path={{chatcut}} data.pack=true train.seq_length=32 train.eval_interval=null {SHORT}",
      ("data.path=", "no target in the train split", "train.seq_length + 1 = 33"), start=True,
      torch=True),
    R(f"data.path={{chatnone}} train.seq_length=32 train.eval_interval=null {SHORT}",
      ("data.path=", "no target in the train split, so", "--loss-on all"), start=True,
      torch=True),
    R("data.path={ds} data.tokenizer=byte", ("data.tokenizer='byte'", "data.path=")),
    R("data.path={ds} data.valid_fraction=0.1", ("data.valid_fraction=0.1", "data.path=")),
    R("data.path={ds} data.cache_dir=/tmp", ("data.cache_dir='/tmp'",)),
    R("data.path={ds} train.seq_length=131072", ("train.seq_length=131072", "data.path=")),
    R(f"train.seq_length=1048576 {SHORT}", ("train.seq_length=1048576", "the built-in corpus"),
      start=True, torch=True),  # known once the corpus is prepared, before the run's files
    R("data.path={ds} train.eval_samples=800", ("train.eval_samples=800", "data.path=")),
    R("data.path={ds} model.vocab_size=200", ("model.vocab_size=200", "256")),
    R("data.tokenizer=gpt2", ("data.tokenizer='gpt2'",)),
    R("data.valid_fraction=1.0", ("data.valid_fraction=1.0",)),
    R("data.valid_fraction=0", ("data.valid_fraction=0", "train.eval_interval=256")),
    R("data.cache_dir=/proc/forbidden", ("data.cache_dir=/proc/forbidden",)),
    # keys, ??? and the derived node
    R("model.hidden_size=???", ("model.hidden_size", "???")),
    R("cluster.num_nodes=???", ("cluster.num_nodes", "???")),
    R("~model", ("model.hidden_size", "???")),
    R("+train.foo=1", ("train.foo",)),
    R("+foo=1", ("foo",)),
    R("layout=3", ("layout",)),
    R("~layout", ("layout",)),
    R("++layout.world_size=3", ("layout",)),
    R("++train.foo=3", ("train.foo",)),
    # What Hydra would refuse while composing, refused first by launch.py's override check
    R("train.seq_length=abc", ("train.seq_length=abc", "whole number")),
    R("train.precision=fp16", ("train.precision=fp16", "fp32, bf16")),
    R("parallel.sequence_parallel=maybe", ("parallel.sequence_parallel=maybe", "true or false")),
    R("train.seed=1.5", ("train.seed=1.5", "whole number")),
    R("train.seq_length=null", ("train.seq_length=null", "cannot be null")),
    R("schedule.lr_decay_style=step", ("schedule.lr_decay_style=step", "inverse-square-root")),
    R("dry_run=maybe", ("dry_run=maybe", "true or false")),
    R("train.foo=1", ("train.foo=1", "train has no key foo")),
    R("tarin.seed=1", ("tarin.seed=1", "did you mean train.seed?")),
    R("layout.world_size=3", ("layout.world_size=3", "read-only")),
    R("model=tinyy", ("model=tinyy", "model/tinyy", "did you mean model=tiny?")),
    R("experiment=nope", ("experiment=nope", "experiment/nope", "seed_review")),
    R("model=null", ("model=null", "config group", "~model")),
    R("model.num_layers=1,abc", ("model.num_layers=1,abc", "-m")),
    R("data.path=~/x", ("data.path=~/x", "delete prefix", "data.path=$HOME/x")),
    R("train.seq_length=[1,2", ("train.seq_length=[1,2", "cannot parse")),
    R("dry_run", ("dry_run", "key=value")),
    R("hydra/launcher=slurm", ("hydra/launcher=slurm", "only to -m sweeps")),
    # accepted: the harness can pass
    R("", (), OK, torch=True),
    R("optim.clip_grad=null", (), OK, torch=True),
    R("schedule=wsd logger=wandb", (), OK, torch=True),
    R("data.path={ds} data.cache_dir=null", (), OK, torch=True),
    R("train.eval_interval=null data.valid_fraction=0", (), OK, torch=True),
]


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, Path]:
    """A prepared dataset ({ds}, ~100k byte tokens, a tenth valid), a truncated copy, chats
    (chat_datasets), a folder
    that is no dataset, a plain file, an empty folder (no checkpoints), checkpoints of three
    models (checkpoints) and a torch blocker."""
    from trainer.data.dataset import prepare

    root = tmp_path_factory.mktemp("bad_inputs")
    src = root / "src"
    src.mkdir()
    for i in range(200):
        (src / f"doc{i:03d}.txt").write_text(f"doc {i}: " + "the quick brown fox. " * 24)
    ds = prepare(src, root / "ds", 0.1)
    trunc = prepare(src, root / "trunc", 0.1)
    with open(trunc / "tokens.bin", "r+b") as f:
        f.truncate(1000)
    (root / "empty").mkdir()
    block = root / "no_torch" / "torch"
    block.mkdir(parents=True)
    (block / "__init__.py").write_text("raise ImportError('torch imported before refusing')\n")
    return {"ds": ds, "trunc": trunc, "notds": src, "file": ds / "meta.json",
            "empty": root / "empty", "root": root, "no_torch": block.parent,
            **chat_datasets(root), **checkpoints(root, ds)}


def checkpoints(root: Path, ds: Path) -> dict[str, Path]:
    """Checkpoints of one step on {ds}, trained side by side: {untied} (the tiny model), {tied}
    (its embeddings tied), {moe} (the tiny mixture of experts, no expert bias)."""
    runs = {"untied": [], "tied": ["model.tie_word_embeddings=true"], "moe": ["model=tiny_moe"]}
    procs = {name: subprocess.Popen(
        [sys.executable, str(ROOT / "launch.py"), f"data.path={ds}", "train.train_samples=8",
         "train.eval_interval=null", *extra, f"hydra.run.dir={root / 'trained' / name}"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for name, extra in runs.items()}
    for proc in procs.values():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    return {name: root / "trained" / name / "checkpoints" for name in runs}


def chat_datasets(root: Path) -> dict[str, Path]:
    """Chats (a BPE of 64 ids, ChatML) whose loss mask trains nothing: {chatcut}, every answer
    after a prompt longer than a packed sample of 33 tokens; {chatnone}, its mask all 0, as a
    dataset from before trainer.prepare refused chats without a target."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from trainer.data.dataset import prepare

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["what is two and two? it is four."] * 4, trainers.BpeTrainer(
        vocab_size=64, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        show_progress=False))
    folder = root / "chat_tokenizer"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    shutil.copy(ROOT / "tests" / "data" / "chat_templates" / "chatml.json",
                folder / "tokenizer_config.json")
    chat = [{"role": "user", "content": "what is two and two? " * 8},
            {"role": "assistant", "content": "it is four."}]
    (root / "chats.jsonl").write_text((json.dumps({"messages": chat}) + "\n") * 40)
    out = {name: prepare(root / "chats.jsonl", root / name, 0.1, folder, chat=True)
           for name in ("chatcut", "chatnone")}
    (out["chatnone"] / "loss_mask.bin").write_bytes(
        bytes((out["chatnone"] / "loss_mask.bin").stat().st_size))
    return out


def row_command(index: int, row: Row, paths: dict[str, Path]) -> tuple[list[str], dict, Path]:
    """(launch.py's arguments, the environment, the run folder) of a row."""
    overrides = row.overrides.format(**paths).split()
    mode = [] if row.start else ["dry_run=true"]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    if not row.torch:
        env["PYTHONPATH"] = os.pathsep.join([str(paths["no_torch"]), str(ROOT)])
    run_dir = paths["root"] / "runs" / f"row{index:03d}"
    return [*overrides, *mode, f"hydra.run.dir={run_dir}"], env, run_dir


def run_row(index: int, row: Row, paths: dict[str, Path]) -> subprocess.CompletedProcess:
    argv, env, _ = row_command(index, row, paths)
    return subprocess.run([sys.executable, str(ROOT / "launch.py"), *argv], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=180)


def run_torch_free_rows(rows: dict[int, Row], paths) -> dict[int, subprocess.CompletedProcess]:
    """The rows refused before torch, each the real CLI in a fork of one warm interpreter
    (warm_cli: the imports done once; torch blocked in every child)."""
    folder = paths["root"] / "warm"
    folder.mkdir(exist_ok=True)
    jobs = []
    for i, row in rows.items():
        argv, env, _ = row_command(i, row, paths)
        jobs.append({"argv": argv, "env": env, "cwd": str(ROOT), "no_torch": str(paths["no_torch"]),
                     "stdout": str(folder / f"{i}.out"), "stderr": str(folder / f"{i}.err")})
    codes = run_warm(jobs, 2, folder)
    return {i: subprocess.CompletedProcess(job["argv"], code, Path(job["stdout"]).read_text(),
                                           Path(job["stderr"]).read_text())
            for (i, job), code in zip(zip(rows, jobs), codes)}


@pytest.fixture(scope="module")
def results(paths) -> dict[int, subprocess.CompletedProcess]:
    started = time.perf_counter()
    # The rows that may import torch are new interpreters, two at a time, beside the others.
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {i: pool.submit(run_row, i, row, paths) for i, row in enumerate(TABLE)
                   if row.torch}
        done = run_torch_free_rows({i: r for i, r in enumerate(TABLE) if not r.torch}, paths)
        done.update({i: future.result() for i, future in futures.items()})
    print(f"\n{len(TABLE)} rows in {time.perf_counter() - started:.1f} s")
    return done


def message_lines(stderr: str) -> list[str]:
    """stderr without blank lines and Hydra's frame (its header and its hint line)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    if lines and lines[-1] == HYDRA_HINT:
        lines.pop()
    if lines and lines[0].startswith(HYDRA_HEADER):
        lines.pop(0)
    return lines


def test_the_table_is_large_and_mixed():
    kinds = [row.kind for row in TABLE]
    # No row is Hydra's several-line message any more: every refusal is our one line.
    assert len(TABLE) >= 70 and kinds.count(OK) >= 4 and kinds.count(HYDRA) == 0
    assert kinds.count(OURS) >= len(TABLE) * 9 // 10 and any(row.start for row in TABLE)
    assert len({row.overrides for row in TABLE}) == len(TABLE), "a row is listed twice"


@pytest.mark.parametrize("index", range(len(TABLE)), ids=[r.overrides or "default" for r in TABLE])
def test_row(index, results, paths):
    row, out = TABLE[index], results[index]
    output = out.stdout + out.stderr
    assert "Traceback" not in output, output
    if row.kind == OK:
        assert out.returncode == 0, output
        return
    assert out.returncode != 0, output
    lines = message_lines(out.stderr)
    assert lines, output
    text = "\n".join(lines)
    for part in row.named:
        assert part in text, f"{part!r} not named in:\n{text}"
    if row.kind == OURS:
        assert len(lines) == 1, f"not one line:\n{out.stderr}"
        assert "Fix:" in lines[0], lines[0]
    if row.start:  # refused before training: the command left no folder behind
        run_dir = paths["root"] / "runs" / f"row{index:03d}"
        assert not run_dir.exists(), sorted(p.name for p in run_dir.iterdir())
