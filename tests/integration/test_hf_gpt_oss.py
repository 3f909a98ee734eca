"""gpt-oss (GptOssForCausalLM) through python -m trainer.hf, checked against transformers' own
random tiny model built offline: biases, sinks, sliding windows on every other layer, YaRN with
an unrounded ramp (truncate false), experts stored fused, transposed and with gate and up
interleaved. Imported, our logits are transformers'; imported then exported, every tensor is
bit-exact and config.json's fields come back; greedy decoding past the window gives
transformers' generate tokens; what we cannot build is one line.

Tolerance of the logits: 1e-6 relative (2-norm), both models cast to fp64 after the import (the
weights are fp32 either way): what is left is each side's fp32 rotary frequencies (measured
8.8e-8). A window one key wider, the windowed and full layers swapped, the sinks zeroed, the
YaRN ramp rounded (truncate ignored) and the experts' gate and up left interleaved each miss it
by more than two orders of magnitude (the test checks each).
"""
from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file
from test_hf import cli, relative

from trainer.checkpoint.hf import export_hf, read_model_config
from trainer.checkpoint.hf_families import architecture_of, hf_config, model_config
from trainer.checkpoint.whole import load_model
from trainer.config import ModelConfig
from trainer.model.generate import generate

from config_helpers import ROOT

TOLERANCE = 1e-6  # logits, relative 2-norm
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "original_max_position_embeddings": 64, "truncate": False}
# Longer than the sliding window (8 keys): the windowed layers' cache drops keys.
PROMPT = [5, 17, 99, 3, 42, 7, 7, 120, 250, 1, 64, 33]
S, F = "sliding_attention", "full_attention"


def hf_model(folder: Path) -> transformers.GptOssForCausalLM:
    """transformers' random tiny gpt-oss (4 layers, sliding and full in turn, 4 experts of 24:
    2F differs from hidden, so a transpose left out is a shape), its norms, biases and sinks
    drawn too (theirs start at one and zero), saved with save_pretrained."""
    config = transformers.GptOssConfig(
        vocab_size=256, hidden_size=64, intermediate_size=24, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8, rope_parameters=YARN,
        max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for key, tensor in model.named_parameters():
            if "norm" in key:
                tensor.uniform_(0.5, 1.5)
            elif "embed" in key or "sinks" in key:  # sinks of the attention logits' size
                tensor.normal_(0.0, 1.0)
            else:
                tensor.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    model.config._experts_implementation = "eager"  # CPU, fp64: the plain loop over experts
    return model


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> tuple[Path, transformers.GptOssForCausalLM, ModelConfig]:
    """The folder (hf/: transformers' files, ours/: their import by the CLI), their model and
    the imported model's config."""
    folder = tmp_path_factory.mktemp("gpt_oss")
    theirs = hf_model(folder / "hf")
    cli("-m", "trainer.hf", "import", str(folder / "hf"), str(folder / "ours"))
    return folder, theirs, read_model_config(folder / "ours", None)


def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        out = copy.deepcopy(model).double()(tokens())
    return getattr(out, "logits", out)[..., :256]


def misses(label: str, ours, want: torch.Tensor) -> None:
    """A wrong mapping fails the tolerance by more than two orders of magnitude."""
    off = relative(logits(ours), want)
    print(f"{label}: {off:.2e}")
    assert off > 100 * TOLERANCE


def test_import_matches_transformers_and_a_wrong_window_or_sink_does_not(imported):
    folder, theirs, model = imported
    assert (model.window_size, model.window_attn_skip_freq) == (7, 2)
    assert not model.yarn_correction_range_round_to_int and model.softmax_type == "learnable"
    want, ckpt = logits(theirs), folder / "ours"
    error = relative(logits(load_model(ckpt, model).eval()), want)
    print(f"\ngpt-oss: logits relative difference to transformers {error:.2e}")
    assert error <= TOLERANCE

    misses("a window one key wider", load_model(ckpt, replace(model, window_size=8)), want)
    misses("the windowed and full layers swapped",
           load_model(ckpt, replace(model, window_attn_skip_freq=[0, 1, 0, 1])), want)
    misses("the YaRN ramp rounded", load_model(
        ckpt, replace(model, yarn_correction_range_round_to_int=True)), want)
    wrong = load_model(ckpt, model)
    with torch.no_grad():
        for layer in wrong.layers.values():
            layer.attn.sinks.zero_()
    misses("the sinks zeroed", wrong, want)
    wrong, f = load_model(ckpt, model), model.expert_ffn_size
    with torch.no_grad():  # gate | up rows laid out as the files interleave them
        for layer in wrong.layers.values():
            for p in (layer.mlp.experts.gate_up, layer.mlp.experts.gate_up_bias):
                p.copy_(torch.stack((p[:, :f], p[:, f:]), 2).flatten(1, 2))
    misses("the experts' gate and up left interleaved", wrong, want)


def test_import_then_export_is_bit_exact_and_config_json_comes_back(imported):
    folder, theirs, _ = imported
    cli("-m", "trainer.hf", "export", str(folder / "ours"), str(folder / "back"))
    before, after = (load_file(folder / f / "model.safetensors") for f in ("hf", "back"))
    assert set(after) == set(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    back = transformers.GptOssForCausalLM.from_pretrained(folder / "back").eval()
    back.config._experts_implementation = "eager"
    source, again = theirs.config.to_dict(), back.config.to_dict()
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "num_local_experts",
                "num_experts_per_tok", "sliding_window", "layer_types", "rope_parameters",
                "swiglu_alpha", "swiglu_limit", "attention_bias", "attention_dropout",
                "rms_norm_eps", "tie_word_embeddings", "initializer_range",
                "max_position_embeddings"):
        assert again[key] == source[key], (key, again[key], source[key])
    # transformers adds no balance loss without output_router_logits: its coefficient is then
    # unused (0.001 here, openai's 0.9), imported as none and written back as 0
    assert not source["output_router_logits"] and not again["output_router_logits"]
    with torch.no_grad():
        assert torch.equal(back(tokens()).logits, theirs(tokens()).logits)


def test_greedy_tokens_past_the_window_are_transformers_generate(imported):
    folder, theirs, model = imported
    got = generate(load_model(folder / "ours", model).eval(), PROMPT, 16)
    theirs.generation_config.eos_token_id = None  # 16 tokens, as ours without a stop token
    want = theirs.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False,
                           pad_token_id=0)[0, len(PROMPT):].tolist()
    assert got == want and len(set(got)) > 4  # not one token repeated


