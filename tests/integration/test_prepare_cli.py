"""python -m trainer.prepare refuses bad input in one line with a Fix, before OUT_DIR is
written: a Megatron PREFIX that exists or cannot be written, --eod-token with the byte
tokenizer, --tokenizer with --train-tokenizer, --seq-length below 1; and it says when a trained
tokenizer's vocabulary is smaller than asked for. (What it reads: tests/unit/test_inputs.py;
chats: tests/unit/test_chat.py.)"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from config_helpers import ROOT


@pytest.fixture
def src(tmp_path) -> Path:
    folder = tmp_path / "src"
    folder.mkdir()
    for i in range(3):
        (folder / f"{i}.txt").write_text(f"hello world, document {i}\n")
    return folder


def prepare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer.prepare", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def refused(*args: str, names: tuple[str, ...] = ()) -> str:
    """A non-zero exit, no traceback, exactly one line on stderr with a Fix naming `names`."""
    out = prepare(*args)
    lines = out.stderr.splitlines()
    assert out.returncode != 0 and "Traceback" not in out.stdout + out.stderr, out.stderr
    assert len(lines) == 1 and "Fix:" in lines[0], out.stderr
    assert all(str(name) in lines[0] for name in names), (names, lines[0])
    return lines[0]


def test_a_megatron_prefix_that_exists_or_cannot_be_written_is_refused_first(src, tmp_path):
    out, prefix = tmp_path / "out", tmp_path / "meg" / "text"
    ok = prepare(str(src), str(out), "--valid-fraction", "0.3", "--megatron", str(prefix))
    assert ok.returncode == 0, ok.stderr
    before = {p.name: p.read_bytes() for p in prefix.parent.iterdir()}
    assert sorted(before) == ["text.bin", "text.idx"]  # no temporary file is left
    (tmp_path / "a_file").write_text("")
    only_bin = tmp_path / "only_bin"
    Path(f"{only_bin}.bin").write_text("")
    cases = {prefix: (f"{prefix}.bin already exists",),
             only_bin: (f"{only_bin}.bin already exists",),
             Path("/proc/forbidden/x"): ("--megatron", "/proc"),
             tmp_path / "a_file" / "x": ("--megatron", tmp_path / "a_file")}
    for bad, names in cases.items():
        refused(str(src), str(tmp_path / "new"), "--valid-fraction", "0.3",
                "--megatron", str(bad), names=names)
        assert not (tmp_path / "new").exists()
    assert {p.name: p.read_bytes() for p in prefix.parent.iterdir()} == before


def test_an_end_of_document_token_for_the_byte_tokenizer_is_refused(src, tmp_path):
    refused(str(src), str(tmp_path / "out"), "--eod-token", "</s>",
            names=("--eod-token </s>", "byte tokenizer"))
    refused(str(src), str(tmp_path / "out"), "--tokenizer", "x.json", "--train-tokenizer",
            "300", names=("--tokenizer x.json", "--train-tokenizer 300"))
    assert not (tmp_path / "out").exists()


def test_a_sample_length_below_one_is_refused(src, tmp_path):
    """It was accepted, and the pack report then said "samples of -4 tokens, -79200.0% of
    them data"."""
    for bad in ("0", "-5"):
        refused(str(src), str(tmp_path / "out"), "--seq-length", bad,
                names=(f"--seq-length {bad}", "at least one token"))
    assert not (tmp_path / "out").exists()


def test_a_trained_vocabulary_smaller_than_asked_is_said(src, tmp_path):
    out = prepare(str(src), str(tmp_path / "out"), "--valid-fraction", "0.3",
                  "--train-tokenizer", "100000")
    assert out.returncode == 0, out.stderr
    vocab = json.loads((tmp_path / "out" / "meta.json").read_text())["vocab_size"]
    assert 257 < vocab < 1000
    warning = [line for line in out.stderr.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "--train-tokenizer 100000" in warning[0]
    assert f"supports only {vocab} tokens" in warning[0]
    assert f"(vocab {vocab}," in out.stdout
    # It said what it does first (on stdout, with the result): the tokenizer's training, then
    # what it tokenizes.
    said = out.stdout.splitlines()
    size = sum(f.stat().st_size for f in src.iterdir()) / 2**20
    assert said[0] == "training a byte-level BPE of 100,000 tokens on 3 file(s)", said
    assert said[1].startswith(f"tokenizing 3 file(s), {size:,.1f} MiB, with "), said
