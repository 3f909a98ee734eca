"""peft=lora against Hugging Face PEFT itself (offline): a random tiny transformers Llama is
imported, fine-tuned here with LoRA under TP 2 + SP (its base loaded from the import, the
adapters starting fresh), and exported twice: the adapter alone in PEFT's format and the model
with the adapters merged. PeftModel.from_pretrained on transformers' base with our adapter gives
the logits of our own model (base + adapters, from the checkpoint) and of our merged export.

Tolerance: 1e-6 relative (2-norm), the fp32 rounding of the same operations in another order
(measured: printed). The adapters moved far enough that leaving them out fails it: the test
checks the base alone misses by more than 1e-3.
"""
from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import transformers
from peft import PeftModel
from test_hf import cli, relative

from trainer.checkpoint.adapters import base_of
from trainer.checkpoint.hf import read_model_config
from trainer.checkpoint.hf_lora import recorded_peft
from trainer.model.lora import add_adapters
from trainer.model.transformer import Transformer
from trainer.parts.lora import is_adapter

from config_helpers import ROOT

TOLERANCE = 1e-6
TARGETS = "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"


def tiny_llama(folder: Path) -> None:
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
        attention_bias=False, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


def ours_with_adapters(ckpt: Path) -> Transformer:
    """Our single-device model with a checkpoint's adapters, and its base's weights (a LoRA
    checkpoint holds only the adapters and names its base; an import holds both)."""
    model, peft, base = read_model_config(ckpt, None), recorded_peft(ckpt), base_of(ckpt)
    ours = Transformer(model)
    add_adapters(ours, model, peft)
    params = dict(ours.named_parameters())
    frozen_from = Path(base["path"]) if base else ckpt
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({f"model.{n}": p.data for n, p in params.items() if not is_adapter(n)},
                 checkpoint_id=frozen_from, no_dist=True)
        dcp.load({f"model.{n}": p.data for n, p in params.items() if is_adapter(n)},
                 checkpoint_id=ckpt, no_dist=True)
    return ours.eval()


def test_our_lora_adapter_loads_in_peft_with_the_same_logits_as_ours_and_the_merged(tmp_path):
    tiny_llama(tmp_path / "base")
    cli("-m", "trainer.hf", "import", str(tmp_path / "base"), str(tmp_path / "imported"))
    cli("launch.py", "--config-dir", str(tmp_path / "imported"), "model=../model",
        "peft=lora", "peft.lora_rank=4", "peft.lora_alpha=8", f"peft.target_modules={TARGETS}",
        "train.micro_batch_size=4", "train.seq_length=32", "train.train_samples=32",
        "train.eval_interval=null", "schedule.lr=1e-2", "schedule.lr_warmup_samples=0",
        "schedule.lr_warmup_fraction=null", f"checkpoint.load={tmp_path / 'imported'}",
        "checkpoint.finetune=true", "cluster.procs_per_node=2",
        "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
        f"hydra.run.dir={tmp_path / 'run'}")
    ckpt = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))[-1]
    cli("-m", "trainer.hf", "export", str(ckpt), str(tmp_path / "adapter"), "--adapter-only",
        "--base", str(tmp_path / "base"))
    cli("-m", "trainer.hf", "export", str(ckpt), str(tmp_path / "merged"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")

    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    base = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base").eval()
    with torch.no_grad():
        plain = base(tokens).logits
        peft = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        theirs = peft(tokens).logits
        merged = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged").eval()(
            tokens).logits
        ours = ours_with_adapters(ckpt)(tokens)[..., :256]
    errors = {"ours": relative(ours, theirs), "merged": relative(merged, theirs),
              "base alone": relative(plain, theirs)}
    print(f"\nLoRA adapter in PEFT against: {errors}")
    assert errors["ours"] <= TOLERANCE and errors["merged"] <= TOLERANCE
    assert errors["base alone"] > 1e-3  # the adapters changed the model: the check can fail


def test_an_adapter_made_by_peft_imports_with_its_logits_and_trains_on(tmp_path):
    """PEFT's own LoRA (random A and B: init_lora_weights=False) on q, v and down, saved by
    save_pretrained, imported beside its base: our model gives PEFT's logits, and a run
    fine-tunes it from there (its first loss is the adapted model's, not the base's)."""
    from peft import LoraConfig, get_peft_model

    tiny_llama(tmp_path / "base")
    torch.manual_seed(1)
    theirs = get_peft_model(
        transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base"),
        LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                   init_lora_weights=False)).eval()
    theirs.save_pretrained(tmp_path / "adapter")
    out = cli("-m", "trainer.hf", "import", str(tmp_path / "base"), str(tmp_path / "imported"),
              "--adapter", str(tmp_path / "adapter"))
    assert "peft=lora peft.lora_rank=4 peft.lora_alpha=16" in out.stdout
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = theirs(tokens).logits
        got = ours_with_adapters(tmp_path / "imported")(tokens)[..., :256]
        base = theirs.get_base_model()
        with theirs.disable_adapter():
            plain = base(tokens).logits
    print(f"\nPEFT's adapter imported: logits {relative(got, want):.1e} (the base alone: "
          f"{relative(plain, want):.1e})")
    assert relative(got, want) <= TOLERANCE and relative(plain, want) > 1e-3

    common = ("--config-dir", str(tmp_path / "imported"), "model=../model", "peft=lora",
              "peft.lora_rank=4", "peft.lora_alpha=16", "peft.target_modules=[down_proj,q_proj,"
              "v_proj]", "train.micro_batch_size=4", "train.seq_length=32",
              "train.train_samples=8", "train.eval_interval=null",
              f"checkpoint.load={tmp_path / 'imported'}", "checkpoint.finetune=true")
    cli("-m", "trainer.hf", "import", str(tmp_path / "base"), str(tmp_path / "plain"))
    first = {}
    for name, load in (("adapted", ()), ("base", (f"checkpoint.load={tmp_path / 'plain'}",))):
        cli("launch.py", *common, *load, f"hydra.run.dir={tmp_path / name}")
        first[name] = json.loads((tmp_path / name / "metrics.jsonl").read_text()
                                 .splitlines()[0])["loss"]
    assert first["adapted"] != first["base"]  # the run started from PEFT's adapter


