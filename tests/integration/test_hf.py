"""Hugging Face interop, checked against transformers itself (offline): random tiny
LlamaForCausalLM models (grouped-query attention with a vocabulary that needs padding and
Llama 3's rope scaling, and multi-head attention with tied embeddings saved as a sharded set)
imported and compared
logit for logit; import then export bit-exact; a model trained here under weight sharding,
exported, gives transformers the same loss; and a model imported back fine-tunes under TP 2
from where the training left it.

Tolerance of the logits: the two implementations run the same operations in the same order
(fp32 RMSNorm, the same rotary formula, the same fused SDPA kernel), so they agree to fp32
rounding; we assert 1e-6 relative (2-norm) and print what was measured (1.1e-7 on CPU).
The margin, measured on the rope-scaled model over 1,024 positions: a wrong scaling factor
(4 instead of 8) moves the logits 1.2e-4 and no scaling 7.9e-4, so each fails by two orders of
magnitude; the test checks the wrong factor fails too.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
import transformers  # the test extra pins it
import yaml
from safetensors.torch import load_file

from trainer.checkpoint.hf import read_model_config
from trainer.config import ModelConfig
from trainer.model.transformer import Transformer

from config_helpers import ROOT

# Llama 3's rope scaling. With head_dim 8 the wavelengths are 6, 63, 628 and 6,283 tokens, so
# the last frequency is in the interpolated band (2,048-8,192): a missing or wrong scaling
# changes the logits.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
MODELS = {  # name -> (config arguments, save_pretrained max_shard_size, architecture)
    "gqa_padded_vocab_rope_scaling": (dict(
        vocab_size=250, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False,
        rope_parameters=LLAMA3_ROPE, max_position_embeddings=65536), None, "Llama"),
    "mha_tied_sharded": (dict(vocab_size=256, num_attention_heads=4, num_key_value_heads=4,
                              tie_word_embeddings=True, rope_parameters=DEFAULT_ROPE), "60KB",
                         "Llama"),
    # Qwen3: q_norm and k_norm over each head, and heads twice as wide as hidden / heads.
    "qwen3_wide_heads": (dict(vocab_size=256, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=32, tie_word_embeddings=True,
                              rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
                         None, "Qwen3"),
    # Mixtral: 4 experts of 176 in every block, top 2, normalised.
    "mixtral": (dict(vocab_size=256, num_attention_heads=4, num_key_value_heads=2,
                     num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
                     rope_parameters=DEFAULT_ROPE), None, "Mixtral"),
    # Qwen3-MoE: experts of 48, top 2 not renormalised, the second block dense.
    "qwen3_moe": (dict(vocab_size=256, num_attention_heads=4, num_key_value_heads=2,
                       num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                       norm_topk_prob=False, mlp_only_layers=[1], tie_word_embeddings=False,
                       rope_parameters=DEFAULT_ROPE), "80KB", "Qwen3Moe"),
}
TOLERANCE = 1e-6  # logits, relative 2-norm
LOSS_TOLERANCE = 1e-5  # a trained model's loss, relative (measured equal to 6 digits)
RUN = ("train.micro_batch_size=4", "train.seq_length=32", "train.train_samples=160",
       "train.eval_interval=null", "logger.log_interval=1", "schedule.lr_warmup_samples=8",
       "schedule.lr_warmup_fraction=null", "schedule.lr=3e-3")
GQA_TIED = ("model.num_heads=8", "model.num_query_groups=2", "model.tie_word_embeddings=true")


def cli(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=timeout)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def hf_class(name: str) -> type:
    return getattr(transformers, f"{MODELS[name][2]}ForCausalLM")


def hf_model(name: str, folder: Path):
    kwargs, shard, family = MODELS[name]
    config = getattr(transformers, f"{family}Config")(
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, rms_norm_eps=1e-5,
        attention_bias=False, **{"head_dim": 64 // kwargs["num_attention_heads"], **kwargs})
    torch.manual_seed(0)
    model = hf_class(name)(config).eval()
    if family.startswith("Qwen3"):  # their norms start at one; ours must be read, not assumed
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return model


def our_model(checkpoint: Path, model: ModelConfig) -> Transformer:
    """Our single-device model with the checkpoint's weights."""
    ours = Transformer(model)
    with warnings.catch_warnings():  # that DCP runs in one process, as intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({f"model.{n}": p.data for n, p in ours.named_parameters()},
                 checkpoint_id=checkpoint, no_dist=True)
    return ours.eval()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("name", list(MODELS))
