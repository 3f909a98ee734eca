"""The gated MLP's activations (trainer/model/mlp.py, model.activation_func with its offset and
clamp) against transformers' own: gpt-oss's clamped SwiGLU (GptOssExperts._apply_gate, its gate
and up interleaved) and Gemma 3's GeGLU (gelu_pytorch_tanh); the registry is the one the
compose-time rules name, and the default is the plain SwiGLU every earlier model ran."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import GptOssConfig
from transformers.activations import ACT2FN
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

from trainer.config import ModelConfig
from trainer.model.mlp import GATE_FUNCTIONS, activation, dense_mlp, geglu, swiglu
from trainer.parts.mlp import ACTIVATION_FUNCS

CFG = ModelConfig(name="llama", vocab_size=256, hidden_size=16, num_layers=1, num_heads=2,
                  ffn_hidden_size=24, rope_theta=1e4, norm_eps=1e-5, init_std=0.02)
GPT_OSS = replace(CFG, activation_func="quick_gelu", glu_linear_offset=1.0,
                  activation_func_clamp_value=7.0)


def test_registry_is_what_the_rules_name():
    assert tuple(GATE_FUNCTIONS) == ACTIVATION_FUNCS


def test_default_is_the_plain_swiglu():
    assert activation(CFG) is swiglu
    assert dense_mlp(CFG).activation_fn is swiglu
    gate, up = torch.randn(2, 3, 8, dtype=torch.float64).unbind(0)
    assert torch.equal(swiglu(gate, up), torch.nn.functional.silu(gate) * up)


def test_clamped_swiglu_equals_gpt_oss():
    """Values far past the limit on both sides, so that each clamp matters."""
    experts = GptOssExperts(GptOssConfig(hidden_size=16, intermediate_size=24,
                                         num_local_experts=2, swiglu_limit=7.0))
    torch.manual_seed(0)
    gate_up = torch.randn(5, 48, dtype=torch.float64) * 12
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]  # theirs interleaved, ours halves
    ours = activation(GPT_OSS)(gate, up)
    theirs = experts._apply_gate(gate_up)
    assert torch.equal(ours, theirs)
    unclamped = activation(replace(GPT_OSS, activation_func_clamp_value=None))(gate, up)
    assert (unclamped - theirs).abs().max() > 1.0  # the clamp is on, and this test sees it


def test_geglu_equals_gemma3s_gelu_pytorch_tanh():
    torch.manual_seed(0)
    gate, up = torch.randn(2, 4, 32, dtype=torch.float64).unbind(0)
    fn = activation(replace(CFG, activation_func="fast_gelu"))
    assert fn is geglu
    torch.testing.assert_close(fn(gate, up), ACT2FN["gelu_pytorch_tanh"](gate) * up,
                               rtol=1e-15, atol=1e-15)
    assert (fn(gate, up) - swiglu(gate, up)).abs().max() > 1e-3


@pytest.mark.parametrize("name", ACTIVATION_FUNCS)
def test_offset_and_clamp_apply_to_every_gate_function(name):
    torch.manual_seed(0)
    gate, up = (torch.randn(2, 3, 8, dtype=torch.float64) * 6).unbind(0)
    cfg = replace(CFG, activation_func=name, glu_linear_offset=0.5, activation_func_clamp_value=2.0)
    expected = GATE_FUNCTIONS[name](gate.clamp(max=2.0)) * (up.clamp(-2.0, 2.0) + 0.5)
    assert torch.equal(activation(cfg)(gate, up), expected)
