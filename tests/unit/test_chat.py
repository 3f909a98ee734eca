"""Chat data (trainer/data/chat.py, python -m trainer.prepare --chat) against transformers
itself: the ids of each conversation are apply_chat_template's on real chat templates shipped
in tests/data/chat_templates (Qwen2-Instruct's ChatML and Llama 3 Instruct's, as their
tokenizer_config.json carry them), and the loss mask is transformers' own assistant mask on the
template that marks the assistant's text ({% generation %}); a tokenizer trained here, offline."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from trainer.data.chat import ChatEncoder
from trainer.data.dataset import TokenDataset, prepare
from trainer.data.tokenizer import HFTokenizer

TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "It is 4."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another one, in German with ünïcode?"},
     {"role": "assistant", "content": "  Grün, and that is all  "}],
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """template name -> a tokenizer folder (tokenizer.json + that tokenizer_config.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [m["content"] for conversation in CONVERSATIONS for m in conversation]
    tok.train_from_iterator(texts * 5 + ["You are a helpful assistant. system user assistant"],
                            trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                show_progress=False))
    root = tmp_path_factory.mktemp("chat")
    out = {}
    for config in sorted(TEMPLATES.glob("*.json")):
        folder = root / config.stem
        folder.mkdir()
        tok.save(str(folder / "tokenizer.json"))
        shutil.copy(config, folder / "tokenizer_config.json")
        out[config.stem] = folder
    return out


@pytest.mark.parametrize("template", ["chatml", "llama3", "chatml_generation"])
def test_the_ids_are_transformers_apply_chat_template(template, folders):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(folders[template]))
    ours = ChatEncoder(HFTokenizer.load(folders[template]))
    for conversation in CONVERSATIONS:
        ids, mask = ours.encode(conversation, "test")
        want = hf.apply_chat_template(conversation, tokenize=True, return_dict=True)["input_ids"]
        assert ids[:-1].tolist() == want and ids[-1] == ours.tok.eod_id
        assert 0 < mask.sum() < mask.size


def test_the_mask_is_transformers_assistant_mask(folders):
    from transformers import AutoTokenizer

    folder = folders["chatml_generation"]
    hf = AutoTokenizer.from_pretrained(str(folder))
    ours = ChatEncoder(HFTokenizer.load(folder))
    for conversation in CONVERSATIONS:
        _, mask = ours.encode(conversation, "test")
        want = hf.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)["assistant_masks"]
        assert mask[:-1].tolist() == want and mask[-1] == 0


def test_loss_on_all_counts_every_token(folders):
    ours = ChatEncoder(HFTokenizer.load(folders["llama3"]), "all")
    ids, mask = ours.encode(CONVERSATIONS[1], "test")
    assert mask.size == ids.size and mask.all()


def test_prepare_chat_writes_tokens_and_mask(folders, tmp_path):
    lines = [json.dumps({"messages": c}) for c in CONVERSATIONS * 3]
    (tmp_path / "chat.jsonl").write_text("\n".join(lines) + "\n")
    out = prepare(tmp_path / "chat.jsonl", tmp_path / "ds", 0.0, folders["chatml"], chat=True)
    ds = TokenDataset.open(out)
    encoder = ChatEncoder(HFTokenizer.load(folders["chatml"]))
    want = [encoder.encode(c, "test") for c in CONVERSATIONS * 3]
    assert np.asarray(ds.tokens).tolist() == np.concatenate([i for i, _ in want]).tolist()
    assert np.asarray(ds.loss_mask).tolist() == np.concatenate([m for _, m in want]).tolist()
    assert len(ds.meta["doc_starts"]) == 6 and ds.meta["loss_mask"]
    assert "+mask:" in ds.fingerprint


def test_a_template_that_fails_and_one_that_rewrites_earlier_turns_are_one_line(folders,
                                                                              tmp_path):
    folder = tmp_path / "tok"
    shutil.copytree(folders["chatml"], folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ raise_exception('only user messages') }}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"^here: the chat template of .* fails to render this "
                                         r"conversation \(only user messages\)$"):
        ChatEncoder(HFTokenizer.load(folder)).encode(CONVERSATIONS[0], "here")
    # a template that writes the number of messages first: every prefix renders differently
    config["chat_template"] = ("{{ messages | length }}{% for m in messages %}{{ m['content'] }}"
                               "{% endfor %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="differently once later ones follow.*--loss-on all"):
        ChatEncoder(HFTokenizer.load(folder)).encode(CONVERSATIONS[0], "here")
    assert ChatEncoder(HFTokenizer.load(folder), "all").encode(CONVERSATIONS[0], "here")


def test_chat_lines_without_messages_are_one_line(folders, tmp_path):
    (tmp_path / "plain.jsonl").write_text(json.dumps({"text": "no chat here"}) + "\n")
    with pytest.raises(ValueError, match=r"plain.jsonl:1: no key 'messages' \(keys 'text'\)"):
        prepare(tmp_path / "plain.jsonl", tmp_path / "ds", 0.0, folders["chatml"], chat=True)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: \"messages\" must be a non-empty list"):
        prepare(tmp_path / "bad.jsonl", tmp_path / "ds", 0.0, folders["chatml"], chat=True)
    assert not (tmp_path / "ds").exists()
