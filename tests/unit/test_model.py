"""The single-device model: shapes, causality, rotary positions, seeded initialisation."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from trainer.config import ModelConfig, PeftConfig
from trainer.model.lora import add_adapters
from trainer.model.rotary import apply_rotary
from trainer.model.transformer import Transformer
from trainer.plan.muon import scale_factor

TINY = ModelConfig(name="llama", vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
                   ffn_hidden_size=176, rope_theta=10000.0, norm_eps=1e-5, init_std=0.02)


def model(seed: int = 0) -> Transformer:
    net = Transformer(TINY)
    net.init_weights(seed)
    return net


def test_logits_shape_and_causality():
    net = model()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    logits = net(tokens)
    assert logits.shape == (2, 16, 256)
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    again = net(changed)
    torch.testing.assert_close(again[:, :10], logits[:, :10], rtol=0, atol=0)
    assert not torch.allclose(again[:, 10:], logits[:, 10:])


def test_same_seed_same_weights_other_seed_other_weights():
    a, b, c = model(7).state_dict(), model(7).state_dict(), model(8).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.attn.qkv.weight"], c["layers.0.attn.qkv.weight"])
    assert torch.equal(a["norm.weight"], torch.ones(64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cols", [5, 6, 8, 10, 64])
def test_any_rectangle_of_an_initial_weight_is_the_same_whoever_draws_it(cols, dtype):
    """A shard's rows (and a TP slice's columns) equal the full weight's, for widths whose
    draws are not a multiple of 16 values too: the sizes where torch's normal fill is not a
    prefix of a longer draw (a WS 4 rank of a hidden-8 model once started from other weights)."""
    from trainer.model.init import normal_rectangle

    rows = 150  # three blocks of 64, the last partial
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as fp64 runs build their models
    try:
        full = normal_rectangle(7, "w", cols, (0, 0), (rows, cols))
        for start, count in ((0, 2), (2, 2), (6, 3), (63, 2), (64, 1), (100, 50), (149, 1)):
            for col, width in ((0, cols), (1, cols - 1), (cols // 2, cols - cols // 2)):
                part = normal_rectangle(7, "w", cols, (start, col), (count, width))
                assert torch.equal(part, full[start:start + count, col:col + width]), (start, col)
    finally:
        torch.set_default_dtype(default)


def test_explicit_positions_equal_the_default():
    net = model()
    tokens = torch.randint(0, 256, (1, 12))
    positions = torch.arange(12)[None]
    torch.testing.assert_close(net(tokens, positions), net(tokens), rtol=0, atol=0)


def test_rotary_scores_depend_only_on_relative_position():
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 1, 1, 16, generator=gen), torch.randn(1, 1, 1, 16, generator=gen)

    def score(pq: int, pk: int) -> torch.Tensor:
        rq = apply_rotary(q, torch.tensor([[pq]]), 10000.0)
        rk = apply_rotary(k, torch.tensor([[pk]]), 10000.0)
        return (rq * rk).sum()

    torch.testing.assert_close(score(5, 2), score(105, 102), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(score(5, 2), score(5, 4))


def test_bad_head_count_is_a_clear_error():
    bad = ModelConfig(**{**TINY.__dict__, "num_heads": 5})
    with pytest.raises(ValueError,
                       match="model.hidden_size=64 is not divisible by model.num_heads=5"):
        Transformer(bad)


def test_training_refuses_what_the_engine_cannot_split():
    from parallel.layout import Layout
    from trainer.plan.axis_costs import check_model_fits_layout
    from trainer.plan.options import EngineOptions

    options = EngineOptions()
    with pytest.raises(ValueError, match="2 layers do not split evenly over the 4 pipeline"):
        check_model_fits_layout(TINY, Layout(4, pipeline_model_parallel_size=4), options)
    check_model_fits_layout(TINY, Layout(2, pipeline_model_parallel_size=2), options)
    with pytest.raises(ValueError, match="model.num_heads=4 is not divisible by "
                                         "parallel.tensor_model_parallel_size=8"):
        check_model_fits_layout(TINY, Layout(8, tensor_model_parallel_size=8), options)
    check_model_fits_layout(TINY, Layout(4, tensor_model_parallel_size=4), options)


def test_the_names_checked_at_compose_time_are_the_implementations_built():
    from trainer import checks
    from trainer.train import optim

    assert set(checks.NS_DTYPES) == set(optim.NS_DTYPES)
    for mode in checks.SCALE_MODES:  # each names a scale (an unknown one raises)
        assert scale_factor(6, 3, mode) > 0


def test_every_part_names_a_layer_that_builds_with_its_shapes():
    """A part's layer ("module:factory") builds, and its parameters are the part's shapes in
    the layer's order (what the memory plan and the search size a rank from)."""
    from trainer.model.transformer import build_layer
    from trainer.parts import PARTS

    cfg = replace(TINY, num_moe_experts=4, moe_shared_expert_intermediate_size=32,
                  qk_layernorm=True)
    for part in PARTS:
        layer = build_layer(part, cfg)
        built = {name: tuple(p.shape) for name, p in layer.named_parameters()}
        assert list(built.items()) == list(part.shapes(cfg).items()), part.name