def test_import_matches_transformers_and_export_is_bit_exact(name, tmp_path):
    theirs = hf_model(name, tmp_path / "hf")
    if MODELS[name][1]:
        assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    imported = cli("-m", "trainer.hf", "import", str(tmp_path / "hf"), str(tmp_path / "ours"))
    model = ModelConfig(**yaml.safe_load((tmp_path / "ours" / "model.yaml").read_text()))
    assert model.vocab_size == theirs.config.vocab_size
    assert model.query_groups == theirs.config.num_key_value_heads
    assert model.use_rope_scaling == (theirs.config.rope_parameters["rope_type"] == "llama3")
    ours = our_model(tmp_path / "ours", model)
    # It said what it copies (every fp32 parameter, padded vocabulary included) and how far.
    weights = sum(p.numel() for p in ours.parameters()) * 4 / 2**20
    assert f"(fp32): {weights:.1f} MiB of weights" in imported.stdout, imported.stdout
    assert " 100% (" in imported.stdout
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.vocab_size, (2, 1024), generator=gen)  # positions to 1023
    with torch.no_grad():
        got, want = ours(tokens), theirs(tokens).logits
    assert got.shape[-1] == model.padded_vocab_size == 256
    error = relative(got[..., :model.vocab_size], want)
    print(f"\n{name}: logits relative difference to transformers {error:.2e}")
    assert error <= TOLERANCE
    if model.use_rope_scaling:  # the tolerance tells a wrong scaling factor apart
        wrong = our_model(tmp_path / "ours", replace(model, rope_scaling_factor=4.0))
        with torch.no_grad():
            off = relative(wrong(tokens)[..., :model.vocab_size], want)
        print(f"{name}: with rope factor 4 instead of 8: {off:.2e}")
        assert off > 100 * TOLERANCE
    if model.num_moe_experts:  # and a router that sends tokens to the wrong experts
        wrong = our_model(tmp_path / "ours", model)
        with torch.no_grad():
            router = wrong.layers["0"].mlp.router.weight
            router.copy_(router[[1, 0, 2, 3]])
            off = relative(wrong(tokens)[..., :model.vocab_size], want)
        print(f"{name}: with layer 0's first two experts' router rows swapped: {off:.2e}")
        assert off > 100 * TOLERANCE
    if model.qk_layernorm:  # and a qk norm's weights read from the wrong head's place
        wrong = our_model(tmp_path / "ours", model)
        with torch.no_grad():
            wrong.layers["0"].attn.q_norm.weight.copy_(wrong.layers["0"].attn.q_norm.weight.flip(0))
            off = relative(wrong(tokens)[..., :model.vocab_size], want)
        print(f"{name}: with layer 0's q_norm weights reversed: {off:.2e}")
        assert off > 100 * TOLERANCE

    exported = cli("-m", "trainer.hf", "export", str(tmp_path / "ours"), str(tmp_path / "back"),
                   "--model", str(tmp_path / "ours" / "model.yaml"))
    assert f"(float32): {weights:.1f} MiB of weights" in exported.stdout, exported.stdout
    assert " 100% (" in exported.stdout
    before = {k: v for file in (tmp_path / "hf").glob("*.safetensors")
              for k, v in load_file(file).items()}
    after = load_file(tmp_path / "back" / "model.safetensors")
    assert set(after) == set(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    back = hf_class(name).from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, want)


def trained_and_exported(tmp_path: Path, *overrides: str) -> tuple[Path, ModelConfig, dict]:
    """A run of `overrides` trained here and exported to tmp_path/hf: its last checkpoint, the
    model its meta.json records and the exported config.json."""
    cli("launch.py", *RUN, *overrides, f"hydra.run.dir={tmp_path / 'run'}")
    ckpt = tmp_path / "run" / "checkpoints"
    cli("-m", "trainer.hf", "export", str(ckpt), str(tmp_path / "hf"), "--dtype", "float32")
    (last,) = sorted(ckpt.glob("step_*"))[-1:]
    return last, read_model_config(last, None), json.loads(
        (tmp_path / "hf" / "config.json").read_text())


