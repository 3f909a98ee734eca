"""Model families (trainer/parts/families.py): model.name selects a description over the parts.
Each preset is its family's, a checkpoint recorded as llama with the keys of a stricter family
resumes under that family's preset, and each family's rules refuse the keys it cannot hold."""
from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from trainer.checkpoint.match import changes
from trainer.checks import check_model
from trainer.config import ModelConfig
from trainer.parts.families import FAMILIES, hf_family

CONF = Path(__file__).resolve().parents[2] / "conf" / "model"


def preset(name: str) -> ModelConfig:
    return ModelConfig(**OmegaConf.to_container(OmegaConf.load(CONF / f"{name}.yaml")))


@pytest.mark.parametrize("name, family", [("qwen3_8b", "qwen3"), ("mixtral_8x7b", "mixtral"),
                                          ("qwen3_30b_a3b", "qwen3_moe"), ("llama3_1_8b", "llama"),
                                          ("tiny_moe", "llama"), ("tiny_deepseek", "deepseek_v3")])
def test_each_preset_is_its_familys_and_an_older_llama_record_resumes_under_it(name, family):
    model = preset(name)
    check_model(model)
    assert model.name == family
    # Checkpoints written before the families recorded model.name=llama for all of these.
    assert changes(asdict(replace(model, name="llama")), model) == []


@pytest.mark.parametrize("name", ["tiny_qwen3_next", "qwen3_next_80b_a3b"])
def test_the_hybrids_presets_are_qwen3_next(name):
    """Families added after model.name was recorded have no llama records to resume."""
    model = preset(name)
    check_model(model)
    assert model.name == "qwen3_next" and model.is_linear_block(0) and \
        not model.is_linear_block(3)


def test_another_familys_record_is_named_with_the_key_that_differs():
    qwen3 = preset("qwen3_8b")
    dense_llama = replace(qwen3, name="llama", qk_layernorm=False)
    listed = {key for key, _, _ in changes(asdict(dense_llama), qwen3)}
    assert listed == {"name", "qk_layernorm"}


def test_llama_exports_as_the_family_its_keys_make():
    base = preset("tiny")
    assert hf_family(base).name == "llama"
    assert hf_family(replace(base, qk_layernorm=True)).name == "qwen3"
    assert hf_family(replace(base, num_moe_experts=4)).name == "mixtral"
    assert hf_family(replace(base, num_moe_experts=4, qk_layernorm=True)).name == "qwen3_moe"
    assert hf_family(replace(base, multi_latent_attention=True)).name == "deepseek_v3"
    assert {f.name for f in FAMILIES.values()} == {"llama", "qwen3", "mixtral", "qwen3_moe",
                                                   "deepseek_v3", "gpt_oss", "gemma3", "qwen3_next",
                                                   "qwen3_5"}


def test_every_family_has_its_hugging_face_mapping():
    """What a new family adds: its description and its config.json mapping, one for one."""
    from trainer.checkpoint.hf_families import MAPPINGS

    assert set(MAPPINGS) == set(FAMILIES)


@pytest.mark.parametrize("name, changes_, needs", [
    ("qwen3", {}, "model.qk_layernorm=true"),
    ("qwen3", {"qk_layernorm": True, "num_moe_experts": 4}, "model.num_moe_experts=null"),
    ("mixtral", {}, "model.num_moe_experts set"),
    ("mixtral", {"num_moe_experts": 4, "qk_layernorm": True}, "model.qk_layernorm=false"),
    ("qwen3_moe", {"qk_layernorm": True}, "model.num_moe_experts set"),
    ("qwen3_next", {}, "model.experimental_attention_variant='gated_delta_net'")])
def test_a_family_refuses_the_keys_it_cannot_hold_in_one_line(name, changes_, needs):
    with pytest.raises(ValueError, match=f"model.name={name} needs {needs}") as refused:
        check_model(replace(preset("tiny"), name=name, **changes_))
    assert "Fix: set" in str(refused.value) and "\n" not in str(refused.value)
