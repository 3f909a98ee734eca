"""A stand-in for a downloaded chat model, made offline (python -m trainer.hf standin): a
random tiny Llama built by transformers itself (save_pretrained: config.json, safetensors), a
byte-level BPE with ChatML's special tokens trained on the chats, its tokenizer_config.json
with the ChatML chat template (Qwen2-Instruct's, as tests/data/chat_templates/chatml.json), and
a JSON-lines file of chats to fine-tune it on: arithmetic questions and their answers, which a
tiny model learns in a minute. The fine-tuning walkthrough (docs/finetuning.md) uses it where a
person would use a real model and real chats; tests/integration/test_sft.py runs that walkthrough.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
          "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")


def arithmetic_chats(count: int, seed: int) -> list[dict]:
    rng, chats = random.Random(seed), []
    for _ in range(count):
        a, b, op = rng.randint(0, 49), rng.randint(0, 49), rng.choice("+-")
        answer = a + b if op == "+" else a - b
        chats.append({"messages": [{"role": "user", "content": f"What is {a} {op} {b}?"},
                                   {"role": "assistant", "content": f"{a} {op} {b} = {answer}."}]})
    return chats


def write_standin(out_dir: Path, chats_file: Path, chats: int = 2000, seed: int = 0) -> int:
    """Writes the model folder and the chats; returns the vocabulary size."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if out_dir.exists() or chats_file.exists():
        raise ValueError(f"{out_dir if out_dir.exists() else chats_file} exists; the stand-in "
                         f"never overwrites. Fix: remove it or choose other paths")
    data = arithmetic_chats(chats, seed)
    texts = [m["content"] for chat in data for m in chat["messages"]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts + ["system user assistant You are a helpful assistant."],
                            trainers.BpeTrainer(vocab_size=384, special_tokens=SPECIALS,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                show_progress=False))
    vocab = tok.get_vocab_size()
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=tok.token_to_id("<|im_end|>"), pad_token_id=None)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(out_dir)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=1))
    chats_file.parent.mkdir(parents=True, exist_ok=True)
    chats_file.write_text("".join(json.dumps(chat) + "\n" for chat in data))
    return vocab