def assert_the_same_trained_loss(theirs, last: Path, model: ModelConfig, label: str) -> None:
    """transformers' loss on README bytes equals ours from the checkpoint, and it learned."""
    ours = our_model(last, model)
    text = (ROOT / "README.md").read_bytes()[:8 * 65]
    tokens = torch.tensor(list(text)).view(8, 65)
    with torch.no_grad():
        want = theirs.eval()(tokens[:, :-1], labels=tokens[:, :-1]).loss  # HF shifts labels
        got = F.cross_entropy(ours(tokens[:, :-1])[:, :-1].flatten(0, 1),
                              tokens[:, 1:-1].flatten())
    print(f"\n{label}: loss {got.item():.6f} here, {want.item():.6f} in transformers")
    assert abs(got.item() - want.item()) <= LOSS_TOLERANCE * want.item()
    assert want.item() < math.log(256) - 1  # it learned: below a uniform guess


def test_a_trained_model_exported_gives_transformers_the_same_loss_and_fine_tunes_back(tmp_path):
    # Train here, 2 ranks with weight shards 2, GQA with tied embeddings.
    last, model, config = trained_and_exported(
        tmp_path, *GQA_TIED, "cluster.procs_per_node=2",
        "parallel.tensor_parallel_num_weight_shards=2")
    assert model.num_query_groups == 2 and model.tie_word_embeddings
    assert config["num_key_value_heads"] == 2 and config["tie_word_embeddings"] is True
    assert_the_same_trained_loss(transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf"),
                                 last, model, "trained and exported")

    # Back in, and fine-tuned under TP 2 with SP: the first step's loss is the trained one.
    cli("-m", "trainer.hf", "import", str(tmp_path / "hf"), str(tmp_path / "imported"))
    cli("launch.py", "--config-dir", str(tmp_path / "imported"), "model=../model", *RUN,
        "train.train_samples=16", f"checkpoint.load={tmp_path / 'imported'}",
        "checkpoint.finetune=true", "cluster.procs_per_node=2",
        "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
        f"hydra.run.dir={tmp_path / 'finetune'}")
    fresh = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
             .splitlines()]
    tuned = [json.loads(line) for line in (tmp_path / "finetune" / "metrics.jsonl").read_text()
             .splitlines()]
    assert tuned[0]["step"] == 1
    assert tuned[0]["loss"] < fresh[0]["loss"] - 1  # it starts where training left it


def test_a_mixture_of_experts_trained_under_ep_exported_gives_transformers_the_same_loss(tmp_path):
    """model=tiny_moe on 4 ranks, its 8 experts over EP 2 (2 copies over expert DP): the
    checkpoint's experts come together as Mixtral's per-expert projections."""
    last, model, config = trained_and_exported(
        tmp_path, "model=tiny_moe", "cluster.procs_per_node=4",
        "parallel.expert_model_parallel_size=2")
    assert config["architectures"] == ["MixtralForCausalLM"] and config["num_local_experts"] == 8
    assert_the_same_trained_loss(
        transformers.MixtralForCausalLM.from_pretrained(tmp_path / "hf"), last, model,
        "trained under EP 2 and exported")


@pytest.mark.parametrize("change,message", [
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"architectures": ["MistralForCausalLM"]}, "architectures=['MistralForCausalLM']"),
    ({"architectures": ["DeepseekV3ForCausalLM"]}, "architectures=['DeepseekV3ForCausalLM']"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     "only Llama 3's"),
    ({"rope_parameters": {**LLAMA3_ROPE, "high_freq_factor": 2.0}}, "only Llama 3's"),
])
def test_an_unsupported_model_is_one_line(change, message, tmp_path):
    hf_model("mha_tied_sharded", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **change}))
    out = subprocess.run([sys.executable, "-m", "trainer.hf", "import", str(tmp_path / "hf"),
                          str(tmp_path / "out")], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "out" / "meta.json").exists()


