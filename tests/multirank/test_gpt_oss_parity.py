"""gpt-oss's own parts train the same model under the layout as in one process (test_parity's
method, fp64 within 1e-10): the linear layers' biases (model.add_bias_linear; add_qkv_bias
alone) under TP with and without SP and TP x weight shards, the clamped SwiGLU (quick_gelu,
offset 1), and the router's and experts' biases under EP 2, ETP 2 and TP 2 x SP x ETP 2 x EP 2.

The clamp is 0.1, not gpt-oss's 7: a tiny model's gate and up values are ~0.2 at its initial
weights, so 7 would clamp nothing; at 0.1 both sides of both clamps are taken.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from trainer.plan.options import EngineOptions

from harness import run_ranks
from test_parity import (
    LAYOUTS,
    MICRO,
    TINY,
    assert_parity,
    make_data,
    make_layout,
    reference,
    train_rank,
)

CLAMPED = dict(activation_func="quick_gelu", glu_linear_offset=1.0,
               activation_func_clamp_value=0.1)
MODELS = {
    "dense": replace(TINY, add_bias_linear=True, num_query_groups=2, **CLAMPED),
    "qkv_bias": replace(TINY, add_qkv_bias=True, num_query_groups=2),
    # gpt-oss's block at a CPU's size: biases everywhere, top-k logits' softmax with the router
    # bias, the clamped SwiGLU in the experts
    "moe": replace(TINY, add_bias_linear=True, num_query_groups=2, num_moe_experts=4,
                   moe_router_topk=2, moe_ffn_hidden_size=48, moe_aux_loss_coeff=0.05,
                   **CLAMPED),
}
TP2_SP = {"tensor_model_parallel_size": 2, "sequence_parallel": True,
          "expert_tensor_parallel_size": 1}
LAYOUTS = LAYOUTS | {
    "ep2": (2, {"expert_model_parallel_size": 2}),
    "etp2": (2, {"expert_tensor_parallel_size": 2}),
    "tp2_sp_etp2_ep2": (4, TP2_SP | {"expert_tensor_parallel_size": 2,
                                     "expert_model_parallel_size": 2}),
}
CASES = [("tp2", "dense"), ("tp2_sp", "dense"), ("tp2_ws4", "dense"), ("tp2_sp", "qkv_bias"),
         ("ep2", "moe"), ("etp2", "moe"), ("tp2_sp_etp2_ep2", "moe")]
BIASES = {  # what each model's training must move (a bias left at zero proves nothing)
    "dense": ("attn.qkv.bias", "attn.o.bias", "mlp.gate_up.bias", "mlp.down.bias"),
    "qkv_bias": ("attn.qkv.bias",),
    "moe": ("attn.qkv.bias", "attn.o.bias", "mlp.router.bias", "mlp.experts.gate_up_bias",
            "mlp.experts.down_bias"),
}


@pytest.mark.parametrize("name,model", CASES, ids=[f"{n}-{m}" for n, m in CASES])
def test_gpt_oss_parts_match_one_process(name, model):
    world, kwargs = LAYOUTS[name]
    layout = make_layout(world, kwargs)
    cfg, dtype = MODELS[model], torch.float64
    batches = make_data(layout.global_batch_size, cfg)
    (ref,) = run_ranks(1, reference, batches, dtype, cfg, MICRO * layout.batch_parallel_size)
    results = run_ranks(world, train_rank, layout, batches, dtype, EngineOptions(), cfg,
                        timeout=120)
    assert_parity(results, ref, dtype, f"gpt-oss {model} {name} (world {world})")
    for block in range(cfg.num_layers):
        for bias in BIASES[model]:
            assert ref["params"][f"layers.{block}.{bias}"].abs().max() > 1e-4, bias
