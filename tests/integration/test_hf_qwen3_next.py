"""Qwen3-Next (Qwen3NextForCausalLM, the hybrid) and Qwen3.5's text model (Qwen3_5ForCausalLM)
through python -m trainer.hf, checked against
transformers' own random tiny model built offline (its PyTorch reference path: neither
flash-linear-attention nor causal-conv1d is installed): 4 layers, three Gated DeltaNet then one
gated full attention, 2 key heads shared by 4 value heads, a quarter of each attention head
rotary, 8 experts with a gated shared expert. Imported, our logits are transformers'; imported
then exported, every tensor is bit-exact; greedy decoding (the recurrent state as the cache)
gives transformers' generate tokens; what we do not build is one line.

Tolerance of the logits: 2e-5 relative (2-norm). transformers' rule computes in fp32 whatever
the model's dtype (its torch_chunk_gated_delta_rule casts q, k, v, g and beta to fp32), so fp64
cannot be compared tighter: measured 6.1e-6 in fp32 with experts (2.3e-6 dense, and 2.4e-6
with both models in fp64). Our chunked rule is held to the token-by-token recurrence in fp64
at 1e-12 instead (tests/unit/test_gdn.py). A wrong decay (dt_bias left out), the convolution
left out, the value heads' decays in reverse order, the attention's output gate left out
and every dim rotary each miss it by more than two orders of magnitude (the test checks each).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file
from test_generate import PROMPT
from test_hf import cli, refused, relative

from trainer.checkpoint.hf import import_hf
from trainer.checkpoint.whole import load_model
from trainer.config import ModelConfig
from trainer.model.generate import generate

TOLERANCE = 2e-5  # logits, relative 2-norm


def hf_model(folder: Path, **changes) -> transformers.Qwen3NextForCausalLM:
    """transformers' random tiny Qwen3-Next (drawn_and_saved)."""
    config = transformers.Qwen3NextConfig(**{
        **dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=8,
               linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8,
               num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=48, max_position_embeddings=512), **changes})
    torch.manual_seed(0)
    return drawn_and_saved(transformers.Qwen3NextForCausalLM(config).eval(), folder)


def drawn_and_saved(model, folder: Path):
    """`model` with its norms and convolutions drawn wide (theirs start at zero or one: ours
    must be read, not assumed), its attention drawn to depend on positions and the state,
    saved with save_pretrained."""
    with torch.no_grad():
        for key, tensor in model.named_parameters():
            if "norm" in key:
                tensor.uniform_(-0.5, 0.5)
            elif "conv1d" in key:
                tensor.normal_(0.0, 0.5)
            elif ("self_attn" in key or "linear_attn" in key) and tensor.ndim == 2:
                tensor.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    return model


def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 100), generator=torch.Generator().manual_seed(1))


def logits_error(ours, want: torch.Tensor) -> float:
    with torch.no_grad():
        return relative(ours(tokens())[..., :256], want)


def misses(label: str, ours, want: torch.Tensor) -> None:
    off = logits_error(ours.eval(), want)
    print(f"{label}: {off:.2e}")
    assert off > 100 * TOLERANCE


