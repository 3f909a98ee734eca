"""Command line: continue a prompt with a trained model, on one process, with a KV cache.

    python -m trainer.generate RUN_OR_CHECKPOINT --prompt TEXT [--max-new-tokens N]
        [--temperature T] [--top-p P] [--seed S] [--tokenizer PATH] [--chat]

RUN_OR_CHECKPOINT: a run folder (its latest checkpoint), a folder of checkpoints, one
checkpoint (saved under any layout: DCP reads it whole), or the folder `python -m trainer.hf
import` wrote. The tokenizer is --tokenizer (a tokenizer.json or a folder holding one, or
byte), else the one the checkpoint records (the run's dataset's), else the one an import kept
from the Hugging Face folder. --chat wraps the prompt as a user message in the tokenizer's chat
template, with the generation prompt. Generation stops at the end-of-document token. Prints the
continuation.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from trainer.checkpoint.integrity import resolve

KEY = "RUN_OR_CHECKPOINT"


def checkpoint_of(path: Path) -> Path:
    runs_checkpoints = path / "checkpoints"
    return resolve(runs_checkpoints if runs_checkpoints.is_dir() else path, key=KEY)


def tokenizer_of(ckpt: Path, given: str | None):
    """(a tokenizer: trainer.data.tokenizer's, what chose it)."""
    from trainer.data.dataset import load_tokenizer

    meta = json.loads((ckpt / "meta.json").read_text())
    choice, why = given, "--tokenizer"
    if choice is None and meta.get("tokenizer"):
        choice, why = meta["tokenizer"], f"the run's dataset (recorded in {ckpt / 'meta.json'})"
    if choice is None and (ckpt / "tokenizer.json").is_file():
        choice, why = str(ckpt), "kept by trainer.hf import"
    if choice is None:
        raise ValueError(f"{KEY}={ckpt} records no tokenizer (a Megatron dataset's, or a run "
                         f"from before they were recorded). Fix: pass --tokenizer with the "
                         f"tokenizer.json the data was prepared with, or byte")
    return load_tokenizer(choice), why


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainer.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path, metavar=KEY)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="of the sampling")
    parser.add_argument("--tokenizer", help="byte, a tokenizer.json or a folder holding one")
    parser.add_argument("--chat", action="store_true",
                        help="the prompt as a user message in the tokenizer's chat template")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1:
        parser.exit(2, f"error: --max-new-tokens {args.max_new_tokens} (at least 1), "
                       f"--temperature {args.temperature} (0 or more), --top-p {args.top_p} "
                       f"(in (0, 1]): one is out of range\n")
    try:
        ckpt = checkpoint_of(args.path)
        tok, why = tokenizer_of(ckpt, args.tokenizer)
        prompt = args.prompt
        if args.chat:
            from trainer.data.chat import ChatEncoder

            prompt = ChatEncoder(tok).render([{"role": "user", "content": prompt}], "--prompt",
                                             generation_prompt=True)
        from trainer.checkpoint.hf import read_model_config

        model_cfg = read_model_config(ckpt, None)
    except (ValueError, FileNotFoundError) as error:
        parser.exit(2, f"error: {error}\n")
    ids = tok.encode_text(prompt)
    print(f"{ckpt}: {model_cfg.name}, {model_cfg.num_layers} layers; tokenizer {tok.name} "
          f"({why}); prompt {len(ids)} tokens", file=sys.stderr, flush=True)
    from trainer.checkpoint.whole import load_model
    from trainer.model.generate import generate

    model = load_model(ckpt, model_cfg)
    started = time.perf_counter()
    out = generate(model, ids, args.max_new_tokens, args.temperature, args.top_p, tok.eod_id,
                   args.seed)
    seconds = time.perf_counter() - started
    print(tok.decode(out))
    print(f"{len(out)} tokens in {seconds:.1f} s ({len(out) / max(seconds, 1e-9):.1f} tokens/s)",
          file=sys.stderr)


if __name__ == "__main__":
    main()