def test_an_import_never_overwrites(tmp_path):
    hf_model("mha_tied_sharded", tmp_path / "hf")
    cli("-m", "trainer.hf", "import", str(tmp_path / "hf"), str(tmp_path / "out"))
    again = subprocess.run([sys.executable, "-m", "trainer.hf", "import", str(tmp_path / "hf"),
                            str(tmp_path / "out")], capture_output=True, text=True, cwd=ROOT)
    assert again.returncode == 2 and "already exists and is not empty" in again.stderr


def test_an_imported_checkpoint_without_finetune_or_of_another_model_is_refused(tmp_path):
    hf_model("mha_tied_sharded", tmp_path / "hf")
    cli("-m", "trainer.hf", "import", str(tmp_path / "hf"), str(tmp_path / "ours"))
    cases = {("model=tiny",): "holds weights only", ("checkpoint.finetune=true",
                                                     "model.num_layers=3"): "layers.2",
             ("checkpoint.finetune=true", "model.hidden_size=128"): "has shape (256, 64)"}
    for overrides, message in cases.items():
        out = subprocess.run([sys.executable, "launch.py", f"checkpoint.load={tmp_path / 'ours'}",
                              "model.tie_word_embeddings=true", *overrides,
                              f"hydra.run.dir={tmp_path / 'run'}"],
                             capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert out.returncode != 0 and message in out.stderr, (overrides, out.stderr[-2000:])
        assert "Traceback" not in out.stderr and "step 1 " not in out.stdout


def refused(*args: str, names: tuple[str, ...] = ()) -> str:
    """Runs the CLI and checks the refusal: a non-zero exit, no traceback, exactly one line on
    stderr with a Fix that names each of `names`. Returns the line."""
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=180)
    lines = out.stderr.splitlines()
    assert out.returncode != 0 and "Traceback" not in out.stdout + out.stderr, out.stderr
    assert len(lines) == 1 and "Fix:" in lines[0], out.stderr
    assert all(str(name) in lines[0] for name in names), (names, lines[0])
    return lines[0]


