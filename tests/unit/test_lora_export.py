"""The adapter-only export refuses what PEFT would load as something else. On a mixture of
experts PEFT 0.21 with transformers 5 (fused experts) turns gate_proj, up_proj and down_proj in
an adapter's target_modules into its routed experts' fused weights (target_parameters), as our
per-expert adapters are (tests/integration/test_lora_hf.py loads them there), and adapts
nothing else by those names: ours on a dense block's MLP would load as nothing. The first test
holds PEFT to that (if PEFT changes, the refusal can go); the second, our refusals to it."""
from __future__ import annotations

import json
import warnings

import pytest
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from test_flops import preset

from trainer.checkpoint.hf_lora import check_peft_reads
from trainer.config import ModelConfig, PeftConfig


def test_peft_reads_mlp_targets_on_a_mixture_of_experts_as_its_experts(tmp_path):
    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
        num_experts_per_tok=2, head_dim=8)
    model = transformers.Qwen3MoeForCausalLM(config)
    # an adapter on q_proj as PEFT saves it, its config then naming the MLP's projections too
    get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"])
                   ).save_pretrained(tmp_path)
    written = json.loads((tmp_path / "adapter_config.json").read_text())
    written["target_modules"] = ["q_proj", "gate_proj", "up_proj", "down_proj"]
    (tmp_path / "adapter_config.json").write_text(json.dumps(written))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = PeftModel.from_pretrained(transformers.Qwen3MoeForCausalLM(config),
                                           str(tmp_path))
    config = loaded.peft_config["default"]
    assert set(config.target_modules) == {"q_proj"}
    assert set(config.target_parameters) == {"gate_up_proj", "down_proj"}


def test_an_adapter_peft_would_misread_is_not_exported():
    moe = preset("tiny_moe")  # every block a mixture of experts (Mixtral's names)
    assert moe.num_moe_experts is not None and all(moe.is_moe_block(i)
                                                   for i in range(moe.num_layers))
    mlp = PeftConfig("lora", 4, 8.0, 0.0, ["q_proj", "gate_proj", "up_proj", "down_proj"])
    check_peft_reads(moe, mlp)  # the experts' adapters: PEFT's per-expert form
    with pytest.raises(ValueError, match=r"gate_proj without the other.*Fix:"):
        check_peft_reads(moe, PeftConfig("lora", 4, 8.0, 0.0, ["q_proj", "gate_proj"]))
    with pytest.raises(ValueError, match=r"block 0 is dense: PEFT reads.*Fix:"):
        check_peft_reads(preset("tiny_deepseek"), mlp)
    with pytest.raises(ValueError, match=r"gpt_oss model, which PEFT has no per-expert form.*Fix:"):
        check_peft_reads(preset("tiny_gpt_oss"), mlp)
    check_peft_reads(preset("tiny_gpt_oss"), PeftConfig("lora", 4, 8.0, 0.0, ["q_proj", "o_proj"]))
    dense: ModelConfig = preset("tiny")
    check_peft_reads(dense, mlp)
