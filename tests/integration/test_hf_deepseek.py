"""DeepSeek-V3 (DeepseekV3ForCausalLM, Kimi K2's and Moonlight's architecture too) through
python -m trainer.hf, checked against transformers' own random tiny models built offline:
multi-latent attention with a compressed q, YaRN, group-limited sigmoid routing with the
expert bias, a shared expert and a first dense block; q projected directly with plain rope,
two shared experts and no groups (Moonlight's shape); and rotary rows not interleaved.
Imported, our logits are transformers'; imported then exported, every tensor is bit-exact;
greedy decoding gives transformers' generate tokens; what we cannot build is one line.

Tolerance of the logits: 1e-6 relative (2-norm), as tests/integration/test_hf.py's: both run
the same fp32 operations up to order (measured 1.8e-7 on CPU). A YaRN factor of 20 instead of
40, kv_up's key and value halves swapped, the rotary rows left interleaved, and the expert bias
left at zero each miss it by more than two orders of magnitude (the test checks each).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file, save_file
from test_generate import PROMPT
from test_hf import cli, refused, relative

from trainer.checkpoint.hf import import_hf
from trainer.checkpoint.hf_families import architecture_of, model_config
from trainer.checkpoint.whole import load_model
from trainer.config import ModelConfig
from trainer.model.generate import generate

from config_helpers import ROOT

TOLERANCE = 1e-6  # logits, relative 2-norm
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
        "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 1.0}
MODELS = {  # name -> DeepseekV3Config arguments beyond the shared ones
    # 8 experts of 32 in 2 groups, each token's 2 in its best group, YaRN over 64 positions
    "yarn_q_lora_groups": dict(q_lora_rank=24, n_shared_experts=1, n_group=2, topk_group=1,
                               rope_parameters=YARN, max_position_embeddings=2560),
    # Moonlight's shape: q projected directly, plain rope, 2 shared experts, one group
    "plain_rope_no_q_lora": dict(q_lora_rank=None, n_shared_experts=2, n_group=1, topk_group=1,
                                 rope_parameters={"rope_type": "default", "rope_theta": 5e4}),
    # rotary rows as halves already: nothing to reorder on import
    "not_interleaved": dict(q_lora_rank=24, n_shared_experts=1, n_group=2, topk_group=1,
                            rope_parameters=YARN, max_position_embeddings=2560,
                            rope_interleave=False),
}


def hf_model(name: str, folder: Path) -> transformers.DeepseekV3ForCausalLM:
    """transformers' random tiny DeepSeek-V3, its norms and expert bias drawn too (theirs start
    at one and zero; ours must be read, not assumed), saved with save_pretrained."""
    config = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, routed_scaling_factor=2.5, **MODELS[name])
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for key, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in key:
                tensor.uniform_(0.5, 1.5)
            elif "e_score_correction_bias" in key:
                tensor.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    return model


def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 512), generator=torch.Generator().manual_seed(1))


def logits_error(ours, want: torch.Tensor) -> float:
    with torch.no_grad():
        return relative(ours(tokens())[..., :256], want)


def misses(label: str, ours, want: torch.Tensor) -> None:
    """A wrong mapping fails the tolerance by more than two orders of magnitude."""
    off = logits_error(ours, want)
    print(f"{label}: {off:.2e}")
    assert off > 100 * TOLERANCE


def interleaved(rows: torch.Tensor, first: int, width: int, r: int) -> torch.Tensor:
    """`rows` with each [first + k*width, + r) block of halves laid out as interleaved pairs."""
    out = rows.clone()
    for start in range(first, rows.shape[0], width):
        block = rows[start:start + r]
        out[start:start + r] = torch.stack((block[:r // 2], block[r // 2:]), 1).flatten(0, 1)
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_import_matches_transformers_and_export_is_bit_exact(name, tmp_path):
    theirs = hf_model(name, tmp_path / "hf")
    assert theirs.config.num_mtp_layers == 1  # transformers' default, and no such weights
    cli("-m", "trainer.hf", "import", str(tmp_path / "hf"), str(tmp_path / "ours"))
    model = ModelConfig(**yaml.safe_load((tmp_path / "ours" / "model.yaml").read_text()))
    assert model.multi_latent_attention and model.moe_layer_freq == [0, 1, 1]
    with torch.no_grad():
        want = theirs(tokens()).logits
    ours = load_model(tmp_path / "ours", model).eval()
    error = logits_error(ours, want)
    print(f"\n{name}: logits relative difference to transformers {error:.2e}")
    assert error <= TOLERANCE

    if model.rope_type == "yarn":
        misses(f"{name}, YaRN factor 20 instead of 40",
               load_model(tmp_path / "ours", replace(model, rotary_scaling_factor=20.0)), want)
    wrong = load_model(tmp_path / "ours", model).eval()
    with torch.no_grad():  # each head's [key | value] rows of the latent's up-projection swapped
        kv_up = wrong.layers["1"].attn.kv_up.weight
        kv_up.copy_(kv_up.view(4, 2, 16, 32).flip(1).reshape(kv_up.shape))
    misses(f"{name}, layer 1's kv_up key and value halves swapped", wrong, want)
    wrong = load_model(tmp_path / "ours", model).eval()
    with torch.no_grad():
        wrong.layers["2"].mlp.router.expert_bias.zero_()
    misses(f"{name}, layer 2's expert bias left at zero", wrong, want)
    if name != "not_interleaved":  # the rotary rows left as transformers lays them out
        wrong, r = load_model(tmp_path / "ours", model).eval(), model.qk_pos_emb_head_dim
        with torch.no_grad():
            for layer in wrong.layers.values():
                attn = layer.attn
                q = attn.q_up.weight if model.q_lora_rank else attn.q.weight
                q.copy_(interleaved(q, model.qk_head_dim, model.qk_head_dim + r, r))
                attn.kv_down.weight.copy_(interleaved(attn.kv_down.weight, model.kv_lora_rank,
                                                      model.kv_lora_rank + r, r))
        misses(f"{name}, the rotary rows still interleaved", wrong, want)

    cli("-m", "trainer.hf", "export", str(tmp_path / "ours"), str(tmp_path / "back"))
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    before, after = (load_file(tmp_path / f / "model.safetensors") for f in ("hf", "back"))
    assert set(after) == set(before)
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert back.config.num_mtp_layers == 0 and config["num_nextn_predict_layers"] == 0
    source = theirs.config.to_dict()
    for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                "n_shared_experts", "routed_scaling_factor", "n_group", "topk_group",
                "first_k_dense_replace", "norm_topk_prob", "intermediate_size",
                "rms_norm_eps", "tie_word_embeddings", "rope_parameters"):
        assert back.config.to_dict()[key] == source[key], key
    with torch.no_grad():
        again = back(tokens()).logits
    if name == "not_interleaved":  # exported interleaved, transformers' usual layout
        assert back.config.rope_interleave and relative(again, want) <= TOLERANCE
    else:
        assert all(torch.equal(after[k], before[k]) for k in before)
        assert torch.equal(again, want)


def test_greedy_tokens_are_transformers_generate(tmp_path):
    theirs = hf_model("yarn_q_lora_groups", tmp_path / "hf")
    model = import_hf(tmp_path / "hf", tmp_path / "imported")
    got = generate(load_model(tmp_path / "imported", model), PROMPT, 24)
    theirs.generation_config.eos_token_id = None  # 24 tokens, as ours without a stop token
    want = theirs.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False,
                           pad_token_id=0)[0, len(PROMPT):].tolist()
    assert got == want


def test_multi_token_prediction_weights_are_refused_in_one_line(tmp_path):
    """Published checkpoints carry them as layer num_hidden_layers (DeepSeek-V3's 61); we build
    none, and an import would drop them silently (transformers does)."""
    hf_model("yarn_q_lora_groups", tmp_path / "hf")
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    mtp = {"model.layers.3.eh_proj.weight": torch.zeros(64, 128),
           "model.layers.3.enorm.weight": torch.ones(64)}
    save_file({**weights, **mtp}, tmp_path / "hf" / "model.safetensors",
              metadata={"format": "pt"})
    refused("-m", "trainer.hf", "import", str(tmp_path / "hf"), str(tmp_path / "out"),
            names=("2 tensors of multi-token prediction", "'model.layers.3.eh_proj.weight'",
                   "import a copy of the folder without them"))
    assert not (tmp_path / "out").exists()


# What we cannot build or would compute otherwise, each one line naming the field. The config
# is a transformers save_pretrained one (CONFIG below), changed.
REFUSED = [
    ({"architectures": ["DeepseekV32ForCausalLM"]}, "DeepSeek-V3.2's sparse attention"),
    ({"index_topk": 2048}, "index_topk=2048 is not supported"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"norm_topk_prob": False}, "norm_topk_prob=False"),
    ({"n_group": 4, "topk_group": 1, "num_experts_per_tok": 4}, "by its 2 best scores"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"n_shared_experts": 0}, "n_shared_experts=0"),
    ({"rope_parameters": {**YARN, "truncate": False}}, "truncate=false"),
    ({"rope_parameters": {**YARN, "attention_factor": 1.2}}, "attention_factor"),
    ({"rope_parameters": {**YARN, "mscale": 0.0}}, "mscale_all_dim without mscale"),
    ({"rope_parameters": {**YARN, "rope_type": "llama3"}}, "only YaRN"),
    ({"qk_rope_head_dim": None, "q_lora_rank": None} | {"kv_lora_rank": None},
     "architectures=['DeepseekV3ForCausalLM'] is not supported"),
]


@pytest.fixture(scope="module")
def saved_config(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("config")
    hf_model("yarn_q_lora_groups", folder)
    return json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("change,message", REFUSED, ids=[m[:30] for _, m in REFUSED])
def test_what_we_cannot_build_is_one_line(saved_config, change, message):
    source = Path("/models/x/config.json")
    model_config(dict(saved_config), source)  # the config itself imports
    config = {k: v for k, v in {**saved_config, **change}.items() if v is not None}
    with pytest.raises(ValueError) as refusal:
        model_config(config, source)
    text = str(refusal.value)
    assert message in text and "Fix:" in text and "\n" not in text, text


def test_the_cli_refuses_a_deepseek_v32_folder_in_one_line(tmp_path):
    hf_model("yarn_q_lora_groups", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(
        {**config, "architectures": ["DeepseekV32ForCausalLM"], "index_topk": 2048}))
    refused("-m", "trainer.hf", "import", str(tmp_path / "hf"), str(tmp_path / "out"),
            names=("DeepseekV32ForCausalLM", "sparse attention", "does not build"))


def preset(name: str) -> ModelConfig:
    return ModelConfig(**yaml.safe_load((ROOT / "conf" / "model" / f"{name}.yaml").read_text()))


@pytest.mark.parametrize("change,key", [
    (dict(moe_router_score_function="softmax", moe_router_enable_expert_bias=False),
     "moe_router_score_function='softmax'"),
    (dict(moe_router_enable_expert_bias=False), "moe_router_enable_expert_bias=False"),
    (dict(moe_shared_expert_intermediate_size=48), "moe_shared_expert_intermediate_size=48"),
    (dict(moe_layer_freq=[1, 0, 1]), r"moe_layer_freq=\[1, 0, 1\]"),
    (dict(moe_router_topk=4, moe_router_num_groups=2), "moe_router_group_topk=1"),
    (dict(mscale=0.5, mscale_all_dim=0.0), "mscale=0.5"),
    (dict(moe_router_group_topk=2), "moe_router_group_topk=2"),
])
def test_an_export_deepseek_v3_cannot_hold_is_one_line(change, key):
    # Each group ranked by its best 2 scores, as transformers ranks them (tiny_deepseek's 4
    # groups, best 2 of them, top 2 rank by 1: refused as the last case here)
    tiny = replace(preset("tiny_deepseek"), moe_router_group_topk=1)
    assert architecture_of(tiny) == "DeepseekV3ForCausalLM"
    with pytest.raises(ValueError, match=f"^model.{key}: DeepseekV3ForCausalLM .*Fix:"):
        architecture_of(replace(tiny, **change))


# The published config.json of each preset's model (Hugging Face deepseek-ai/DeepSeek-V3,
# moonshotai/Kimi-K2-Instruct, moonshotai/Moonlight-16B-A3B; quantization and auto_map left
# out): importing it gives the preset.
PUBLISHED = {
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280, "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
        "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
        "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
        "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
        "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
        "scoring_func": "sigmoid", "aux_loss_alpha": 0.001, "seq_aux": True, "hidden_act": "silu",
        "max_position_embeddings": 163840, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "rope_theta": 10000, "attention_bias": False,
        "num_nextn_predict_layers": 1, "ep_size": 1,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                         "type": "yarn"}},
    "moonlight_16b_a3b": {
        "architectures": ["DeepseekV3ForCausalLM"], "aux_loss_alpha": 0.001, "ep_size": 1,
        "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 11264, "kv_lora_rank": 512,
        "max_position_embeddings": 8192, "moe_intermediate_size": 1408, "moe_layer_freq": 1,
        "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": True,
        "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
        "num_key_value_heads": 16, "num_nextn_predict_layers": 0, "q_lora_rank": None,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05,
        "rope_scaling": None, "rope_theta": 50000.0, "routed_scaling_factor": 2.446,
        "scoring_func": "sigmoid", "seq_aux": True, "tie_word_embeddings": False,
        "topk_group": 1, "topk_method": "noaux_tc", "v_head_dim": 128, "vocab_size": 163840},
}
PUBLISHED["kimi_k2"] = {
    **PUBLISHED["deepseek_v3"], "vocab_size": 163840, "num_attention_heads": 64,
    "num_key_value_heads": 64, "n_routed_experts": 384, "n_group": 1, "topk_group": 1,
    "first_k_dense_replace": 1, "routed_scaling_factor": 2.827, "rope_theta": 50000.0,
    "max_position_embeddings": 131072, "num_nextn_predict_layers": 0,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"}}


@pytest.mark.parametrize("name", [
    "deepseek_v3", "moonlight_16b_a3b", "kimi_k2"])
def test_each_preset_is_what_importing_its_published_config_gives(name):
    imported = model_config(dict(PUBLISHED[name]), Path(f"/models/{name}/config.json"))
    assert imported == preset(name)