def test_a_broken_hf_folder_is_one_line_and_writes_nothing(tmp_path):
    from safetensors.torch import save_file

    good = tmp_path / "hf"
    hf_model("gqa_padded_vocab_rope_scaling", good)  # a single model.safetensors
    weights = load_file(good / "model.safetensors")
    config = json.loads((good / "config.json").read_text())

    def folder(name: str, tensors: dict | None = None, cfg: dict | str | None = None) -> Path:
        path = tmp_path / name
        path.mkdir()
        save_file(weights if tensors is None else tensors, path / "model.safetensors",
                  metadata={"format": "pt"})
        text = cfg if isinstance(cfg, str) else json.dumps(cfg or config)
        (path / "config.json").write_text(text)
        return path

    truncated = folder("truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[:len(data) // 2])
    down = "model.layers.0.mlp.down_proj.weight"
    cases = {
        truncated: ("model.safetensors is truncated",),
        folder("missing", {k: v for k, v in weights.items() if k != down}): (down,),
        folder("deeper", cfg={**config, "num_hidden_layers": 3}): ("model.layers.2.",
                                                                   "3 layers"),
        folder("garbage", cfg="{not json"): ("config.json is not readable JSON",),
    }
    for hf_dir, names in cases.items():
        refused("-m", "trainer.hf", "import", str(hf_dir), str(tmp_path / "out"),
                names=(hf_dir, *names))
        assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.tmp-*"))


def test_an_error_inside_dcp_save_is_raised_as_itself(tmp_path):
    """DCP wraps what the lazy planner raises in a CheckpointException whose text is the whole
    traceback; the import unwraps it to the one-line original."""
    from trainer.checkpoint.hf import _write_import
    from trainer.parts.assembly import parameter_shapes

    model = ModelConfig(**yaml.safe_load((ROOT / "conf" / "model" / "tiny.yaml").read_text()))

    def value(name: str) -> torch.Tensor:
        raise ValueError(f"{name} is broken. Fix: nothing")

    with pytest.raises(ValueError, match=r"^embed.weight is broken. Fix: nothing$"):
        _write_import(tmp_path, parameter_shapes(model), value, tmp_path, model)


# Every config.json field the import reads, with a value of the wrong type. A Qwen3-MoE config
# reads most of them; a Mixtral config its own expert fields; Llama 3's rope scaling its factors.
QWEN3_MOE_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "rope_theta": 1e6, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
    "initializer_range": 0.02, "tie_word_embeddings": False, "attention_bias": False,
    "use_sliding_window": False, "num_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 48, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [1], "router_aux_loss_coef": 0.001}
MIXTRAL_CONFIG = {**{k: v for k, v in QWEN3_MOE_CONFIG.items() if k not in (
    "num_experts", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
    "mlp_only_layers", "use_sliding_window")}, "architectures": ["MixtralForCausalLM"],
    "num_local_experts": 4, "sliding_window": None, "router_jitter_noise": 0.0}
LLAMA3_CONFIG = {**{k: v for k, v in QWEN3_MOE_CONFIG.items() if k not in (
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
    "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef", "rope_parameters")},
    "architectures": ["LlamaForCausalLM"], "rope_scaling": dict(LLAMA3_ROPE)}
WRONG_TYPES = [  # (config, field, value): the message names field=value as JSON writes it
    *[(QWEN3_MOE_CONFIG, key, value) for key, value in (
        ("num_experts", "8"), ("num_experts", 8.0), ("num_experts_per_tok", "2"),
        ("moe_intermediate_size", [48]), ("norm_topk_prob", "true"),
        ("decoder_sparse_step", True), ("mlp_only_layers", [1, "2"]),
        ("mlp_only_layers", 1), ("router_aux_loss_coef", "0.001"), ("architectures", "Qwen3"),
        ("vocab_size", "256"), ("hidden_size", 64.0), ("num_hidden_layers", True),
        ("num_attention_heads", "4"), ("intermediate_size", [176]),
        ("num_key_value_heads", "2"), ("head_dim", 32.5), ("hidden_act", 1),
        ("rms_norm_eps", "1e-6"), ("rope_theta", "1e6"), ("initializer_range", False),
        ("tie_word_embeddings", "false"), ("attention_bias", 0), ("mlp_bias", "no"),
        ("use_sliding_window", "false"), ("rope_parameters", "default"),
        ("rope_scaling", ["llama3"]))],
    *[(MIXTRAL_CONFIG, key, value) for key, value in (
        ("num_local_experts", "4"), ("sliding_window", "none"),
        ("router_jitter_noise", "0"))],
]


@pytest.mark.parametrize("config,field,value", WRONG_TYPES,
                         ids=[f"{c['architectures'][0][:6]}-{f}={v!r}" for c, f, v in WRONG_TYPES])
def test_a_config_field_of_the_wrong_type_is_one_line_naming_the_file_field_and_value(
        config, field, value):
    from trainer.checkpoint.hf_families import model_config

    source = Path("/models/x/config.json")
    model_config(dict(config), source)  # the config itself is importable
    with pytest.raises(ValueError) as refusal:
        model_config({**config, field: value}, source)
    message = str(refusal.value)
    assert message.startswith(f"{source}: {field}={json.dumps(value)} is not ") and (
        "Fix: write it as " in message and "\n" not in message), message


@pytest.mark.parametrize("inner,field,wrong", [("rope_parameters", "rope_theta", "1e6"),
                                               ("rope_scaling", "factor", "8"),
                                               ("rope_scaling", "low_freq_factor", [])])
def test_a_rope_field_of_the_wrong_type_is_named_inside_its_mapping(inner, field, wrong):
    from trainer.checkpoint.hf_families import model_config

    source = Path("/models/x/config.json")
    model_config(dict(LLAMA3_CONFIG), source)
    value = {**(DEFAULT_ROPE if inner == "rope_parameters" else LLAMA3_ROPE), field: wrong}
    with pytest.raises(ValueError, match="^" + re.escape(
            f"{source}: {inner}.{field}={json.dumps(wrong)} is not a number. Fix: write it as "
            f"a number")):
        model_config({**LLAMA3_CONFIG, inner: value}, source)


def test_import_of_a_qwen3_moe_config_with_num_experts_a_string_is_one_line(tmp_path):
    """The finding: `num_experts: "8"` was a TypeError traceback from the model check."""
    hf_dir = tmp_path / "qwen3_moe"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({**QWEN3_MOE_CONFIG, "num_experts": "8"}))
    refused("-m", "trainer.hf", "import", str(hf_dir), str(tmp_path / "out"),
            names=(hf_dir / "config.json", 'num_experts="8" is not an integer',
                   "Fix: write it as an integer (8)"))
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> Path:
    """A weights-only checkpoint of a tiny tied-embedding model (not conf/model/tiny.yaml's)."""
    folder = tmp_path_factory.mktemp("imported")
    hf_model("mha_tied_sharded", folder / "hf")
    cli("-m", "trainer.hf", "import", str(folder / "hf"), str(folder / "ckpt"))
    return folder / "ckpt"


