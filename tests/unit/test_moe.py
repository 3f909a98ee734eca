"""The mixture of experts (trainer/model/moe.py) against independent references: transformers'
own MoE blocks (Qwen3-MoE's softmax routing, normalised or not, and DeepSeek-V3's sigmoid router
with its bias and scaling), Megatron's balance-loss formulas written out here, and the step's
use of them (the gradient's weight, one record per micro-batch under recompute, the bias)."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
import transformers

from trainer.config import ModelConfig
from trainer.model.mlp import swiglu
from trainer.model.moe import MoE, grouped
from trainer.model.transformer import Block
from trainer.train import routing
from trainer.train.recompute import recompute_block

MOE = ModelConfig(name="llama", vocab_size=256, hidden_size=32, num_layers=2, num_heads=4,
                  ffn_hidden_size=64, rope_theta=1e4, norm_eps=1e-5, init_std=0.02,
                  num_moe_experts=8, moe_router_topk=3, moe_ffn_hidden_size=24)


def moe_block(cfg: ModelConfig, dtype: torch.dtype = torch.float64, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    block = MoE(cfg, swiglu, None).to(dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block


@pytest.mark.parametrize("normalised", [True, False])
def test_softmax_routing_and_experts_equal_qwen3_moe(normalised):
    """pre_softmax=false is Qwen3-MoE's norm_topk_prob=true (and Mixtral's): the top-k of the
    softmax renormalised; pre_softmax=true is norm_topk_prob=false."""
    cfg = replace(MOE, moe_router_pre_softmax=not normalised)
    ours = moe_block(cfg)
    theirs = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(
        transformers.Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=24, num_experts=8,
                                    num_experts_per_tok=3, norm_topk_prob=normalised)).double()
    with torch.no_grad():
        theirs.gate.weight.copy_(ours.router.weight)
        theirs.experts.gate_up_proj.copy_(ours.experts.gate_up)
        theirs.experts.down_proj.copy_(ours.experts.down)
    x = torch.randn(3, 20, 32, dtype=torch.float64)
    # Their router's softmax is fp32 whatever the model's dtype (ours follows it: fp64 here),
    # so the two agree to fp32 rounding of the routing weights.
    error = relative(ours(x), theirs(x))
    print(f"\nnormalised={normalised}: relative difference to transformers {error:.1e}")
    assert error < 1e-6
    with torch.no_grad():  # and it can fail: one expert's down projection 1% off
        theirs.experts.down_proj[0].mul_(1.01)
    assert relative(ours(x), theirs(x)) > 1e-4


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("groups, group_topk, topk", [(None, None, 3), (4, 2, 4)])
def test_sigmoid_routing_with_bias_and_scaling_equals_deepseek_v3(groups, group_topk, topk):
    """transformers' DeepSeek-V3 router, without groups and with them (n_group, topk_group: a
    group ranked by its two best scores, as Megatron's topk / group_topk = 4 / 2 here)."""
    cfg = replace(MOE, moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.5,
                  moe_router_enable_expert_bias=True, moe_router_topk=topk,
                  moe_router_num_groups=groups, moe_router_group_topk=group_topk)
    ours = moe_block(cfg).router
    theirs = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(
        transformers.DeepseekV3Config(hidden_size=32, n_routed_experts=8,
                                      num_experts_per_tok=topk, n_group=groups or 1,
                                      topk_group=group_topk or 1, norm_topk_prob=True,
                                      routed_scaling_factor=2.5)).double()
    bias = torch.linspace(-0.3, 0.3, 8)
    with torch.no_grad():
        ours.expert_bias.copy_(bias)
        theirs.weight.copy_(ours.weight)
        theirs.e_score_correction_bias.copy_(bias)
    x = torch.randn(2, 30, 32, dtype=torch.float64)
    weights, experts, *_ = ours(x)
    _, their_weights, their_experts = theirs(x)
    order, their_order = experts.argsort(-1), their_experts.argsort(-1)
    assert torch.equal(experts.gather(-1, order), their_experts.gather(-1, their_order))
    # Their router runs in fp32 whatever the model's dtype; ours in fp64 here.
    assert torch.allclose(weights.gather(-1, order),
                          their_weights.gather(-1, their_order).double(), rtol=0, atol=1e-6)
    # The bias chose other experts than the scores alone would, for some tokens.
    unbiased = torch.sigmoid(F.linear(x.reshape(-1, 32), ours.weight)).topk(topk).indices
    assert not torch.equal(unbiased.sort(-1).values, experts.sort(-1).values)


@pytest.mark.parametrize("router", [
    {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
     "moe_router_topk_scaling_factor": 2.5},
    {"moe_router_pre_softmax": True}, {}])
