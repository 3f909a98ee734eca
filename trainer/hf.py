"""Command line: Hugging Face models in and out of checkpoints (Llama, Qwen3, Mixtral, Qwen3-MoE,
DeepSeek-V3, gpt-oss, Gemma 3: trainer.checkpoint.hf_families).

    python -m trainer.hf import HF_DIR OUT_DIR
        HF_DIR: config.json and model.safetensors (or a sharded set with its index).
        OUT_DIR: a weights-only checkpoint and OUT_DIR/model.yaml; fine-tune it under any
        layout with  python launch.py --config-dir OUT_DIR model=../model
                     checkpoint.load=OUT_DIR checkpoint.finetune=true ...
    python -m trainer.hf export CKPT_DIR HF_DIR [--model MODEL_YAML] [--dtype float32|bfloat16]
        CKPT_DIR: a checkpoint (step_XXXXXXXX) or a folder of them (the latest good one);
        the model config is the one the run recorded, or --model. The run's tokenizer (a
        Hugging Face one) is copied beside the weights.
    python -m trainer.hf standin HF_DIR CHATS_JSONL
        A stand-in for a downloaded chat model, made offline (needs transformers): a random
        tiny Llama with a ChatML tokenizer, and arithmetic chats to fine-tune it on.
"""
from __future__ import annotations

import argparse
import functools
import math
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainer.hf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="a Hugging Face model folder -> a checkpoint")
    imp.add_argument("hf_dir", type=Path)
    imp.add_argument("out_dir", type=Path)
    imp.add_argument("--adapter", type=Path, help="a LoRA adapter PEFT saved for this model "
                                                  "(adapter_config.json, adapter_model."
                                                  "safetensors), imported beside it")
    exp = sub.add_parser("export", help="a checkpoint -> a Hugging Face model folder")
    exp.add_argument("ckpt_dir", type=Path)
    exp.add_argument("hf_dir", type=Path)
    exp.add_argument("--model", type=Path, help="a model config YAML (default: the one the "
                                                "checkpoint's run recorded)")
    exp.add_argument("--dtype", choices=DTYPES, default="float32",
                     help="of the written weights (float32: the master weights as trained)")
    exp.add_argument("--max-shard-gb", type=float, default=5.0,
                     help="safetensors files are cut at this size, with an index (5)")
    exp.add_argument("--adapter-only", action="store_true",
                     help="peft=lora: write the adapters alone in PEFT's format "
                          "(adapter_config.json, adapter_model.safetensors); default: merged")
    exp.add_argument("--base", default=None,
                     help="with --adapter-only: the base model the adapter config names "
                          "(default: the checkpoint's folder)")
    standin = sub.add_parser("standin", help="a random tiny chat Llama and chats (offline)")
    standin.add_argument("hf_dir", type=Path)
    standin.add_argument("chats", type=Path)
    args = parser.parse_args(argv)
    if args.command == "export" and not (math.isfinite(args.max_shard_gb)
                                         and args.max_shard_gb > 0):
        parser.exit(2, f"error: --max-shard-gb {args.max_shard_gb:g} must be a finite number of "
                       f"GiB above 0. Fix: pass e.g. --max-shard-gb 5 (the default).\n")

    import torch  # after parsing: --help answers at once

    from trainer.checkpoint.hf import copy_tokenizer, export_hf, import_hf, read_model_config
    from trainer.checkpoint.integrity import resolve

    def progress(line: str) -> None:  # with the result lines: stderr is for errors
        print(line, flush=True)

    try:
        if args.command == "standin":
            from trainer.checkpoint.hf_standin import write_standin

            vocab = write_standin(args.hf_dir, args.chats)
            print(f"wrote {args.hf_dir} (a random Llama, vocabulary {vocab}, with a ChatML "
                  f"tokenizer) and {args.chats} (chats)")
        elif args.command == "import":
            from trainer.checkpoint.hf_lora import read_adapter, recorded_peft

            model = import_hf(args.hf_dir, args.out_dir, say=progress, adapter=None
                              if args.adapter is None else functools.partial(read_adapter,
                                                                             args.adapter))
            lora = ""
            if args.adapter is not None:
                peft = recorded_peft(args.out_dir)
                lora = (f" peft=lora peft.lora_rank={peft.lora_rank} peft.lora_alpha="
                        f"{peft.lora_alpha:g} peft.target_modules="
                        f"[{','.join(peft.target_modules)}]")
            print(f"wrote {args.out_dir}: a weights-only checkpoint of {model.num_layers} layers "
                  f"x hidden {model.hidden_size} (vocabulary {model.vocab_size}) and model.yaml."
                  f"\n  fine-tune: python launch.py --config-dir {args.out_dir} model=../model "
                  f"checkpoint.load={args.out_dir} checkpoint.finetune=true{lora}")
        else:
            from trainer.checkpoint.adapters import base_of, find_base
            from trainer.checkpoint.hf_lora import export_adapter, merge_into, recorded_peft

            ckpt = resolve(args.ckpt_dir, print, key="CKPT_DIR")
            peft, base = recorded_peft(ckpt), base_of(ckpt)
            # a LoRA checkpoint holds the adapters: the base's weights are in its base
            weights = ckpt
            if base and not args.adapter_only:
                if "path" not in base:
                    raise ValueError(f"{ckpt} holds adapters of the base drawn from train.seed="
                                     f"{base['seed']}, which no checkpoint holds. Fix: export "
                                     f"--adapter-only.")
                weights = find_base(str(ckpt), base, base.get("seed", 0))
            model = read_model_config(weights, args.model)
            if args.adapter_only and peft is None:
                raise ValueError(f"--adapter-only: {ckpt} holds no adapters (its run had "
                                 f"peft=null). Fix: leave --adapter-only out to export the "
                                 f"model.")
            if args.adapter_only:
                named = args.base or (base or {}).get("path") or str(ckpt)
                files = export_adapter(ckpt, args.hf_dir, model, peft, getattr(torch, args.dtype),
                                       named)
                print(f"wrote {args.hf_dir}: the LoRA adapter (rank {peft.lora_rank}) of {ckpt} "
                      f"in PEFT's format")
                return
            files = export_hf(weights, args.hf_dir, model, getattr(torch, args.dtype),
                              max(int(args.max_shard_gb * 2**30), 1), say=progress,
                              merge=merge_into(model, peft, ckpt) if peft else None)
            kept = copy_tokenizer(ckpt, args.hf_dir)
            print(f"wrote {args.hf_dir}: config.json and {len(files)} safetensors file(s) from "
                  f"{ckpt}{f', and the tokenizer of {kept}' if kept else ''}")
    except (ValueError, FileNotFoundError) as error:
        parser.exit(2, f"error: {error}\n")


if __name__ == "__main__":
    main()