def test_import_matches_transformers_and_export_is_bit_exact(tmp_path):
    theirs = hf_model(tmp_path / "hf")
    cli("-m", "trainer.hf", "import", str(tmp_path / "hf"), str(tmp_path / "ours"))
    model = ModelConfig(**yaml.safe_load((tmp_path / "ours" / "model.yaml").read_text()))
    assert (model.name, model.linear_attention_freq, model.rotary_percent) == \
        ("qwen3_next", 4, 0.25)
    assert model.moe_shared_expert_gate and model.attention_output_gate
    with torch.no_grad():
        want = theirs(tokens()).logits
    ours = load_model(tmp_path / "ours", model).eval()
    error = logits_error(ours, want)
    print(f"\nqwen3_next: logits relative difference to transformers {error:.2e}")
    assert error <= TOLERANCE

    misses("the decay without dt_bias", _changed(load_model(tmp_path / "ours", model),
                                                  "dt_bias", torch.zeros_like), want)
    misses("the convolution left out", _without_convolution(
        load_model(tmp_path / "ours", model)), want)
    misses("the value heads' decays in reverse order", _decays_reversed(
        load_model(tmp_path / "ours", model)), want)
    misses("every dim rotary", load_model(tmp_path / "ours", replace(model, rotary_percent=1.0)),
           want)
    misses("no output gate", _ungated(load_model(tmp_path / "ours", model)), want)

    cli("-m", "trainer.hf", "export", str(tmp_path / "ours"), str(tmp_path / "back"))
    before, after = (load_file(tmp_path / f / "model.safetensors") for f in ("hf", "back"))
    assert set(after) == set(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    back = transformers.Qwen3NextForCausalLM.from_pretrained(tmp_path / "back").eval()
    source, config = theirs.config.to_dict(), back.config.to_dict()
    for key in ("model_type", "layer_types", "linear_num_key_heads", "linear_num_value_heads",
                "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
                "head_dim", "num_key_value_heads", "intermediate_size", "num_experts",
                "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
                "mlp_only_layers", "rms_norm_eps", "tie_word_embeddings"):
        assert config[key] == source[key], key
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.25
    with torch.no_grad():
        assert torch.equal(back(tokens()).logits, want)


def _changed(model, name: str, how):
    for key, tensor in model.named_parameters():
        if key.endswith(name):
            with torch.no_grad():
                tensor.copy_(how(tensor))
    return model


def _without_convolution(model):
    """Every linear block's convolution as the identity (its last tap one, the rest zero)."""
    def identity(weight: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(weight)
        out[:, -1] = 1.0
        return out
    return _changed(model, "conv_weight", identity)


def _decays_reversed(model):
    """A_log's value heads in reverse: each value head decays at another head's rate."""
    return _changed(model, "A_log", lambda t: t.flip(0))


def _ungated(model):
    """The full-attention block's output gate forced open (sigmoid = 1 everywhere)."""
    for module in model.modules():
        if getattr(module, "cfg", None) is not None and hasattr(module, "q_norm"):
            module.forward = _open_gate(module)
    return model


def _open_gate(attention):
    plain = type(attention).forward

    def forward(x, positions, documents=None):
        cfg = attention.cfg
        attention.cfg = replace(cfg, attention_output_gate=False)
        q, k, v = attention.qkv.weight.split([cfg.q_proj_size, cfg.kv_size, cfg.kv_size])
        saved = attention.qkv.weight.data
        heads = q.view(cfg.num_heads, 2, cfg.head_dim, -1)[:, 0].reshape(cfg.q_size, -1)
        attention.qkv.weight.data = torch.cat([heads, k, v])
        attention.parts = attention.cfg.qkv_heads
        try:
            return plain(attention, x, positions, documents)
        finally:
            attention.cfg, attention.qkv.weight.data = cfg, saved
            attention.parts = cfg.qkv_heads
    return forward


def test_greedy_tokens_are_transformers(tmp_path):
    """The recurrent state and the convolution's last inputs as the cache, as transformers'."""
    theirs = hf_model(tmp_path / "hf")
    model = import_hf(tmp_path / "hf", tmp_path / "imported")
    prompt = PROMPT * 2
    got = generate(load_model(tmp_path / "imported", model), prompt, 16)
    theirs.generation_config.eos_token_id = None
    want = theirs.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                           pad_token_id=0)[0, len(prompt):].tolist()
    assert got == want


@pytest.mark.parametrize("change, names", [
    (dict(layer_types=["linear_attention"] * 4), ("linear_attention_freq", "full-attention")),
    (dict(layer_types=["linear_attention", "sliding_attention", "full_attention",
                       "full_attention"]), ("layer_types",)),
    (dict(linear_num_value_heads=3), ("linear_num_value_heads",)),
])
def test_what_we_do_not_build_is_one_line(change, names, tmp_path):
    hf_model(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    refused("-m", "trainer.hf", "import", str(tmp_path / "hf"), str(tmp_path / "ours"),
            names=names)
    assert not (tmp_path / "ours").exists()


def qwen3_5_model(folder: Path) -> transformers.Qwen3_5ForCausalLM:
    """transformers' random tiny Qwen3.5 text model (dense; its linear blocks' projections
    stored by part, in_proj_qkv, _z, _b and _a; drawn_and_saved)."""
    config = transformers.Qwen3_5TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
        linear_key_head_dim=16, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, max_position_embeddings=512)
    torch.manual_seed(0)
    return drawn_and_saved(transformers.Qwen3_5ForCausalLM(config).eval(), folder)


def test_qwen3_5_text_imports_exports_and_generates_as_transformers(tmp_path):
    """Qwen3.5's text model: the same parts, dense, its projections as our in_proj's parts (no
    reordering); measured 8.6e-6 in fp32. Its multimodal rotary (mrope) turns text positions
    as plain rotary does: the three position sets of a text token are equal."""
    theirs = qwen3_5_model(tmp_path / "hf")
    model = import_hf(tmp_path / "hf", tmp_path / "ours")
    assert (model.name, model.num_moe_experts, model.linear_attention_freq) == \
        ("qwen3_5", None, 4)
    with torch.no_grad():
        want = theirs(tokens()).logits
    error = logits_error(load_model(tmp_path / "ours", model).eval(), want)
    print(f"\nqwen3_5: logits relative difference to transformers {error:.2e}")
    assert error <= TOLERANCE
    misses("the decay without dt_bias", _changed(load_model(tmp_path / "ours", model),
                                                  "dt_bias", torch.zeros_like), want)
    cli("-m", "trainer.hf", "export", str(tmp_path / "ours"), str(tmp_path / "back"))
    before, after = (load_file(tmp_path / f / "model.safetensors") for f in ("hf", "back"))
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)
    back = transformers.Qwen3_5ForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        assert torch.equal(back(tokens()).logits, want)
    prompt = PROMPT * 2
    got = generate(load_model(tmp_path / "ours", model), prompt, 12)
    theirs.generation_config.eos_token_id = None
    assert got == theirs.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                  pad_token_id=0)[0, len(prompt):].tolist()