def test_an_adapter_that_is_not_plain_lora_or_not_this_models_is_one_line(tmp_path):
    from peft import LoraConfig, get_peft_model

    tiny_llama(tmp_path / "base")
    get_peft_model(transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base"),
                   LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(tmp_path / "a")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    for change, message in (({"use_dora": True}, "use_dora=True is not plain LoRA"),
                            ({"r": 8}, "is (4, 64), this model's adapter is (8, 64)"),
                            ({"target_modules": ["q_a_proj"]}, "'q_a_proj' is no projection")):
        (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(config | change))
        out = subprocess.run([sys.executable, "-m", "trainer.hf", "import", str(tmp_path / "base"),
                              str(tmp_path / "out"), "--adapter", str(tmp_path / "a")],
                             capture_output=True, text=True, cwd=ROOT)
        assert out.returncode == 2 and message in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_a_lora_checkpoint_holds_the_adapters_resumes_on_its_base_and_refuses_another(tmp_path):
    """A LoRA run's checkpoint holds the adapters, their Adam moments and nothing of the frozen
    base; meta.json names the base (its folder and a fingerprint of its files). A relaunch
    resumes on that base exactly as an uninterrupted run continues; a base imported anew into
    the same folder is another base: the resume is one line naming both."""
    import shutil

    from trainer.checkpoint.dcp import saved_entries

    tiny_llama(tmp_path / "hf")
    cli("-m", "trainer.hf", "import", str(tmp_path / "hf"), str(tmp_path / "base"))
    run = ("launch.py", "--config-dir", str(tmp_path / "base"), "model=../model", "peft=lora",
           "peft.lora_rank=4", "train.micro_batch_size=4", "train.seq_length=32",
           "train.eval_interval=null", "logger.log_interval=1", "schedule.lr=1e-2",
           "schedule.lr_warmup_samples=4", "schedule.lr_warmup_fraction=null",
           "schedule.lr_decay_samples=16",  # the same schedule, however long the run
           f"checkpoint.load={tmp_path / 'base'}", "checkpoint.finetune=true")
    cli(*run, "train.train_samples=8", f"hydra.run.dir={tmp_path / 'run'}")
    (ckpt,) = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))
    held = {n.removeprefix("model.") for n in saved_entries(ckpt) if n.startswith("model.")}
    assert held and all(is_adapter(n) for n in held), sorted(held)[:3]
    assert any(n.startswith("optim.exp_avg.") for n in saved_entries(ckpt))
    assert base_of(ckpt)["path"] == str((tmp_path / "base").resolve())

    cli(*run, "train.train_samples=16", f"hydra.run.dir={tmp_path / 'run'}")  # resumes
    cli(*run, "train.train_samples=16", f"hydra.run.dir={tmp_path / 'straight'}")
    resumed, straight = ([json.loads(line) for line in (tmp_path / name / "metrics.jsonl")
                          .read_text().splitlines()] for name in ("run", "straight"))
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]

    shutil.rmtree(tmp_path / "base")
    config = transformers.LlamaConfig.from_pretrained(tmp_path / "hf")
    torch.manual_seed(5)  # another model of the same shapes, in the same folder
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    cli("-m", "trainer.hf", "import", str(tmp_path / "hf"), str(tmp_path / "base"))
    out = subprocess.run([sys.executable, *run, "train.train_samples=24",
                          f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True,
                         cwd=ROOT)
    lines = [line for line in out.stderr.splitlines() if line and not line.startswith(
        ("Error executing job", "Set the environment"))]
    assert out.returncode != 0 and len(lines) == 1, out.stderr
    assert "whose files have changed" in lines[0] and "Fix:" in lines[0]
