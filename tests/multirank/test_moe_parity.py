"""A mixture of experts trains the same model under data and context parallel (every
cp_comm_type) and weight and sequence shards as one process: losses, gradient norms, every
weight, the expert bias, the balance losses and the routing (each layer's token counts, by their
imbalance, equal to the last digit), three steps on real gloo ranks (test_parity's method).

The balance losses are computed over a whole micro-batch, all its batch lanes and sequence
shards (a layout's micro-batch m is samples [m*BPS*micro, (m+1)*BPS*micro) of the global batch),
so the one-process reference runs micro-batches of micro x batch_parallel_size samples.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from trainer.config import CPCommType
from trainer.data.batch import rank_micro_batches
from trainer.model.transformer import Transformer
from trainer.plan.options import EngineOptions
from trainer.train import routing
from trainer.train.engine import build_engine
from trainer.train.step import IGNORE, train_step

from harness import run_ranks
from test_parity import (
    LAYOUTS,
    LRS,
    MICRO,
    OPTIM,
    SEED,
    TINY,
    TOLERANCE,
    assert_parity,
    make_data,
    make_layout,
    relative,
)

MOE = replace(TINY, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
              moe_aux_loss_coeff=0.05, moe_z_loss_coeff=0.01)
MODELS = {
    "aux_z": MOE,
    # DeepSeek-V3's router: sigmoid, the auxiliary-loss-free bias, scaled weights, a shared
    # expert, the per-sequence loss; the second block dense (moe_layer_freq).
    "sigmoid_bias_seq": replace(MOE, moe_router_score_function="sigmoid",
                                moe_router_enable_expert_bias=True,
                                moe_router_bias_update_rate=0.01,
                                moe_router_topk_scaling_factor=2.0,
                                moe_shared_expert_intermediate_size=32,
                                moe_router_load_balancing_type="seq_aux_loss",
                                moe_layer_freq=[1, 0]),
    "pre_softmax": replace(MOE, moe_router_pre_softmax=True, moe_z_loss_coeff=None),
}
P2P, ALL_GATHER, A2A = CPCommType.p2p, CPCommType.all_gather, CPCommType.a2a
CASES = [  # (layout, cp_comm_type, model, dtype)
    ("dp2", P2P, "aux_z", torch.float64), ("dp2", P2P, "sigmoid_bias_seq", torch.float64),
    ("cp2", P2P, "pre_softmax", torch.float32),
    ("cp2", ALL_GATHER, "sigmoid_bias_seq", torch.float32),
    ("cp2", A2A, "sigmoid_bias_seq", torch.float64),
    ("ws4_ss2", P2P, "sigmoid_bias_seq", torch.float64),
    ("cp2_ws2_ss2", A2A, "aux_z", torch.float32),
]


class _OneProcess:
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def reference(rank: int, batches: list[torch.Tensor], dtype: torch.dtype, model_cfg,
              samples: int) -> dict:
    """test_parity's one-process loop with micro-batches of `samples` (a layout's micro-batch
    over all its lanes), the balance losses weighted 1 / micro-batches, the bias moved after
    each update."""
    torch.set_default_dtype(dtype)
    model = Transformer(model_cfg)
    model.init_weights(SEED)
    initial_q = model.layers["0"].attn.qkv.weight.detach().clone()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": OPTIM.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            betas=(OPTIM.beta1, OPTIM.beta2), eps=OPTIM.eps, foreach=False)
    out = {"losses": [], "norms": [], "moe": []}
    groups = type("OneProcess", (), {"token_distinct": _OneProcess()})()
    for batch, lr in zip(batches, LRS):
        inputs, labels = batch[:, :-1].clamp(min=0), batch[:, 1:]
        count = int((labels != IGNORE).sum())
        opt.zero_grad()
        routing.begin(model, len(batch) // samples)
        total = 0.0
        for x, y in zip(inputs.split(samples), labels.split(samples)):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum",
                                   ignore_index=IGNORE) / count
            loss.backward()
            total += loss.item()
        out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                           OPTIM.clip_grad).item())
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        out["moe"].append(routing.finish(model, groups))
        out["losses"].append(total)
    out["params"] = {name: p.detach() for name, p in model.named_parameters()}
    out["biases"] = {name: b.detach() for name, b in model.named_buffers()}
    out["initial_q"] = initial_q
    return out


def moe_rank(rank: int, layout, batches, dtype, options, model) -> dict:
    """test_parity's rank, with what its steps reported of the routing and its expert biases."""
    torch.set_default_dtype(dtype)
    engine = build_engine(model, OPTIM, SEED, layout, torch.device("cpu"), options)
    out = {"losses": [], "norms": [], "moe": []}
    for batch, lr in zip(batches, LRS):
        micro_batches = rank_micro_batches(lambda idx, b=batch: b[idx], layout, rank)
        for mb in micro_batches:  # inputs may not hold the ignore marker; labels keep it
            mb.tokens = mb.tokens.clamp(min=0)
        result = train_step(engine.model, engine.optimizer, micro_batches, lr)
        out["losses"].append(result.loss)
        out["norms"].append(result.grad_norm)
        out["moe"].append(result.moe)
    out["params"] = engine.model.full_state_dict()
    out["biases"] = {n: b.detach().clone() for n, b in engine.model.module.named_buffers()}
    return out


@pytest.mark.parametrize("name,comm,model,dtype", [
    pytest.param(*case, id=f"{case[0]}_{case[1].value}_{case[2]}-{str(case[3])[6:]}")
    for case in CASES])
def test_a_mixture_of_experts_matches_one_process(name, comm, model, dtype):
    world, kwargs = LAYOUTS[name]
    layout = make_layout(world, kwargs)
    cfg = MODELS[model]
    batches = make_data(layout.global_batch_size, cfg)
    samples = MICRO * layout.batch_parallel_size
    (ref,) = run_ranks(1, reference, batches, dtype, cfg, samples)
    results = run_ranks(world, moe_rank, layout, batches, dtype, EngineOptions(cp_comm_type=comm),
                        cfg, timeout=120)
    assert_parity(results, ref, dtype, f"MoE {model} {name} {comm.value} (world {world})")
    for got in results:  # every rank: the same routing as one process, step by step
        for ours, theirs in zip(got["moe"], ref["moe"]):
            assert ours["moe_imbalance_per_layer"] == theirs["moe_imbalance_per_layer"]
            assert relative(ours["moe_aux_loss"], theirs["moe_aux_loss"]) <= TOLERANCE[dtype]
        assert got["biases"].keys() == ref["biases"].keys()
        for key, bias in ref["biases"].items():
            assert torch.equal(got["biases"][key], bias), key
    assert ref["moe"][0]["moe_aux_loss"] > 0
    if cfg.moe_router_enable_expert_bias:  # it moved, by whole update steps
        assert ref["biases"]["layers.0.mlp.router.expert_bias"].abs().max() > 0
