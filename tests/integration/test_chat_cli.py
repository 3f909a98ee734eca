"""A chat template is the user's code, and both commands that render one with trainer.data.chat,
python -m trainer.prepare --chat and python -m trainer.generate --chat, say in one line when it
cannot be read (a syntax error, an unknown filter: tracebacks before) or loops without end (two
nested loops of range(100000): 10^10 steps, hours before), and write nothing."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_hf import hf_model

from trainer.checkpoint.hf import import_hf

from config_helpers import ROOT

TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"
BROKEN = {  # a template: what the one line says
    "syntax": ("{% for m in messages %}{{ m.content }", "is not a template Jinja reads "
                                                        "(unexpected '}', line 1)"),
    "filter": ("{{ messages | nosuchfilter }}", "(No filter named 'nosuchfilter', line 1)"),
    "loop": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
             "fails to render this conversation (it runs more than 1,000,000 loop steps"),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A tokenizer folder per broken template (a BPE of fewer ids than the model's 256), and
    "model": an imported tiny Llama to generate with."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("chat_cli")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["what is two and two? it is four."] * 4, trainers.BpeTrainer(
        vocab_size=64, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        show_progress=False))
    config = json.loads((TEMPLATES / "chatml.json").read_text())
    out = {}
    for name, (template, _) in BROKEN.items():
        out[name] = root / name
        out[name].mkdir()
        tok.save(str(out[name] / "tokenizer.json"))
        (out[name] / "tokenizer_config.json").write_text(
            json.dumps({**config, "chat_template": template}))
    hf_model("mha_tied_sharded", root / "hf")
    import_hf(root / "hf", root / "model")
    out["model"] = root / "model"
    (root / "chats.jsonl").write_text(json.dumps({"messages": [
        {"role": "user", "content": "what is two and two?"},
        {"role": "assistant", "content": "it is four."}]}) + "\n")
    out["chats"] = root / "chats.jsonl"
    return out


def one_line(*args: str) -> str:
    """The command's refusal: exit 2, one line on stderr, no traceback (within a minute: the
    loop's bound is a million steps, a few seconds)."""
    done = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, \
        done.stderr[-2000:]
    assert "Fix: " in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("name", list(BROKEN))
def test_prepare_and_generate_say_a_broken_template_in_one_line(name, folders, tmp_path):
    said = BROKEN[name][1]
    line = one_line("trainer.prepare", str(folders["chats"]), str(tmp_path / "out"), "--chat",
                    "--tokenizer", str(folders[name]))
    assert said in line and str(folders[name]) in line, line
    assert not (tmp_path / "out").exists()
    line = one_line("trainer.generate", str(folders["model"]), "--chat", "--prompt", "hi",
                    "--tokenizer", str(folders[name]))
    assert said in line and str(folders[name]) in line, line