@pytest.mark.parametrize("changes", [{}, {"num_query_groups": 2}, {"tie_word_embeddings": True},
                                     {"vocab_size": 250, "num_layers": 3},
                                     {"num_moe_experts": 4, "moe_layer_freq": [0, 1]},
                                     {"num_moe_experts": 4, "moe_shared_expert_intermediate_size":
                                      32},
                                     {"num_moe_experts": 4, "moe_layer_freq": [1, 0, 1],
                                      "num_layers": 3, "moe_router_score_function": "sigmoid",
                                      "moe_router_enable_expert_bias": True},
                                     {"layernorm_zero_centered_gamma": True,  # Gemma 3's
                                      "sandwich_norm": True, "qk_layernorm": True}])
def test_parameter_shapes_from_the_config_are_the_built_models(changes):
    """The compose-time shapes (no torch) against the Transformer itself, names and order; its
    buffers (a router's expert bias) too."""
    from dataclasses import replace

    from trainer.parts.assembly import buffer_shapes, parameter_shapes

    cfg = replace(TINY, **changes)
    with torch.device("meta"):
        model = Transformer(cfg)
    built = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    assert list(parameter_shapes(cfg).items()) == built
    assert buffer_shapes(cfg) == {name: tuple(b.shape) for name, b in model.named_buffers()}
    # peft=lora: with its adapters (a mixture of experts' per expert, before a shared expert)
    peft = PeftConfig("lora", 4, 8.0, 0.0, ["q_proj", "o_proj", "up_proj", "down_proj"])
    with torch.device("meta"):
        model = Transformer(cfg)
        add_adapters(model, cfg, peft)
    built = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    assert list(parameter_shapes(cfg, peft).items()) == built
    assert len(built) > len(parameter_shapes(cfg))


def test_switching_adapters_off_gives_the_base_model_with_its_experts_adapted():
    """DPO's reference under peft=lora is the model with its adapters off: the routed experts'
    (Experts.lora_fn) as well as the projections' hooks. With every B non-zero the adapted
    model differs from its base, and with the adapters off it is the base exactly."""
    from dataclasses import replace

    from trainer.model.lora import adapters_off

    cfg = replace(TINY, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
    peft = PeftConfig("lora", 4, 8.0, 0.0, ["q_proj", "gate_proj", "up_proj", "down_proj"])
    base, model = Transformer(cfg), Transformer(cfg)
    add_adapters(model, cfg, peft)
    base.init_weights(1)
    model.init_weights(1)  # the same base weights: drawn by name
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B.weight"):
                param.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    assert any(n.endswith("lora_B.weight") and p.ndim == 3 for n, p in model.named_parameters())
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = base(tokens)
        assert not torch.allclose(model(tokens), want, atol=1e-3)
        with adapters_off(model):
            assert torch.equal(model(tokens), want)
