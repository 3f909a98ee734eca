"""Gated DeltaNet's rule and layer on one process (trainer.model.gdn), in fp64: the chunked form
against the token-by-token recurrence (the rule's definition, written out in
recurrent_gated_delta_rule), packed documents against separate sequences, a sequence cut in two
with the state carried across, and the layer's documents through the whole model."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from trainer.config import ModelConfig
from trainer.model.delta_rule import gated_delta_rule, recurrent_gated_delta_rule
from trainer.model.gdn import causal_conv, document_ids, prepared
from trainer.model.transformer import Transformer

EXACT = 1e-12  # fp64, absolute, on outputs of order one
F64 = torch.float64


def inputs(b=2, s=150, key_heads=2, value_heads=4, dk=8, dv=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, s, key_heads, dk, generator=gen, dtype=F64) for _ in range(2))
    v = torch.randn(b, s, value_heads, dv, generator=gen, dtype=F64)
    g = -torch.rand(b, s, value_heads, generator=gen, dtype=F64)  # decays in (e^-1, 1]
    beta = torch.rand(b, s, value_heads, generator=gen, dtype=F64)
    q, k = prepared(q, k, F64)
    return q, k, v, g, beta


def documents(b=2, s=150) -> torch.Tensor:
    """Sample 0: documents at 0, 40 (inside a chunk of 16) and 96 (a chunk's first token);
    sample 1: at 0 and 17."""
    starts = torch.zeros(b, s, dtype=torch.long)
    starts[0, 40:], starts[0, 96:], starts[1, 17:] = 40, 96, 17
    return starts


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_rule_is_the_recurrence(packed, chunk):
    q, k, v, g, beta = inputs()
    ids = document_ids(documents(), "cpu") if packed else None
    state = torch.randn(2, 4, 8, 6, generator=torch.Generator().manual_seed(3), dtype=F64)
    for start in (None, state):
        got, got_state = gated_delta_rule(q, k, v, g, beta, ids, start, chunk)
        want, want_state = recurrent_gated_delta_rule(q, k, v, g, beta, ids, start)
        assert (got - want).abs().max() < EXACT
        assert (got_state - want_state).abs().max() < EXACT


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "operators"])
def test_the_chunked_backward_is_the_recurrences(compiled, monkeypatch):
    """The rule's backward (each chunk rebuilt from the state entering it, in reverse) gives
    autograd's gradients through the recurrence, for every input and the entering state:
    eagerly (autograd's graph of each chunk), and by the torch.library operators a compiled
    block calls (torch.func.vjp of each chunk), here run eagerly."""
    if compiled:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    q, k, v, g, beta = (t.requires_grad_(True) for t in inputs(s=100))
    ids = document_ids(documents(s=100)[:, :100], "cpu")
    state = torch.randn(2, 4, 8, 6, generator=torch.Generator().manual_seed(3), dtype=F64,
                        requires_grad=True)
    weights = torch.randn(2, 100, 4, 6, generator=torch.Generator().manual_seed(4), dtype=F64)
    grads = []
    for rule, extra in ((gated_delta_rule, dict(chunk=16)), (recurrent_gated_delta_rule, {})):
        out, final = rule(q, k, v, g, beta, ids, state, **extra)
        loss = (out * weights).sum() + final.square().sum()
        grads.append(torch.autograd.grad(loss, (q, k, v, g, beta, state)))
    for got, want in zip(*grads):
        assert (got - want).abs().max() < EXACT * max(1.0, want.abs().max().item())


def test_the_operators_pass_torch_library_checks():
    """opcheck: the operators' schema, fake (meta) kernels, strides and autograd
    registration agree with what they compute (a fake with other strides broke the compiled
    backward once)."""
    q, k, v, g, beta = (t[:, :32].contiguous() for t in inputs(s=32))
    chunked = [t.transpose(1, 2).reshape(*t.transpose(1, 2).shape[:2], 2, 16, -1)
               for t in (q, k, v)]
    rates = [t.transpose(1, 2).reshape(2, 4, 2, 16) for t in (g, beta)]
    ids = document_ids(documents(s=32), "cpu").view(2, 1, 2, 16)
    state = torch.randn(2, 4, 8, 6, dtype=F64)
    args = [t.requires_grad_(True) for t in (*chunked, *rates)]
    torch.library.opcheck(torch.ops.gtp.gated_delta_rule.default,
                          (*args, ids, state.requires_grad_(True)))


def test_a_document_is_its_own_sequence():
    """Packed, each document's output is that of the document alone (the state and the
    convolution restart at its first token)."""
    q, k, v, g, beta = inputs()
    ids = document_ids(documents(), "cpu")
    packed, _ = gated_delta_rule(q, k, v, g, beta, ids, chunk=16)
    for sample, (a, e) in ((0, (0, 40)), (0, (40, 96)), (0, (96, 150)), (1, (17, 150))):
        alone, _ = gated_delta_rule(*(t[sample:sample + 1, a:e] for t in (q, k, v, g, beta)))
        assert (packed[sample:sample + 1, a:e] - alone).abs().max() < EXACT
    x = torch.randn(2, 150, 5, dtype=F64)
    weight = torch.randn(5, 4, dtype=F64)
    conv = causal_conv(x, weight, ids)
    assert (conv[:1, 40:96] - causal_conv(x[:1, 40:96], weight)).abs().max() < EXACT
    # and the convolution without documents is torch's depthwise conv1d, then silu
    torch_conv = torch.nn.functional.conv1d(x.transpose(1, 2), weight[:, None], padding=3,
                                            groups=5)[..., :150]
    want = torch.nn.functional.silu(torch_conv).transpose(1, 2)
    assert (causal_conv(x, weight) - want).abs().max() < EXACT


def test_the_state_carried_across_a_cut_is_the_whole_sequence():
    """What context parallel's ring passes: the second half from the first half's final state
    (and the convolution's last inputs) equals the whole sequence, documents crossing the cut
    included."""
    q, k, v, g, beta = inputs()
    ids = document_ids(documents(), "cpu")
    whole, whole_state = gated_delta_rule(q, k, v, g, beta, ids, chunk=16)
    first, state = gated_delta_rule(*(t[:, :70] for t in (q, k, v, g, beta)), ids[:, :70],
                                    chunk=16)
    second, last = gated_delta_rule(*(t[:, 70:] for t in (q, k, v, g, beta)), ids[:, 70:],
                                    state, chunk=16)
    assert (torch.cat([first, second], 1) - whole).abs().max() < EXACT
    assert (last - whole_state).abs().max() < EXACT
    x, weight = torch.randn(2, 150, 5, dtype=F64), torch.randn(5, 4, dtype=F64)
    cut = torch.cat([causal_conv(x[:, :70], weight, ids[:, :70]),
                     causal_conv(x[:, 70:], weight, ids[:, 70:], x[:, 67:70])], 1)
    assert (cut - causal_conv(x, weight, ids)).abs().max() < EXACT


def tiny_hybrid() -> ModelConfig:
    return ModelConfig(
        name="qwen3_next", vocab_size=256, hidden_size=64, num_layers=4, num_heads=4,
        num_query_groups=2, kv_channels=16, qk_layernorm=True, attention_output_gate=True,
        rotary_percent=0.25, layernorm_zero_centered_gamma=True, ffn_hidden_size=96,
        rope_theta=1e4, norm_eps=1e-6, init_std=0.02,
        experimental_attention_variant="gated_delta_net", linear_attention_freq=4,
        linear_key_head_dim=16, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4)


def test_the_hybrid_with_documents_is_each_document_alone():
    """The whole model (three linear blocks, one full): a packed sample's logits are each
    document's own, positions restarting at each."""
    cfg = tiny_hybrid()
    torch.manual_seed(0)
    model = Transformer(cfg).double()
    model.init_weights(0)
    with torch.no_grad():  # a state that matters: decays and convolutions away from init
        for name, p in model.named_parameters():
            if name.endswith(("conv_weight", "dt_bias")):
                p.normal_(0, 0.5)
    tokens = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(1))
    starts = torch.zeros(1, 90, dtype=torch.long)
    starts[0, 33:] = 33
    positions = torch.cat([torch.arange(33), torch.arange(57)])[None]
    with torch.no_grad():
        packed = model(tokens, positions, starts)
        first, second = model(tokens[:, :33]), model(tokens[:, 33:])
    assert (packed[:, :33] - first).abs().max() < EXACT
    assert (packed[:, 33:] - second).abs().max() < EXACT
    with torch.no_grad():  # and across the boundary the documents do see each other unpacked
        assert (model(tokens)[:, 33:] - second).abs().max() > 1e-3


def test_parameters_follow_the_part():
    """The built layer's parameters are the part's shapes, in order; A_log is the log of a
    draw in [1, 16), the same whatever slice a rank asks for; dt_bias and the gated norm
    start at one, though the model's other norms are zero-centred."""
    from trainer.parts.assembly import parameter_shapes
    cfg = tiny_hybrid()
    model = Transformer(cfg)
    model.init_weights(7)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes == parameter_shapes(cfg)
    params = dict(model.named_parameters())
    a_log = params["layers.0.attn.A_log"]
    assert ((a_log.exp() >= 1) & (a_log.exp() < 16)).all() and a_log.unique().numel() == 4
    part = model.initial_values("layers.0.attn.A_log", (4,), (2,), (2,), 7)
    assert torch.equal(part, a_log.detach()[2:])
    assert torch.equal(params["layers.0.attn.dt_bias"].detach(), torch.ones(4))
    assert torch.equal(params["layers.0.attn.norm.weight"].detach(), torch.ones(8))
    assert torch.equal(params["layers.0.attn_norm.weight"].detach(), torch.zeros(64))
    assert "layers.3.attn.qkv.weight" in params and shapes["layers.3.attn.qkv.weight"] == \
        (2 * 64 + 2 * 32, 64)  # the full block: q and its gate, k, v


@pytest.mark.parametrize("change, key", [
    (dict(linear_attention_freq=None), "linear_attention_freq"),
    (dict(linear_attention_freq=[1, 1, 1, 1]), "linear_attention_freq"),
    (dict(linear_attention_freq=[1, 0, 1]), "linear_attention_freq"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads"),
    (dict(experimental_attention_variant="mamba"), "experimental_attention_variant"),
    (dict(experimental_attention_variant=None), "linear_attention_freq"),
    (dict(rotary_percent=0.1), "rotary_percent"),
    (dict(moe_shared_expert_gate=True), "moe_shared_expert_gate"),
])
def test_bad_keys_are_one_line(change, key):
    from trainer.checks import check_model
    with pytest.raises(ValueError, match=key) as error:
        check_model(replace(tiny_hybrid(), **change))
    assert "Fix:" in str(error.value) and "\n" not in str(error.value)
