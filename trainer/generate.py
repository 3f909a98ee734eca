"""Command line: continue a prompt with a trained model, on one process, with a KV cache.

    python -m trainer.generate RUN_OR_CHECKPOINT --prompt TEXT [--max-new-tokens N]
        [--temperature T] [--top-p P] [--seed S] [--tokenizer PATH] [--chat]

RUN_OR_CHECKPOINT: a run folder (its latest checkpoint), a folder of checkpoints, one
checkpoint (saved under any layout: DCP reads it whole), or the folder `python -m trainer.hf
import` wrote. The tokenizer is the model's: the one the checkpoint records (the run's
dataset's, or the one an import kept from the Hugging Face folder); --tokenizer (a
tokenizer.json or a folder holding one, or byte) must be that one, or fit the model's
vocabulary where none is recorded. --chat wraps the prompt as a user message in the
tokenizer's chat template, with the generation prompt. Prompt plus new tokens stay within the
sequence length the model was trained at. Generation stops at the end-of-document token.
Prints the continuation. Every bad flag is one line before the model is loaded.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from trainer.checkpoint.integrity import resolve

KEY = "RUN_OR_CHECKPOINT"
DEFAULT_NEW_TOKENS = 64


def checkpoint_of(path: Path) -> Path:
    runs_checkpoints = path / "checkpoints"
    return resolve(runs_checkpoints if runs_checkpoints.is_dir() else path, key=KEY)


def check_flags(args: argparse.Namespace) -> None:
    """The flags alone, before any file is read: one line naming the flag, its value and the
    fix."""
    if not args.prompt:
        raise ValueError("--prompt '' is empty: generation continues a text of at least one "
                         "token. Fix: pass the text to continue")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} is below 1. Fix: pass a "
                         f"positive count, or leave it out ({DEFAULT_NEW_TOKENS}, or what the "
                         f"model's context leaves)")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ValueError(f"--temperature {args.temperature} is not a finite number >= 0. Fix: "
                         f"pass 0 (greedy, the default) or a positive temperature such as 0.8")
    if not 0 < args.top_p <= 1:  # nan fails both
        raise ValueError(f"--top-p {args.top_p} is outside (0, 1] (the probability mass sampled "
                         f"from). Fix: pass e.g. 0.9, or 1 (no cut, the default)")
    if args.top_p < 1 and args.temperature == 0:
        raise ValueError(f"--top-p {args.top_p} with --temperature 0: greedy decoding takes the "
                         f"highest logit and never samples. Fix: pass --temperature above 0 to "
                         f"sample, or leave --top-p out")
    if not 0 <= args.seed < 2**64:
        raise ValueError(f"--seed {args.seed} is outside [0, 2**64) (torch's generator seed). "
                         f"Fix: pass a seed in that range")


def tokenizer_of(ckpt: Path, meta: dict, given: str | None, vocab_size: int):
    """(a tokenizer: trainer.data.tokenizer's, what chose it). The model's own: the one the
    checkpoint records (the run's dataset's, or the one an import kept); --tokenizer only where
    it is that one (the same vocabulary, e.g. a copy, or a folder with another chat template),
    or where none is recorded and its vocabulary fits the model's."""
    from trainer.data.dataset import load_tokenizer

    recorded, where, gone = meta.get("tokenizer"), f"recorded in {ckpt / 'meta.json'}", ""
    if not recorded and (ckpt / "tokenizer.json").is_file():
        recorded, where = str(ckpt), "kept by trainer.hf import"
    if recorded and recorded != "byte" and not Path(recorded).exists():
        if given is None:
            raise ValueError(f"{KEY}={ckpt}: the tokenizer the model was trained with, "
                             f"{recorded} ({where}), is not there any more. Fix: pass "
                             f"--tokenizer with a copy of it")
        # nothing to compare --tokenizer with but the model's vocabulary: said in `why`
        gone, recorded = f"; the model's, {recorded} ({where}), is gone: not compared", None
    if given is None and not recorded:
        raise ValueError(f"{KEY}={ckpt} records no tokenizer (a Megatron dataset's, or a run "
                         f"from before they were recorded). Fix: pass --tokenizer with the "
                         f"tokenizer.json the data was prepared with, or byte")
    tok = load_tokenizer(given or recorded)
    why = f"--tokenizer{gone}" if given else where
    if given and recorded:
        theirs = load_tokenizer(recorded)
        if _vocabulary(tok) != _vocabulary(theirs):
            sizes = (f"{tok.vocab_size} tokens against its {theirs.vocab_size}"
                     if tok.vocab_size != theirs.vocab_size else "the same size, other tokens")
            raise ValueError(f"--tokenizer {given} is not the tokenizer this model was trained "
                             f"with, {theirs.name} ({where}): {sizes}, so its ids would decode "
                             f"as garbage. Fix: leave --tokenizer out (the model's is used) or "
                             f"pass a copy of that one")
        why = f"--tokenizer, the model's: {where}"
    elif given and tok.vocab_size > vocab_size:  # the model's own may add a few (main checks)
        raise ValueError(f"--tokenizer {given}: {tok.vocab_size} tokens, more than the model's "
                         f"vocabulary of {vocab_size} (model.vocab_size), so it is not the one "
                         f"the model was trained with. Fix: pass that one")
    return tok, why


def _vocabulary(tok) -> dict | str:
    """What makes two tokenizers give the same ids: token -> id (the byte tokenizer: bytes)."""
    if tok.name == "byte":
        return tok.name
    return tok.tokenizer.get_vocab(with_added_tokens=True)


def new_tokens(prompt: int, asked: int | None, context: int | None) -> int:
    """How many tokens to generate after a prompt of `prompt` tokens. The model saw positions up
    to its training's train.seq_length (`context`) only: as Megatron's generation refuses a prompt
    plus tokens_to_generate beyond max_position_embeddings, a longer one is refused rather than
    decoded out of distribution (RoPE sets no hard limit, and the cache grows by concatenation,
    so nothing else would stop it); the default is cut to what the context leaves. A checkpoint
    that records no training (an import) has no context here: only --max-new-tokens bounds it."""
    if context is not None and prompt >= context:
        raise ValueError(f"--prompt is {prompt} tokens, and the model was trained on "
                         f"{context}-token samples (train.seq_length): no room for a "
                         f"continuation. Fix: shorten the prompt to fewer than {context} tokens")
    if asked is None:
        return DEFAULT_NEW_TOKENS if context is None else min(DEFAULT_NEW_TOKENS,
                                                              context - prompt)
    if context is not None and prompt + asked > context:
        raise ValueError(f"--max-new-tokens {asked}: the prompt's {prompt} tokens and {asked} "
                         f"new ones pass the {context} tokens the model was trained on "
                         f"(train.seq_length); positions past it are out of distribution. Fix: "
                         f"pass --max-new-tokens {context - prompt} or fewer")
    return asked


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainer.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path, metavar=KEY)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int,
                        help=f"default {DEFAULT_NEW_TOKENS}, or what the model's context leaves")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="of the sampling")
    parser.add_argument("--tokenizer", help="byte, a tokenizer.json or a folder holding one")
    parser.add_argument("--chat", action="store_true",
                        help="the prompt as a user message in the tokenizer's chat template")
    args = parser.parse_args(argv)
    try:
        check_flags(args)
        ckpt = checkpoint_of(args.path)
        from trainer.checkpoint.hf import read_model_config

        model_cfg = read_model_config(ckpt, None)
        meta = json.loads((ckpt / "meta.json").read_text())
        tok, why = tokenizer_of(ckpt, meta, args.tokenizer, model_cfg.vocab_size)
        prompt = args.prompt
        if args.chat:
            if tok.name == "byte":
                raise ValueError(f"--chat: the model's tokenizer is byte ({why}), which has no "
                                 f"chat template and no special tokens. Fix: leave --chat out")
            from trainer.data.chat import ChatEncoder

            prompt = ChatEncoder(tok).render([{"role": "user", "content": prompt}], "--prompt",
                                             generation_prompt=True)
        ids = tok.encode_text(prompt)
        if not ids:
            raise ValueError(f"--prompt {args.prompt!r} encodes to no tokens with {tok.name}. "
                             f"Fix: pass a prompt with text the tokenizer keeps")
        if max(ids) >= model_cfg.vocab_size:  # a tokenizer's added tokens the model lacks
            raise ValueError(f"--prompt encodes to id {max(ids)} with {tok.name}, past the "
                             f"model's vocabulary of {model_cfg.vocab_size} (model.vocab_size)."
                             f" Fix: leave that token out of the prompt")
        # The length it was trained at: checkpoints record it (those from before, in the
        # stream's identity, which a blend's lacks).
        context = meta.get("seq_length") or (meta.get("data") or {}).get("seq_length")
        max_new_tokens = new_tokens(len(ids), args.max_new_tokens, context)
    except (ValueError, FileNotFoundError) as error:
        parser.exit(2, f"error: {error}\n")
    bound = f"{context}-token context" if context else "no context recorded"
    print(f"{ckpt}: {model_cfg.name}, {model_cfg.num_layers} layers; tokenizer {tok.name} "
          f"({why}); prompt {len(ids)} tokens, up to {max_new_tokens} new ({bound})",
          file=sys.stderr, flush=True)
    from trainer.checkpoint.whole import load_model
    from trainer.model.generate import generate

    model = load_model(ckpt, model_cfg)
    started = time.perf_counter()
    out = generate(model, ids, max_new_tokens, args.temperature, args.top_p, tok.eod_id,
                   args.seed)
    seconds = time.perf_counter() - started
    print(tok.decode(out))
    print(f"{len(out)} tokens in {seconds:.1f} s ({len(out) / max(seconds, 1e-9):.1f} tokens/s)",
          file=sys.stderr)


if __name__ == "__main__":
    main()
