"""Rotary frequencies (trainer/model/rotary.py) against transformers' own rope initialisers, the
oracle every imported checkpoint was trained with: plain rope, Llama 3's scaling and YaRN as
DeepSeek-V3 sets it (mscale and mscale_all_dim) and as other families do (mscale unset)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from trainer.config import ModelConfig
from trainer.model.rotary import rotary_frequencies, softmax_correction

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

BASE = ModelConfig(name="llama", vocab_size=256, hidden_size=64, num_layers=1, num_heads=4,
                   ffn_hidden_size=128, rope_theta=10000.0, norm_eps=1e-6, init_std=0.02)


def theirs(kind: str, dim: int, theta: float, **parameters) -> tuple[torch.Tensor, float]:
    config = transformers.LlamaConfig(hidden_size=dim * 4, num_attention_heads=4, head_dim=dim,
                                      max_position_embeddings=163840,
                                      rope_parameters={"rope_type": kind, "rope_theta": theta,
                                                       **parameters})
    init = ROPE_INIT_FUNCTIONS[kind] if kind != "default" else None
    if init is None:
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / theta ** exponents, 1.0
    return init(config, "cpu")


@pytest.mark.parametrize("dim,theta,factor,context,mscale,mscale_all_dim", [
    (64, 10000.0, 40.0, 4096, 1.0, 1.0),  # DeepSeek-V3's decoupled rotary part
    (64, 50000.0, 32.0, 4096, 1.0, 1.0),  # Kimi K2's
    (128, 1000000.0, 4.0, 32768, None, None),  # YaRN without mscale (Qwen's long context)
    (8, 10000.0, 40.0, 64, 0.707, 0.707),  # tiny, Megatron's MLA defaults for mscale
])
def test_yarn_is_transformers_yarn(dim, theta, factor, context, mscale, mscale_all_dim):
    cfg = replace(BASE, rope_theta=theta, rope_type="yarn", rotary_scaling_factor=factor,
                  original_max_position_embeddings=context, mscale=mscale or 1.0,
                  mscale_all_dim=mscale_all_dim or 0.0)
    extra = {} if mscale is None else {"mscale": mscale, "mscale_all_dim": mscale_all_dim}
    want, want_factor = theirs("yarn", dim, theta, factor=factor, beta_fast=32.0, beta_slow=1.0,
                               original_max_position_embeddings=context, **extra)
    got, got_factor = rotary_frequencies(cfg, dim)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert got_factor == pytest.approx(want_factor, rel=1e-12)
    # interpolated where slow, kept where fast: YaRN changed something and kept something
    plain, _ = theirs("default", dim, theta)
    assert not torch.allclose(got, plain) and got[0] == plain[0]


def test_plain_and_llama3_rope_are_transformers():
    got, factor = rotary_frequencies(BASE, 16)
    torch.testing.assert_close(got, theirs("default", 16, 10000.0)[0], rtol=1e-6, atol=0)
    assert factor == 1.0
    llama3 = replace(BASE, rope_theta=500000.0, use_rope_scaling=True, rope_scaling_factor=8.0)
    want, _ = theirs("llama3", 128, 500000.0, factor=8.0, low_freq_factor=1.0,
                     high_freq_factor=4.0, original_max_position_embeddings=8192)
    torch.testing.assert_close(rotary_frequencies(llama3, 128)[0], want, rtol=1e-6, atol=0)


def test_the_softmax_correction_is_deepseeks():
    """DeepSeek-V3's softmax scale: qk_head_dim^-0.5 x (0.1 x mscale_all_dim x ln 40 + 1)^2
    (transformers' yarn_apply_mscale); none without YaRN or without mscale_all_dim."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    cfg = replace(BASE, rope_type="yarn", rotary_scaling_factor=40.0, mscale_all_dim=1.0)
    parameters = {"rope_type": "yarn", "factor": 40.0, "mscale_all_dim": 1.0}
    assert softmax_correction(cfg) == pytest.approx(yarn_apply_mscale(parameters, 1.0), rel=1e-15)
    assert softmax_correction(replace(cfg, mscale_all_dim=0.0)) == 1.0
    assert softmax_correction(BASE) == 1.0
