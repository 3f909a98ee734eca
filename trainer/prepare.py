"""Command line: tokenize text, JSON lines or Parquet into a dataset the trainer reads.

    python -m trainer.prepare SRC [SRC ...] OUT_DIR [--valid-fraction F]
        [--tokenizer byte | TOKENIZER_JSON | FOLDER] [--train-tokenizer VOCAB_SIZE]
        [--eod-token TOKEN] [--json-key KEY] [--chat [--loss-on assistant|all]] [--preference]
        [--seq-length N] [--workers N] [--megatron PREFIX]

SRC: text files (one document each), .jsonl (one document a line, its --json-key field), .json
(an array of such records, or one a line), either compressed (.gz, .bz2, .xz, .zst), .parquet
(its --json-key column), or folders of them (trainer.data.inputs); a file it cannot read, or a
prepared dataset among them, is refused. --chat: JSON records of {"messages": [...]}, rendered
with the tokenizer's chat template, and a loss mask on the assistant's turns (trainer.data.chat).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

from trainer.data.dataset import TokenDataset, prepare
from trainer.data.megatron import check_new_prefix, write_indexed
from trainer.data.packing import Packs
from trainer.data.preference import pair_starts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainer.prepare", description=__doc__)
    parser.add_argument("src", type=Path, nargs="+",
                        help="text, JSON lines (.jsonl), JSON (.json), either compressed "
                             "(.gz|.bz2|.xz|.zst), or Parquet files, or folders")
    parser.add_argument("out_dir", type=Path, help="the dataset folder to write")
    parser.add_argument("--valid-fraction", type=float, default=0.01,
                        help="share of tokens held out as whole documents at the end (0.01)")
    parser.add_argument("--tokenizer", default="byte",
                        help="byte (default), or a Hugging Face tokenizer.json or a folder "
                             "holding one (read offline)")
    parser.add_argument("--train-tokenizer", type=int, metavar="VOCAB_SIZE",
                        help="train a byte-level BPE of this vocabulary on SRC first; it is "
                             "kept as OUT_DIR/tokenizer.json")
    parser.add_argument("--eod-token", help="the end-of-document token (default: the "
                                            "tokenizer's eos_token or a usual name)")
    parser.add_argument("--json-key", default="text",
                        help="the field of each JSON line, or the Parquet column, that holds "
                             "the text (Megatron's preprocess_data flag; default text)")
    parser.add_argument("--chat", action="store_true",
                        help="JSON records of {\"messages\": [...]}: rendered with the "
                             "tokenizer's chat template, with a loss mask")
    parser.add_argument("--preference", action="store_true",
                        help="JSON records of {\"prompt\", \"chosen\", \"rejected\"} (text, "
                             "or chat messages): two documents a pair, the loss mask on the "
                             "responses (train.objective=dpo)")
    parser.add_argument("--loss-on", choices=("assistant", "all"), default="assistant",
                        help="with --chat: which tokens the loss counts (assistant turns)")
    parser.add_argument("--seq-length", type=int, metavar="N",
                        help="report how full data.pack's samples of N tokens would be "
                             "(train.seq_length)")
    parser.add_argument("--workers", type=int, metavar="N",
                        help="threads of the tokenizers library's batch encoder (default: "
                             "every core)")
    parser.add_argument("--megatron", metavar="PREFIX",
                        help="also write the tokens as a Megatron-LM indexed dataset, "
                             "PREFIX.bin and PREFIX.idx (one sequence per document)")
    args = parser.parse_args(argv)
    if args.train_tokenizer is not None and args.tokenizer != "byte":
        parser.exit(2, f"error: --tokenizer {args.tokenizer} with --train-tokenizer "
                       f"{args.train_tokenizer}: both choose the tokenizer. Fix: pass one of "
                       f"them.\n")
    if args.seq_length is not None and args.seq_length < 1:
        parser.exit(2, f"error: --seq-length {args.seq_length}: a sample holds at least one "
                       f"token. Fix: pass train.seq_length, or leave --seq-length out\n")
    if args.workers is not None:
        if args.workers < 1:
            parser.exit(2, f"error: --workers {args.workers}: at least 1\n")
        # read by the tokenizers library when its thread pool starts (not imported yet)
        os.environ["RAYON_NUM_THREADS"] = str(args.workers)
    try:
        if args.megatron:  # before OUT_DIR is written, not after
            check_new_prefix(args.megatron)
        out = prepare(args.src, args.out_dir, args.valid_fraction, args.tokenizer,
                      args.train_tokenizer, args.eod_token, progress=True,
                      json_key=args.json_key, chat=args.chat, loss_on=args.loss_on,
                      preference=args.preference)
    except ValueError as e:
        parser.exit(2, f"error: {e}\n")
    ds = TokenDataset.open(out)
    size = (out / "tokens.bin").stat().st_size
    print(f"wrote {out}: tokens.bin ({size:,} bytes, {ds.meta['dtype']}), meta.json")
    eod = ds.meta.get("eod_id")
    print(f"  tokenizer {ds.meta['tokenizer']} (vocab {ds.vocab_size}"
          f"{'' if eod is None else f', end of document {eod}'}), {ds.num_tokens:,} tokens, "
          f"{len(ds.meta['doc_starts']):,} documents, {ds.fingerprint[:19]}...")
    if ds.loss_mask is not None:
        counted = ds.meta["counted_tokens"]
        print(f"  loss mask ({args.loss_on}): {counted:,} of {ds.num_tokens:,} tokens are "
              f"targets ({counted / ds.num_tokens:.1%})")
    for name in ("train", "valid"):
        start, end = ds.split(name)
        print(f"  {name}: tokens [{start:,}, {end:,}) = {end - start:,} tokens, "
              f"{ds.num_documents(name):,} documents")
        if args.seq_length and end > start:
            starts = np.asarray(ds.meta["doc_starts"])
            pairs = bool(ds.meta.get("preference"))  # each pair packed whole
            packs = Packs(pair_starts(starts) if pairs else starts, start, end,
                          args.seq_length + 1, inner=starts if pairs else None)
            print(f"    {packs.describe(name)}")
    if args.megatron:
        try:
            bin_path, idx_path = write_indexed(ds, args.megatron)
        except ValueError as e:
            parser.exit(2, f"error: {e}\n")
        print(f"wrote {bin_path} and {idx_path} (Megatron-LM indexed dataset, version 1): "
              f"data.path={args.megatron}")


if __name__ == "__main__":
    main()
