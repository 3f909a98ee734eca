"""The FLOPs the log's MFU counts (trainer.plan.cost.TokenFlops) against torch's own FLOP counter
on a forward of the model: tiny_deepseek, whose blocks are multi-latent attention and experts
and whose multi-token prediction depth adds a block, an eh_proj and the head.

torch.utils.flop_counter counts every matmul (aten.mm: the linears, the router, the head) and
batched matmuls (aten.bmm), but not the fused attention kernels nor the experts' grouped GEMM.
So the attention runs here as plain matmuls (QK^T and AV over all S keys, where causal
attention does half) and the experts are counted by hand: each token through moe_router_topk
experts of 3 h x F weights in each expert block, the depth's included."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import yaml
from omegaconf import OmegaConf
from torch.utils.flop_counter import FlopCounterMode

from trainer.config import ModelConfig
from trainer.model.transformer import Transformer
from trainer.plan.cost import TokenFlops

from config_helpers import ROOT


def plain_attention(q, k, v, documents=None, logits=None):
    """Causal attention as matmuls the FLOP counter sees."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    causal = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    return scores.masked_fill(~causal, -math.inf).softmax(-1) @ v


def preset(name: str) -> ModelConfig:
    values = yaml.safe_load((ROOT / "conf" / "model" / f"{name}.yaml").read_text())
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), values))


@pytest.mark.parametrize("seq", [16, 32])
def test_mla_moe_and_mtp_flops_are_what_torch_counts(seq):
    cfg = preset("tiny_deepseek")
    assert cfg.multi_latent_attention and cfg.mtp_num_layers == 1
    model = Transformer(cfg)
    model.init_weights(1)
    for module in model.modules():
        if hasattr(module, "attention_fn"):
            module.attention_fn = plain_attention
    b = 2
    tokens = torch.randint(0, cfg.vocab_size, (b, seq))
    ahead = torch.randint(0, cfg.vocab_size, (cfg.mtp_num_layers, b, seq))
    with FlopCounterMode(display=False) as counter:
        model(tokens, None, None, ahead)
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    expert_blocks = sum(cfg.is_moe_block(i) for i in range(cfg.num_layers)) + cfg.mtp_num_layers
    experts = (b * seq * expert_blocks * 2 * cfg.moe_router_topk
               * 3 * cfg.hidden_size * cfg.expert_ffn_size)
    causal_attention = counts["aten.bmm"] / 2
    want = counts["aten.mm"] + causal_attention + experts
    token = TokenFlops.of(cfg, seq)
    ours = b * seq * (token.num_layers * (token.block_linear + token.block_attention)
                      + token.head + token.mtp)
    assert ours == pytest.approx(want, rel=1e-12)
    assert token.mtp > 0.2 * (token.training / 3)  # the depth is a fifth of this tiny model


def banded_attention(q, k, v, documents=None, window=None, sinks=None, logits=None):
    """Attention as one matmul pair per query row over exactly the keys it sees (i - window ..
    i), so the FLOP counter sees the band and nothing outside it."""
    rows = []
    for i in range(q.shape[2]):
        lo = 0 if window is None else max(0, i - window)
        keys, values = (t[:, :, lo:i + 1].repeat_interleave(q.shape[1] // t.shape[1], 1)
                        for t in (k, v))
        scores = q[:, :, i:i + 1] @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1])
        rows.append(scores.softmax(-1) @ values)
    return torch.cat(rows, dim=2)


@pytest.mark.parametrize("window", [3, 8, 40])
def test_window_flops_are_what_torch_counts_over_the_band(window):
    """Blocks windowed every other block: each query's QK^T and AV over the keys its window
    lets it see, counted by torch. Megatron's count of causal attention is S/2 keys a query
    (S(S+1)/2 pairs less half the diagonal); the plan counts a window's band the same way."""
    cfg = ModelConfig(name="llama", vocab_size=256, hidden_size=64, num_layers=4, num_heads=4,
                      num_query_groups=2, ffn_hidden_size=176, rope_theta=1e4, norm_eps=1e-5,
                      init_std=0.02, window_size=window, window_attn_skip_freq=2)
    model = Transformer(cfg)
    model.init_weights(1)
    for module in model.modules():
        if hasattr(module, "attention_fn"):
            module.attention_fn = banded_attention
    b, seq = 2, 24
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(0, cfg.vocab_size, (b, seq)))
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    half_diagonal = cfg.num_layers * b * seq * 2 * cfg.q_size  # half a key a query, QK and AV
    want = counts["aten.mm"] + counts["aten.bmm"] - half_diagonal
    token = TokenFlops.of(cfg, seq)
    ours = b * seq * (token.num_layers * (token.block_linear + token.block_attention)
                      + token.head)
    assert ours == pytest.approx(want, rel=1e-12)
    full = TokenFlops.of(replace(cfg, window_size=None, window_attn_skip_freq=None), seq)
    assert (token.block_attention < full.block_attention) == (window < seq - 1)


@pytest.mark.parametrize("dpo", [False, True], ids=["lm", "dpo"])
def test_lora_training_flops_are_what_torch_counts(dpo):
    """peft=lora: the frozen weights' backward forms the input's gradient only, the adapters'
    and the attention core's their whole backward; with DPO the reference's forward (adapters
    off) adds one forward of the base. torch counts a forward and a backward of the tiny model
    with adapters on five projections (and the base's forward alone for DPO's reference). The
    embedding is set to train here, so the first block forms its input's gradient as the others
    do: the count MFU keeps for every block (the real first block skips it, 1/L of qkv's)."""
    from trainer.config import PeftConfig
    from trainer.model.lora import adapters_off, add_adapters
    from trainer.parts.lora import Adapters

    cfg, seq, b = preset("tiny"), 32, 2
    peft = PeftConfig("lora", 4, 8.0, 0.0, ["q_proj", "v_proj", "o_proj", "gate_proj",
                                            "down_proj"])
    model = Transformer(cfg)
    add_adapters(model, cfg, peft)
    with torch.no_grad():
        model.init_weights(1)
    model.embed.weight.requires_grad_(True)
    for module in model.modules():
        if hasattr(module, "attention_fn"):
            module.attention_fn = lambda q, k, v, *rest, **kwargs: plain_attention(q, k, v)
    tokens = torch.randint(0, cfg.vocab_size, (b, seq))
    with FlopCounterMode(display=False) as counter:
        if dpo:
            with torch.no_grad(), adapters_off(model):
                model(tokens)
        model(tokens).float().sum().backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    want = counts["aten.mm"] + counts["aten.bmm"] / 2  # causal: half the keys
    token = TokenFlops.of(cfg, seq, Adapters.of(peft))
    ours = b * seq * (token.training + (token.forward if dpo else 0.0))
    assert ours == pytest.approx(want, rel=1e-12)
    assert token.training < 0.75 * TokenFlops.of(cfg, seq).training  # so it can fail
