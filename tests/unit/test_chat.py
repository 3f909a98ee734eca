"""Chat data (trainer/data/chat.py, python -m trainer.prepare --chat) against transformers
itself: the ids of each conversation are apply_chat_template's on real chat templates shipped
in tests/data/chat_templates (Qwen2-Instruct's ChatML and Llama 3 Instruct's, as their
tokenizer_config.json carry them); the loss mask is, on those two, the tokens that start in the
assistant's text as a string search finds it in transformers' rendering, and transformers' own
assistant mask on the template that marks the assistant's text ({% generation %}); a tokenizer
trained here, offline. A template that Jinja cannot read, is empty or loops without end, and
chats with no target, are one line (the command lines: tests/integration/test_chat_cli.py)."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from trainer.data import chat
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


# How each real template writes an assistant turn: the header before its text, and what its
# text becomes (Llama 3 trims it) with the end-of-turn marker it ends with, which is trained.
ASSISTANT_TURN = {
    "chatml": ("<|im_start|>assistant\n", lambda text: text + "<|im_end|>\n"),
    "llama3": ("<|start_header_id|>assistant<|end_header_id|>\n\n",
               lambda text: text.strip() + "<|eot_id|>"),
}


@pytest.mark.parametrize("template", list(ASSISTANT_TURN))
def test_the_mask_is_the_assistant_text_found_in_the_rendering(template, folders):
    """The reference: transformers renders the conversation, each assistant turn is found in
    that text by a string search (its header, then its text and end marker), and a token is a
    target when it starts there (its offset, from transformers' tokenizer)."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(folders[template]))
    ours = ChatEncoder(HFTokenizer.load(folders[template]))
    header, written = ASSISTANT_TURN[template]
    for conversation in CONVERSATIONS:
        text = hf.apply_chat_template(conversation, tokenize=False)
        spans, at = [], 0
        for message in conversation:
            if message["role"] == "assistant":
                turn = header + written(message["content"])
                begin = text.index(turn, at) + len(header)
                at = begin + len(turn) - len(header)
                spans.append((begin, at))
        offsets = hf(text, add_special_tokens=False, return_offsets_mapping=True)
        want = [int(any(b <= start < e for b, e in spans))
                for start, _ in offsets["offset_mapping"]]
        _, mask = ours.encode(conversation, "test")
        assert mask[:-1].tolist() == want and mask[-1] == 0
        assert 0 < sum(want) < len(want)


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
                                         r"conversation \(only user messages\)\. Fix: "):
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


def with_template(folders, tmp_path, template: str) -> Path:
    folder = tmp_path / "tok"
    shutil.copytree(folders["chatml"], folder, dirs_exist_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config,
                                                              "chat_template": template}))
    return folder


UNREADABLE = {  # a template: what the one line says
    "{% for m in messages %}{{ m.content }": r"is not a template Jinja reads \(unexpected '}', "
                                             r"line 1\)\. Fix: ",
    "{{ messages | nosuchfilter }}": r"is not a template Jinja reads \(No filter named "
                                     r"'nosuchfilter', line 1\)\. Fix: ",
    "  ": r"is empty: it would render every conversation as nothing\. Fix: ",
}


@pytest.mark.parametrize("template", list(UNREADABLE))
def test_a_template_jinja_cannot_read_or_an_empty_one_is_one_line(template, folders, tmp_path):
    """A syntax error and an unknown filter were tracebacks; an empty template wrote a dataset
    of end-of-document tokens with no target."""
    tok = HFTokenizer.load(with_template(folders, tmp_path, template))
    with pytest.raises(ValueError, match=r"^--chat: the chat_template in the tokenizer_config"
                                         r"\.json of .*tokenizer\.json " + UNREADABLE[template]):
        ChatEncoder(tok)


def test_a_template_that_loops_without_end_stops_at_the_step_bound(folders, tmp_path,
                                                                   monkeypatch):
    """Each loop step counts, the skipped items of a filtered loop too (the sandbox caps only
    one range()): at a bound of 5,000 this 10^7-step loop stops within a second."""
    monkeypatch.setattr(chat, "MAX_LOOP_STEPS", 5_000)
    loops = ("{% for i in range(100) %}{% for j in range(100000) if j < 0 %}{% endfor %}"
             "{% endfor %}{{ messages[0]['content'] }}")
    ours = ChatEncoder(HFTokenizer.load(with_template(folders, tmp_path, loops)))
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"^here: the chat template of .* fails to render this "
                                         r"conversation \(it runs more than 5,000 loop steps"):
        ours.encode(CONVERSATIONS[0], "here")
    assert time.perf_counter() - started < 5
    # a real template's loop counts a step a message: 4,000 messages render within the bound
    assert ChatEncoder(HFTokenizer.load(folders["llama3"])).render(CONVERSATIONS[1] * 800, "long")


def test_chats_with_no_target_are_one_line_and_nothing_is_written(folders, tmp_path):
    """No assistant turn in any conversation: the dataset was written, with exit 0."""
    users = [json.dumps({"messages": c[:1]}) for c in CONVERSATIONS]
    (tmp_path / "asked.jsonl").write_text("\n".join(users) + "\n")
    with pytest.raises(ValueError, match=r"^--chat --loss-on assistant: not one token of the 2 "
                                         r"conversations is a target .* Fix: add the "
                                         r"assistant's answers, or pass --loss-on all$"):
        prepare(tmp_path / "asked.jsonl", tmp_path / "ds", 0.0, folders["chatml"], chat=True)
    assert not (tmp_path / "ds").exists()
    assert prepare(tmp_path / "asked.jsonl", tmp_path / "ds", 0.0, folders["chatml"], chat=True,
                   loss_on="all") == tmp_path / "ds"
