"""The fine-tuning walkthrough of docs/finetuning.md, end to end, as a person types it: a Hugging
Face chat Llama (the offline stand-in) imported, chat data prepared with its chat template and a
loss mask, fine-tuned under TP 2 x SP with packed examples and documents kept apart, exported, and
generated with: our trainer.generate on the run and transformers' generate on the export give the
same greedy answer, in the form the chats taught."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
QUESTION = "What is 12 + 7?"


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_import_fine_tune_on_chats_export_and_generate(tmp_path):
    import torch
    import transformers

    launch = str(ROOT / "launch.py")
    run("-m", "trainer.hf", "standin", "hf/chat-llama", "data/chats.jsonl", cwd=tmp_path)
    run("-m", "trainer.hf", "import", "hf/chat-llama", "imported/chat-llama", cwd=tmp_path)
    prepared = run("-m", "trainer.prepare", "data/chats.jsonl", "data/chat", "--chat",
                   "--tokenizer", "imported/chat-llama", "--valid-fraction", "0.05", cwd=tmp_path)
    assert "loss mask (assistant):" in prepared.stdout
    trained = run(launch, "--config-dir", "imported/chat-llama", "model=../model",
                  "checkpoint.load=imported/chat-llama", "checkpoint.finetune=true",
                  "data.path=data/chat", "data.pack=true", "data.reset_attention_mask=true",
                  "data.reset_position_ids=true", "train.seq_length=256",
                  "train.train_samples=1024", "train.eval_samples=16", "schedule.lr=3e-3",
                  "cluster.procs_per_node=2", "parallel.tensor_model_parallel_size=2",
                  "parallel.sequence_parallel=true", "logger.log_interval=16",
                  "hydra.run.dir=outputs/chat", cwd=tmp_path)
    assert "data.pack: the train split's 1,900 examples in" in trained.stdout
    rows = (tmp_path / "outputs/chat/metrics.jsonl").read_text().splitlines()
    losses = [json.loads(line)["loss"] for line in rows if '"loss"' in line]
    assert losses[-1] < 0.5 * losses[0], losses  # it learned from the assistant's tokens
    run("-m", "trainer.hf", "export", "outputs/chat/checkpoints", "hf/tuned", cwd=tmp_path)
    ours = run("-m", "trainer.generate", "outputs/chat", "--chat", "--prompt", QUESTION,
               "--max-new-tokens", "16", cwd=tmp_path).stdout.rstrip("\n")
    assert re.fullmatch(r"-?\d+ [+-] \d+ = -?\d+\.<\|im_end\|>", ours), ours

    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf/tuned")
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf/tuned").eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                           add_generation_prompt=True, return_dict=True,
                                           return_tensors="pt")["input_ids"]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=16, do_sample=False, eos_token_id=end,
                             pad_token_id=end)
    theirs = tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=False)
    assert theirs == ours
