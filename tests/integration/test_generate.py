"""python -m trainer.generate: greedy decoding with our KV cache gives the tokens transformers'
own generate gives on the same weights (random tiny Llama with GQA and rope scaling, Qwen3 and
Mixtral, imported with trainer.hf), and the command finds the checkpoint and its tokenizer."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_hf import hf_model

from trainer.checkpoint.hf import import_hf
from trainer.checkpoint.whole import load_model
from trainer.model.generate import generate

ROOT = Path(__file__).parents[2]
PROMPT = [5, 17, 99, 3, 42, 7, 7, 120]


@pytest.mark.parametrize("name", ["gqa_padded_vocab_rope_scaling", "qwen3_wide_heads",
                                  "mixtral"])
def test_greedy_tokens_are_transformers_generate(name, tmp_path):
    theirs = hf_model(name, tmp_path / "hf")
    model = import_hf(tmp_path / "hf", tmp_path / "imported")
    ours = load_model(tmp_path / "imported", model)
    got = generate(ours, PROMPT, 24)
    theirs.generation_config.eos_token_id = None  # 24 tokens, as ours without a stop token
    want = theirs.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False,
                           pad_token_id=0)[0, len(PROMPT):].tolist()
    assert got == want
    # sampling: seeded, so repeatable; other seeds, other tokens
    one = generate(ours, PROMPT, 24, temperature=1.0, top_p=0.9, seed=1)
    assert one == generate(ours, PROMPT, 24, temperature=1.0, top_p=0.9, seed=1)
    assert one != generate(ours, PROMPT, 24, temperature=1.0, top_p=0.9, seed=2)


def test_the_command_uses_the_tokenizer_an_import_kept(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf_model("mha_tied_sharded", tmp_path / "hf")  # vocabulary 256
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello world"] * 3, trainers.BpeTrainer(
        vocab_size=256, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    import_hf(tmp_path / "hf", tmp_path / "imported")
    done = subprocess.run([sys.executable, "-m", "trainer.generate", str(tmp_path / "imported"),
                           "--prompt", "hello", "--max-new-tokens", "6"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "(kept by trainer.hf import); prompt" in done.stderr and done.stdout.strip()
    bad = subprocess.run([sys.executable, "-m", "trainer.generate", str(tmp_path / "nowhere"),
                          "--prompt", "x"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "RUN_OR_CHECKPOINT=" in bad.stderr and "no checkpoint there" in bad.stderr


def test_sample_prompts_at_evaluation_are_the_checkpoints_greedy_continuations(tmp_path):
    """logger.sample_prompts under weight shards 2 (rank 0 assembles the weights) against the
    command's path (the checkpoint of the same step, read whole by DCP)."""
    import json

    from trainer.checkpoint.hf import read_model_config
    from trainer.data.dataset import TOKENIZERS

    prompts = ["def main(", "import "]
    done = subprocess.run([sys.executable, "launch.py", "train.train_samples=256",
                           "train.eval_interval=16", "logger.sample_max_new_tokens=12",
                           f"logger.sample_prompts={json.dumps(prompts)}",
                           "cluster.procs_per_node=2",
                           "parallel.tensor_parallel_num_weight_shards=2",
                           f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [row["samples"] for row in rows if "samples" in row]
    assert len(logged) == 1 and "sample at step 16: 'def main(' -> " in done.stdout
    ckpt = tmp_path / "checkpoints" / "step_00000016"
    model = load_model(ckpt, read_model_config(ckpt, None))
    byte = TOKENIZERS["byte"]
    for prompt, sample in zip(prompts, logged[0]):
        ids = generate(model, byte.encode(prompt).tolist(), 12)
        assert sample == {"prompt": prompt, "continuation": byte.decode(ids)}