@pytest.mark.parametrize("groups, group_topk, topk", [(4, 2, 4), (2, 1, 3)])
def test_group_limited_routing_is_megatrons(router, groups, group_topk, topk):
    """Megatron-Core's own router function (topk_routing_with_score_function, group-limited)
    chooses the same experts with the same weights, for each score function; and the groups
    change the choice for some tokens (the check can fail)."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    cfg = replace(MOE, moe_router_topk=topk, moe_router_num_groups=groups,
                  moe_router_group_topk=group_topk, **router)
    ours = moe_block(cfg).router
    if ours.expert_bias is not None:
        with torch.no_grad():
            ours.expert_bias.copy_(torch.linspace(-0.3, 0.3, 8))
    x = torch.randn(2, 30, 32, dtype=torch.float64)
    weights, experts, *_ = ours(x)
    logits = F.linear(x.reshape(-1, 32), ours.weight)
    probs, chosen = topk_routing_with_score_function(
        logits, topk, use_pre_softmax=cfg.moe_router_pre_softmax, num_groups=groups,
        group_topk=group_topk,
        scaling_factor=cfg.moe_router_topk_scaling_factor,
        score_function=cfg.moe_router_score_function, expert_bias=ours.expert_bias)
    ours_dense = torch.zeros_like(probs).scatter(-1, experts, weights)
    assert torch.equal(ours_dense != 0, chosen)
    # Megatron's scores run in fp32 whatever the logits' dtype; ours in fp64 here.
    assert relative(ours_dense, probs) < 1e-6
    ungrouped = moe_block(replace(cfg, moe_router_num_groups=None, moe_router_group_topk=None))
    if ours.expert_bias is not None:
        with torch.no_grad():
            ungrouped.router.expert_bias.copy_(ours.expert_bias)
    assert not torch.equal(ungrouped.router(x)[1].sort(-1).values, experts.sort(-1).values)


def formulas(logits: torch.Tensor, experts: torch.Tensor, cfg: ModelConfig, b: int, s: int
             ) -> dict[str, torch.Tensor]:
    """Megatron's balance losses written out: the switch loss E * sum_i f_i * P_i (f_i the
    share of routed slots, P_i the mean score), its per-sequence form averaged over the
    sequences, and the z-loss, the mean squared logsumexp."""
    E, k, T = cfg.num_moe_experts, cfg.moe_router_topk, b * s
    probs = torch.softmax(logits, -1)
    chosen = F.one_hot(experts, E).sum(1).to(probs.dtype)  # [T, E], 0 or 1
    aux = E * ((chosen.sum(0) / (T * k)) * probs.mean(0)).sum()
    per_seq = [E * ((chosen.view(b, s, E)[j].sum(0) / (s * k)) * probs.view(b, s, E)[j].mean(0))
               .sum() for j in range(b)]
    return {"aux_loss": aux, "seq_aux_loss": torch.stack(per_seq).mean(),
            "z": torch.logsumexp(logits, -1).square().mean()}


@pytest.mark.parametrize("balancing", ["aux_loss", "seq_aux_loss"])
def test_balance_losses_are_megatrons_and_their_gradient_has_its_weight(balancing):
    cfg = replace(MOE, moe_router_load_balancing_type=balancing, moe_aux_loss_coeff=0.1,
                  moe_z_loss_coeff=0.01)
    block = moe_block(cfg)
    block.router.loss_scale = 0.25  # as in a step of four micro-batches
    x = torch.randn(3, 10, 32, dtype=torch.float64)
    logits = F.linear(x.reshape(-1, 32), block.router.weight)
    _, experts, loss, *_ = block.router(x)
    want = formulas(logits, experts, cfg, 3, 10)
    expected = 0.1 * want[balancing] + 0.01 * want["z"]
    assert abs(loss.item() - expected.item()) < 1e-12
    # Backward through the block: the balance losses count loss_scale of the step's loss.
    probe = torch.randn(3, 10, 32, dtype=torch.float64)
    (block(x) * probe).sum().backward()
    got = block.router.weight.grad.clone()
    block.zero_grad()
    # The same by hand: the output's gradient plus 0.25 x the formulas' (through the logits).
    weight = block.router.weight
    logits = F.linear(x.reshape(-1, 32), weight)
    by_hand = formulas(logits, experts, cfg, 3, 10)
    top = torch.softmax(logits.gather(-1, experts), -1)
    out = sum(top[:, j:j + 1] * _expert(block, x.reshape(-1, 32), experts[:, j]) for j in range(3))
    total = (out.view(3, 10, 32) * probe).sum() + 0.25 * (0.1 * by_hand[balancing]
                                                           + 0.01 * by_hand["z"])
    (want_grad,) = torch.autograd.grad(total, weight)
    assert torch.allclose(got, want_grad, rtol=0, atol=1e-12)


def _expert(block: MoE, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Each token through its expert, one token at a time: the dense definition."""
    rows = []
    for token, e in zip(x, experts.tolist()):
        gate, up = (block.experts.gate_up[e] @ token).chunk(2)
        rows.append(block.experts.down[e] @ (F.silu(gate) * up))
    return torch.stack(rows)