def test_a_bad_export_is_one_line_before_anything_is_written(imported, tmp_path):
    out = tmp_path / "hf"
    (tmp_path / "list.yaml").write_text("[1, 2]\n")
    (tmp_path / "lacking.yaml").write_text("name: llama\nhidden_size: 64\n")
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    for file in imported.iterdir():
        (garbage / file.name).write_bytes(file.read_bytes())
    (garbage / "meta.json").write_text("{not json")
    small, tiny = ROOT / "conf" / "model" / "small.yaml", ROOT / "conf" / "model" / "tiny.yaml"
    cases = {
        (str(imported), "--model", str(small)): (small, imported, "'embed.weight'",
                                                 "(256, 64)", "(256, 768)"),
        (str(imported), "--model", str(tiny)): (tiny, imported, "'head.weight'"),
        (str(imported), "--model", str(tmp_path / "list.yaml")): ("list.yaml", "not a mapping"),
        (str(imported), "--model", str(tmp_path / "lacking.yaml")): ("lacking.yaml",
                                                                     "vocab_size"),
        (str(garbage),): (garbage, "meta.json"),
        (str(imported), "--max-shard-gb", "0"): ("--max-shard-gb 0 ",),
        (str(imported), "--max-shard-gb", "-1"): ("--max-shard-gb -1 ",),
        (str(imported), "--max-shard-gb", "nan"): ("--max-shard-gb nan ",),
    }
    for (ckpt, *options), names in cases.items():
        refused("-m", "trainer.hf", "export", ckpt, str(out), *options, names=names)
        assert not out.exists()


def test_an_export_never_overwrites_and_two_at_once_never_mix(imported, tmp_path):
    out = tmp_path / "hf"
    command = [sys.executable, "-m", "trainer.hf", "export", str(imported), str(out)]
    runs = [subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for _ in range(2)]
    results = [(*run.communicate(timeout=180), run.returncode) for run in runs]
    results = [(rc, stdout, stderr) for stdout, stderr, rc in results]
    print("\n" + "".join(err for _, _, err in results))
    assert sorted(rc for rc, _, _ in results) == [0, 2], results
    (_, _, loser), = [r for r in results if r[0] == 2]
    assert len(loser.splitlines()) == 1 and str(out) in loser and "Fix:" in loser, loser
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temporary folder is left
    refused("-m", "trainer.hf", "export", str(imported), str(out),
            names=(out, "already exists"))

    # The race itself: another writer finishes while this one writes; its files are kept.
    from trainer.checkpoint.hf import _new_folder

    late = tmp_path / "late"
    with pytest.raises(ValueError, match=r"late appeared while this was written .* Fix:"):
        with _new_folder(late) as tmp:
            (tmp / "mine.json").write_text("{}")
            late.mkdir()
            (late / "theirs.json").write_text("{}")
    assert [p.name for p in late.iterdir()] == ["theirs.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "late"]


def test_an_empty_or_absent_architectures_is_a_llama(tmp_path):
    """save_pretrained of a bare config writes none; [] is read as the same (it raised an
    IndexError)."""
    from trainer.checkpoint.hf_families import model_config

    source = tmp_path / "config.json"
    llama = model_config(dict(LLAMA3_CONFIG), source)
    assert model_config({**LLAMA3_CONFIG, "architectures": []}, source) == llama
    assert model_config({k: v for k, v in LLAMA3_CONFIG.items() if k != "architectures"},
                        source) == llama
