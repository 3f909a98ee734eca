"""python -m trainer.generate: greedy decoding with our KV cache gives the tokens transformers'
own generate gives on the same weights (random tiny Llama with GQA and rope scaling, Qwen3 and
Mixtral, imported with trainer.hf), sampling draws from the distribution transformers' logits
warpers give on the same logits, and the command finds the checkpoint and its tokenizer (and
refuses another: tests/integration/test_generate_cli.py holds the other refusals)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_generate_cli import generate as run_main
from test_generate_cli import refused
from test_hf import hf_model

from trainer.checkpoint.hf import import_hf
from trainer.checkpoint.whole import load_model
from trainer.model.generate import distribution, generate, next_token

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
    # sampling: seeded, so repeatable; other seeds, other tokens (what is drawn: below)
    one = generate(ours, PROMPT, 24, temperature=1.0, top_p=0.9, seed=1)
    assert one == generate(ours, PROMPT, 24, temperature=1.0, top_p=0.9, seed=1)
    assert one != generate(ours, PROMPT, 24, temperature=1.0, top_p=0.9, seed=2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("temperature, top_p", [  # they keep 1000, 453, 259, 38, 17, 1, 1
    (1.0, 1.0), (0.7, 0.9), (1.5, 0.5), (0.3, 0.95), (2.0, 0.05), (0.2, 0.3), (1e-40, 0.8)])
def test_sampling_is_transformers_logits_warpers(temperature, top_p, dtype):
    """The distribution a token is drawn from is transformers' (5.24) TemperatureLogitsWarper
    then TopPLogitsWarper (the order of its generate) on the same logits, softmaxed: the same
    tokens kept, the same probabilities; and next_token draws from it as torch.multinomial
    draws from theirs with the same seed."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    logits = torch.randn(1000, generator=torch.Generator().manual_seed(7)).to(dtype)
    warped = TemperatureLogitsWarper(temperature)(None, logits[None].clone())
    if top_p < 1:
        warped = TopPLogitsWarper(top_p)(None, warped)
    theirs = torch.softmax(warped[0], dim=-1)
    ours = distribution(logits, temperature, top_p)
    if temperature > 1e-3:  # theirs overflows below (float32 logits / 1e-40 = inf): nan
        assert torch.equal(ours > 0, theirs > 0)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6 if dtype == torch.float32
                                   else 1e-15)
    else:  # the limit: all on the highest logit, as greedy
        theirs = (logits == logits.max()).to(dtype)
        assert torch.equal(ours, theirs)
    mine, reference = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    drawn = [next_token(logits, temperature, top_p, mine) for _ in range(300)]
    assert drawn == [int(torch.multinomial(theirs, 1, generator=reference))
                     for _ in range(300)]


def test_the_command_uses_the_tokenizer_an_import_kept(tmp_path, capsys):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf_model("mha_tied_sharded", tmp_path / "hf")  # vocabulary 256
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello world"] * 3, trainers.BpeTrainer(
        vocab_size=256, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens(["<|extra|>"])  # id 257: a token past the model's 256 rows
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    import_hf(tmp_path / "hf", tmp_path / "imported")
    done = subprocess.run([sys.executable, "-m", "trainer.generate", str(tmp_path / "imported"),
                           "--prompt", "hello", "--max-new-tokens", "6"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "(kept by trainer.hf import); prompt" in done.stderr and done.stdout.strip()
    # another tokenizer is refused (the byte one would decode this BPE model's ids as garbage);
    # a copy of the model's is taken
    imported = tmp_path / "imported"
    refused(capsys, imported, "--prompt", "hello", "--tokenizer", "byte",
            names=("--tokenizer byte is not the tokenizer this model was trained with",
                   "kept by trainer.hf import", "256 tokens against its 258"))
    shutil.copytree(tmp_path / "hf", tmp_path / "copy")
    code, _, err = run_main(capsys, imported, "--prompt", "hello", "--max-new-tokens", 2,
                            "--tokenizer", tmp_path / "copy")
    assert code == 0 and "(--tokenizer, the model's: kept by trainer.hf import)" in err, err
    # the model's own tokenizer has tokens the model has no row for: a prompt of one
    refused(capsys, imported, "--prompt", "hello <|extra|>",
            names=("--prompt encodes to id 257", "vocabulary of 256"))
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


@pytest.mark.parametrize("softmax_type", ["vanilla", "learnable"])
def test_a_sliding_window_cache_gives_the_whole_sequences_logits(softmax_type):
    """Blocks windowed 3 back (and global ones between), with or without sinks: at every step
    the cache, which keeps only the last 4 keys of a windowed block, gives the logits the model
    gives over the whole sequence without a cache (prompt of 8, longer than the window)."""
    from trainer.config import ModelConfig
    from trainer.model.generate import kv_cache
    from trainer.model.transformer import Transformer

    cfg = ModelConfig(name="llama", vocab_size=256, hidden_size=64, num_layers=4, num_heads=4,
                      num_query_groups=2, ffn_hidden_size=176, rope_theta=10000.0,
                      norm_eps=1e-5, init_std=0.02, window_size=3, window_attn_skip_freq=2,
                      softmax_type=softmax_type)
    torch.manual_seed(0)
    model = Transformer(cfg).double().eval()
    model.init_weights(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):  # away from zero, so a dropped sink shows
                p.copy_(torch.linspace(-2, 2, p.numel()))
        tokens = generate(model, PROMPT, 6)
        sequence = torch.tensor([PROMPT + tokens])
        whole = model(sequence)[0, len(PROMPT) - 1:-1]
        steps = []
        with kv_cache(model):
            steps.append(model(sequence[:, :len(PROMPT)])[0, -1])
            for i in range(len(PROMPT), sequence.shape[1] - 1):
                steps.append(model(sequence[:, i:i + 1], torch.tensor([[i]]))[0, -1])
            kept = [model.layers[str(b)].attn.attention_fn.k.shape[2] for b in range(4)]
        assert (torch.stack(steps) - whole).abs().max() < 1e-10
        assert kept == [4, sequence.shape[1] - 1, 4, sequence.shape[1] - 1]  # windowed: 3 + 1
