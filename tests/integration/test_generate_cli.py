"""python -m trainer.generate refuses bad input in one line naming the flag, its value and the
fix, before the model is loaded: flags out of range (an empty prompt, a temperature that is nan,
inf or negative, top-p outside (0, 1] or without sampling, a seed torch cannot take), a
tokenizer that is not the model's or outgrows its vocabulary, --chat with the byte tokenizer, and
a prompt plus --max-new-tokens past the sequence length the model was trained at (the default is
cut to what that length leaves)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import trainer.checkpoint.whole
from trainer.generate import main

from config_helpers import ROOT

CONTEXT = 64  # train.seq_length of the run below


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A byte-tokenizer run at train.seq_length=64 (its checkpoint records both)."""
    folder = tmp_path_factory.mktemp("gen") / "run"
    done = subprocess.run([sys.executable, "launch.py", "train.train_samples=64",
                           f"train.seq_length={CONTEXT}", f"hydra.run.dir={folder}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    return folder


@pytest.fixture
def unloaded(monkeypatch):
    """Fails the test if the command reaches the loading of the model."""
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")
    monkeypatch.setattr(trainer.checkpoint.whole, "load_model", load)


def generate(capsys, *args) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of the command in this process."""
    capsys.readouterr()  # what came before is not the command's
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as stop:
        code = stop.code
    out = capsys.readouterr()
    return code, out.out, out.err


def refused(capsys, *args, names: tuple = ()) -> str:
    """Exit status 2, one line on stderr with a Fix naming `names`, nothing on stdout."""
    code, out, err = generate(capsys, *args)
    lines = err.splitlines()
    assert code == 2 and out == "" and len(lines) == 1, (code, out, err)
    assert "Fix:" in lines[0] and all(str(n) in lines[0] for n in names), (names, lines[0])
    return lines[0]


@pytest.mark.parametrize("flags, names", [
    (["--prompt", ""], ("--prompt ''",)),
    (["--prompt", "x", "--temperature", "nan"], ("--temperature nan",)),
    (["--prompt", "x", "--temperature", "inf"], ("--temperature inf",)),
    (["--prompt", "x", "--temperature", "-0.5"], ("--temperature -0.5",)),
    (["--prompt", "x", "--top-p", "0"], ("--top-p 0.0", "(0, 1]")),
    (["--prompt", "x", "--top-p", "1.5", "--temperature", "1"], ("--top-p 1.5",)),
    (["--prompt", "x", "--top-p", "nan", "--temperature", "1"], ("--top-p nan",)),
    (["--prompt", "x", "--top-p", "0.9"], ("--top-p 0.9", "--temperature 0")),
    (["--prompt", "x", "--max-new-tokens", "0"], ("--max-new-tokens 0",)),
    (["--prompt", "x", "--seed", "-1"], ("--seed -1",)),
    (["--prompt", "x", "--seed", str(2**64)], (f"--seed {2**64}",)),
])
def test_a_flag_out_of_range_is_one_line(run, unloaded, capsys, flags, names):
    refused(capsys, run, *flags, names=names)


def test_a_tokenizer_that_is_not_the_models_is_refused(run, unloaded, capsys, tmp_path):
    bpe = _tokenizer(tmp_path / "bpe", 384)
    line = refused(capsys, run, "--prompt", "hello", "--tokenizer", bpe,
                   names=(f"--tokenizer {bpe}", "not the tokenizer this model was trained with",
                          "byte", "384 tokens against its 256"))
    assert "meta.json" in line
    refused(capsys, run, "--prompt", "x", "--chat",
            names=("--chat", "byte", "no chat template"))


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(run, unloaded, monkeypatch,
                                                                   capsys, tmp_path):
    """A checkpoint that records no tokenizer (a Megatron dataset's run) takes --tokenizer, if
    its vocabulary fits the model's."""
    ckpt = tmp_path / "untold"
    shutil.copytree(sorted((run / "checkpoints").iterdir())[-1], ckpt)
    meta = json.loads((ckpt / "meta.json").read_text())
    (ckpt / "meta.json").write_text(json.dumps(meta | {"tokenizer": None}))
    refused(capsys, ckpt, "--prompt", "x", names=("records no tokenizer", "--tokenizer"))
    bpe = _tokenizer(tmp_path / "bpe", 384)
    refused(capsys, ckpt, "--prompt", "x", "--tokenizer", bpe,
            names=(f"--tokenizer {bpe}: 384 tokens", "vocabulary of 256"))
    monkeypatch.undo()  # the model may load now
    code, _, err = generate(capsys, ckpt, "--prompt", "x", "--tokenizer", "byte",
                            "--max-new-tokens", 2)  # the model's size: taken
    assert code == 0 and "tokenizer byte (--tokenizer)" in err, err


def test_prompt_and_new_tokens_stay_within_the_trained_length(run, unloaded, monkeypatch,
                                                              capsys):
    prompt = "a" * (CONTEXT - 4)
    refused(capsys, run, "--prompt", prompt, "--max-new-tokens", 5,
            names=("--max-new-tokens 5", f"{CONTEXT} tokens", "--max-new-tokens 4 or fewer"))
    refused(capsys, run, "--prompt", "a" * CONTEXT, names=(f"--prompt is {CONTEXT} tokens",))
    monkeypatch.undo()  # the model may load now
    code, out, err = generate(capsys, run, "--prompt", prompt, "--max-new-tokens", 4)
    assert code == 0 and "\n4 tokens in " in err, err
    # the default (64 new tokens) is cut to what the context leaves, and says so
    code, out, err = generate(capsys, run, "--prompt", prompt)
    assert code == 0 and f"up to 4 new ({CONTEXT}-token context)" in err, err
    assert "\n4 tokens in " in err


def test_the_command_refuses_before_anything_in_one_line(run):
    """The issue's hang: 10^8 new tokens on a 64-token model without an end-of-document token,
    as a user types it."""
    done = subprocess.run([sys.executable, "-m", "trainer.generate", str(run), "--prompt", "x",
                           "--max-new-tokens", "100000000"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.splitlines() == [
        f"error: --max-new-tokens 100000000: the prompt's 1 tokens and 100000000 new ones pass "
        f"the {CONTEXT} tokens the model was trained on (train.seq_length); positions past it "
        f"are out of distribution. Fix: pass --max-new-tokens {CONTEXT - 1} or fewer"]


def _tokenizer(folder: Path, size: int) -> Path:
    """A folder holding a tokenizer.json of `size` words (the last the end-of-document token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(size - 1)} | {"<|endoftext|>": size - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_the_trained_length_is_read_where_a_blend_records_no_stream_length(run, tmp_path,
                                                                           unloaded, capsys):
    """A blend's stream identity holds no seq_length: the checkpoint's own record bounds it."""
    [ckpt] = sorted((run / "checkpoints").iterdir())[-1:]
    copy = tmp_path / ckpt.name
    shutil.copytree(ckpt, copy)
    meta = json.loads((copy / "meta.json").read_text())
    assert meta["seq_length"] == CONTEXT
    meta["data"] = {"blend": [[1.0, "x"]], "period": 4096}  # as trainer.data.stream writes it
    (copy / "meta.json").write_text(json.dumps(meta))
    refused(capsys, copy, "--prompt", "a" * (CONTEXT - 4), "--max-new-tokens", 5,
            names=("--max-new-tokens 5", f"{CONTEXT} tokens"))