def test_a_micro_batch_is_recorded_once_under_full_recompute():
    torch.manual_seed(0)
    block = Block(MOE).double()
    recompute_block(block)
    x = torch.randn(2, 8, 32, dtype=torch.float64, requires_grad=True)
    positions = torch.arange(8).expand(2, 8)
    for _ in range(2):  # two micro-batches
        block(x, positions).sum().backward()
    records = block.mlp.router.records
    assert len(records) == 2 and records[0].counts.sum() == 2 * 8 * MOE.moe_router_topk


def test_the_grouped_gemm_equals_the_loop():
    torch.manual_seed(0)
    x, weight = torch.randn(40, 16), torch.randn(5, 12, 16)
    counts = torch.tensor([10, 0, 7, 20, 3])
    fp32 = grouped(x, weight, counts)
    fp64 = grouped(x.double(), weight.double(), counts)  # torch's grouped GEMM takes no fp64
    assert fp32.shape == (40, 12) and (fp32.double() - fp64).abs().max() < 1e-5


class _Sum:
    size = 1  # one process

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def test_the_expert_bias_moves_towards_equal_counts_and_the_step_is_reported():
    cfg = replace(MOE, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                  moe_router_bias_update_rate=0.01)
    block = moe_block(cfg, torch.float32)
    routing.begin(block, 2)
    for _ in range(2):
        block(torch.randn(2, 8, 32)).sum().backward()
    counts = sum(r.counts for r in block.router.records)
    stats = routing.finish(block, type("G", (), {"token_distinct": _Sum()})())
    assert torch.equal(block.router.expert_bias, 0.01 * torch.sign(counts.mean() - counts).float())
    assert stats["moe_imbalance"] == pytest.approx(float(counts.max() / counts.mean()), abs=1e-4)
    assert not block.router.records


@pytest.mark.parametrize("change,key", [
    (dict(moe_router_score_function="sigmoid"), "moe_router_score_function='sigmoid'"),
    (dict(moe_shared_expert_intermediate_size=16), "moe_shared_expert_intermediate_size=16"),
    (dict(moe_router_pre_softmax=True), "moe_router_pre_softmax=True: MixtralForCausalLM"),
    (dict(moe_layer_freq=[1, 0]), "moe_layer_freq=[1, 0]: MixtralForCausalLM"),
    (dict(moe_router_num_groups=4, moe_router_group_topk=2), "moe_router_num_groups=4"),
])
def test_an_export_no_hugging_face_family_holds_is_one_line(change, key):
    from trainer.checkpoint.hf_families import architecture_of

    assert architecture_of(MOE) == "MixtralForCausalLM"
    assert architecture_of(replace(MOE, qk_layernorm=True, moe_layer_freq=[1, 0],
                                   moe_router_pre_softmax=True)) == "Qwen3MoeForCausalLM"
    with pytest.raises(ValueError, match=key.replace("[", r"\[").replace("]", r"\]")):
        architecture_of(replace(MOE, **change))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_an_expert_capacity_keeps_the_pairs_of_largest_weight(dtype):
    """trainer.model.capacity against a sort: for each expert with more pairs than the limit,
    the kept pairs are those whose weight is at least its limit-th largest (ties at that
    weight all kept), the others all; the dropped count is what was not kept."""
    from trainer.model.capacity import keep_within_capacity

    gen = torch.Generator().manual_seed(3)
    tokens, k, experts = 300, 2, 6
    chosen = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    chosen[:150, 0] = 0  # one expert far over its share
    weights = torch.rand(tokens, k, generator=gen, dtype=dtype)
    weights[10:20] = weights[5, 0]  # exact ties, some at expert 0's threshold
    counts = torch.bincount(chosen.reshape(-1), minlength=experts).double()
    limit = math.ceil(tokens * k / experts * 1.0)  # ModelConfig.expert_capacity at factor 1
    keep, dropped = keep_within_capacity(weights, chosen, counts, limit, lambda t: t)
    for e in range(experts):
        mine = weights[chosen == e]
        if len(mine) > limit:
            expected = weights >= mine.sort(descending=True).values[limit - 1]
        else:
            expected = torch.ones_like(keep)
        assert torch.equal(keep[chosen == e], expected[chosen == e]), e
    assert counts[0] > limit and not keep[chosen == 0].all()  # it dropped some
    assert float(dropped) == (~keep).sum().item()