def test_an_export_of_another_window_pattern_is_what_transformers_computes(imported, tmp_path):
    """Our keys written as transformers reads them: a window of 6 keys on layers 1 to 3 (a
    list: no k has every k-th layer full), the ramp rounded (truncate's default), the balance
    loss on (output_router_logits)."""
    folder, _, model = imported
    other = replace(model, window_size=5, window_attn_skip_freq=[0, 1, 1, 1],
                    yarn_correction_range_round_to_int=True, moe_aux_loss_coeff=0.01)
    export_hf(folder / "ours", tmp_path / "hf", other)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["sliding_window"] == 6 and "truncate" not in config["rope_parameters"]
    assert config["layer_types"] == [F, S, S, S]
    theirs = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "hf").eval()
    theirs.config._experts_implementation = "eager"
    error = relative(logits(load_model(folder / "ours", other).eval()), logits(theirs))
    print(f"\nexported with layers 1 to 3 windowed to 6 keys: {error:.2e}")
    assert error <= TOLERANCE
    assert model_config(config, tmp_path / "hf" / "config.json") == replace(other,
                                                                         kv_channels=None)


def saved_config(changes: dict) -> dict:
    config = transformers.GptOssConfig(
        vocab_size=256, hidden_size=64, intermediate_size=24, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, rope_parameters=YARN, max_position_embeddings=2048).to_dict()
    config["architectures"] = ["GptOssForCausalLM"]
    return {k: v for k, v in {**config, **changes}.items() if v is not None}



@pytest.mark.parametrize("types,window,every", [
    (None, 7, 2),  # transformers' default: sliding, full, sliding, full
    ([S, S, F, S], 7, 3), ([S, S, S, F], 7, 4), ([S, S, S, S], 7, None),
    ([F, S, S, S], 7, [0, 1, 1, 1]), ([F, F, F, F], None, None)])
def test_layer_types_are_window_attn_skip_freq(types, window, every):
    model = model_config(saved_config({"sliding_window": 8, "layer_types": types}),
                         Path("/models/x/config.json"))
    assert (model.window_size, model.window_attn_skip_freq) == (window, every)


# What we cannot build or would compute otherwise, each one line naming the field.
REFUSED = [
    ({"quantization_config": {"quant_method": "mxfp4"}}, "Mxfp4Config(dequantize=True)"),
    ({"attention_bias": False}, "attention_bias=False"),
    ({"swiglu_alpha": 1.5}, "swiglu_alpha=1.5"),
    ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
    ({"layer_types": [S, F, "chunked_attention", F]}, "layer_types="),
    ({"layer_types": [S, F]}, "per layer (4)"),
    ({"sliding_window": None}, "sliding_window=None"),
    ({"rope_parameters": {**YARN, "attention_factor": 1.2}}, "attention_factor"),
    ({"rope_parameters": {**YARN, "rope_type": "llama3"}}, "only YaRN"),
    ({"architectures": ["GptOssForSequenceClassification"]}, "architectures="),
]


@pytest.mark.parametrize("change,message", REFUSED, ids=[m[:30] for _, m in REFUSED])
def test_what_we_cannot_build_is_one_line(change, message):
    source = Path("/models/x/config.json")
    model_config(saved_config({}), source)  # the config itself imports
    with pytest.raises(ValueError) as refusal:
        model_config(saved_config(change), source)
    text = str(refusal.value)
    assert message in text and "Fix:" in text and "\n" not in text, text


def preset(name: str) -> ModelConfig:
    return ModelConfig(**yaml.safe_load((ROOT / "conf" / "model" / f"{name}.yaml").read_text()))


@pytest.mark.parametrize("change,key", [
    (dict(activation_func_clamp_value=None), "activation_func_clamp_value=None"),
    (dict(moe_router_topk_scaling_factor=2.0), "moe_router_topk_scaling_factor=2.0"),
    (dict(moe_router_num_groups=2, moe_router_group_topk=1), "moe_router_num_groups=2"),
    (dict(mscale=0.5), "mscale=0.5"),
])
def test_an_export_gpt_oss_cannot_hold_is_one_line(change, key):
    tiny = preset("tiny_gpt_oss")
    assert architecture_of(tiny) == "GptOssForCausalLM"
    with pytest.raises(ValueError, match=f"^model.{key}: GptOssForCausalLM .*Fix:"):
        architecture_of(replace(tiny, **change))


@pytest.mark.parametrize("change,key", [(dict(window_size=7), "window_size=7"),
                                        (dict(softmax_type="learnable"), "softmax_type=")])
def test_a_window_or_sinks_in_a_family_without_them_is_refused_on_export(change, key):
    """Llama's, Qwen3's, Mixtral's, Qwen3-MoE's and DeepSeek-V3's config.json has no window or
    sinks that transformers applies: an export would drop them."""
    with pytest.raises(ValueError, match=f"^model.{key}.*: LlamaForCausalLM .*Fix:"):
        architecture_of(replace(preset("tiny"), **change))


# openai/gpt-oss-20b's published config.json (its quantization_config left out: refused above);
# gpt-oss-120b's differs in its layers and experts.
PUBLISHED = {"gpt_oss_20b": {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880, "layer_types": [S, F] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
    "output_router_logits": False, "pad_token_id": 199999, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "use_cache": True,
    "vocab_size": 201088}}
PUBLISHED["gpt_oss_120b"] = {**PUBLISHED["gpt_oss_20b"], "num_hidden_layers": 36,
                             "layer_types": [S, F] * 18, "num_local_experts": 128}


@pytest.mark.parametrize("name", ["gpt_oss_20b", "gpt_oss_120b"])
def test_each_preset_is_what_importing_its_published_config_gives(name):
    assert model_config(dict(PUBLISHED[name]), Path(f"/models/{name}/config.json")) == preset(name)


@pytest.mark.parametrize("name", ["gpt_oss_20b", "gpt_oss_120b", "tiny_gpt_oss"])
def test_each_presets_config_json_reads_back_as_the_preset(name):
    model = preset(name)
    config = hf_config(model, torch.bfloat16)
    assert config["layer_types"][:2] == [S, F] and config["sliding_window"] == model.window_size + 1
    read = model_config(config, Path("config.json"))
    # a head width of hidden / heads is written and read back as null (tiny_gpt_oss's 16)
    assert read == replace(model, kv_channels=read.kv_channels) and read.head_dim == model.head_dim
