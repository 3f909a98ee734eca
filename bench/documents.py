"""Packed documents and fine-tuning data: what reset_attention_mask saves, how fast prepare reads
JSON lines, and how full data.pack's samples are.

- reset_attention_mask over without: one process, a 2-layer model of hidden 256 and 8 heads at
  8,192 tokens a sample (attention is most of its step: its share, the fused attention kernels'
  self CPU time in one profiled step without documents, is reported), documents of ~1,024
  tokens (lengths drawn from 512 to 1,536); the two engines' steps alternate; median step with
  documents over without. Goal <= 0.6. The same under CP 4 (p2p ring, 4 gloo ranks).
- prepare from JSON lines over the tokenizers library: `trainer.prepare` of a .jsonl file (this
  Python's standard library sources, one a line) with a byte-level BPE of 8,192, in tokens/s,
  over the library's own batch encoder on the same lines (read, parsed, encoded, nothing
  written), best of three. Goal >= 0.8. Also `--workers 2` over `--workers 1` (the library's
  threads), each a fresh `python -m trainer.prepare`, best of two.
- packing efficiency: data.pack's tokens of data over tokens of samples on the offline stand-in
  chats (python -m trainer.hf standin: 2,000 arithmetic chats rendered with ChatML, ~70 tokens
  each) at train.seq_length 2,048 and at 256. Goal >= 0.95 (at 2,048).

    python bench/documents.py
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))
from ranks import run_ranks  # noqa: E402

from parallel.layout import Layout  # noqa: E402
from trainer.config import CPCommType, ModelConfig, OptimConfig  # noqa: E402
from trainer.plan.options import EngineOptions  # noqa: E402

SEQ, DOCUMENT = 8192, 1024
MODEL = ModelConfig(name="llama", vocab_size=512, hidden_size=256, num_layers=2, num_heads=8,
                    ffn_hidden_size=688, rope_theta=1e4, norm_eps=1e-5, init_std=0.02)
OPTIM = OptimConfig(name="adamw", weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8,
                    clip_grad=1.0)
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu",
                 "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def _starts() -> torch.Tensor:
    """[1, SEQ + 1] document starts: lengths drawn from 512 to 1,536 (mean 1,024)."""
    rng, begins, at = np.random.RandomState(0), np.zeros(SEQ + 1, dtype=np.int64), 0
    while True:
        at += int(rng.randint(DOCUMENT // 2, DOCUMENT * 3 // 2 + 1))
        if at > SEQ:
            return torch.from_numpy(begins)[None]
        begins[at:] = at


class _Samples:
    """A fixed batch served as a sample stream (trainer.train.batch.Samples)."""

    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens

    def get(self, indices):
        return self.tokens[list(indices)]

    def document_starts(self, indices):
        return _starts().expand(len(indices), -1)

    def loss_mask(self, indices):
        return None


def _steps(rank: int, layout: Layout, options: EngineOptions, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from trainer.train.batch import DocumentRules, rank_micro_batches
    from trainer.train.engine import build_engine
    from trainer.train.step import train_step

    gen = torch.Generator().manual_seed(0)
    samples = _Samples(torch.randint(0, MODEL.vocab_size, (layout.global_batch_size, SEQ + 1),
                                     generator=gen))
    rules = {"without": DocumentRules(),
             "with": DocumentRules(reset_attention_mask=True, reset_position_ids=True)}
    engines = {name: build_engine(MODEL, OPTIM, 0, layout, torch.device("cpu"), options)
               for name in rules}
    batches = {name: rank_micro_batches(samples, layout, rank, None, r)
               for name, r in rules.items()}
    times: dict[str, list[float]] = {name: [] for name in rules}
    for step in range(steps + 1):  # the first of each a warm-up
        for name in (list(rules) if step % 2 else list(rules)[::-1]):
            if dist.is_initialized():
                dist.barrier()
            start = time.perf_counter()
            train_step(engines[name].model, engines[name].optimizer, batches[name], 1e-4)
            if dist.is_initialized():
                dist.barrier()
            if step:
                times[name].append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_step(engines["without"].model, engines["without"].optimizer,
                   batches["without"], 1e-4)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    attention = sum(e.self_cpu_time_total for e in events if e.key in ATTENTION_OPS)
    return {"times": times, "attention_share": attention / total}


def reset_attention_mask(world: int, steps: int) -> dict:
    options = EngineOptions(cp_comm_type=CPCommType.p2p)
    layout = Layout(world, context_parallel_size=world, micro_batch_size=1, seq_length=SEQ)
    ranks = run_ranks(world, _steps, layout, options, steps)
    median = {name: statistics.median(max(r["times"][name][i] for r in ranks)
                                      for i in range(steps)) for name in ("with", "without")}
    documents = int((_starts()[0, 1:] != _starts()[0, :-1]).sum()) + 1
    return {"setup": f"{'one process' if world == 1 else f'CP {world} p2p, {world} gloo ranks'}"
                     f", {SEQ:,} tokens, {documents} documents of ~{DOCUMENT:,}, hidden "
                     f"{MODEL.hidden_size}, {MODEL.num_heads} heads, {MODEL.num_layers} layers, "
                     f"fp32, {steps} timed steps each, alternating",
            "step_s": {name: round(t, 4) for name, t in median.items()},
            "attention_share_without": round(statistics.mean(r["attention_share"]
                                                             for r in ranks), 3),
            "with_over_without": round(median["with"] / median["without"], 3)}


def _stdlib_jsonl(folder: Path, quick: bool) -> Path:
    from trainer.data.dataset import BUILTIN_SKIP_DIRS, find_files

    files = find_files(Path(sysconfig.get_paths()["stdlib"]), ".py", BUILTIN_SKIP_DIRS)
    if quick:
        files = files[: len(files) // 3]
    out = folder / "stdlib.jsonl"
    with open(out, "w") as f:
        for path in files:
            text = path.read_bytes().decode("utf-8", errors="replace")
            if text:
                f.write(json.dumps({"text": text}) + "\n")
    return out


def prepare_json_lines(quick: bool) -> dict:
    from tokenizers import Tokenizer

    from trainer.data.dataset import TokenDataset, prepare

    folder = Path(tempfile.mkdtemp(prefix="bench-jsonl-"))
    try:
        src = _stdlib_jsonl(folder, quick)
        tokenizer_file = prepare(src, folder / "trained", 0.0, train_vocab_size=8192) \
            / "tokenizer.json"
        ours, theirs = [], []
        for attempt in range(3):
            out = folder / f"ours{attempt}"
            started = time.perf_counter()
            prepare(src, out, 0.0, tokenizer=tokenizer_file)
            ours.append(time.perf_counter() - started)
            tokens = TokenDataset.open(out).num_tokens
            shutil.rmtree(out)
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
            started = time.perf_counter()
            with open(src) as f:
                texts = [json.loads(line)["text"] for line in f]
            encoded = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
            library_tokens = sum(len(e.ids) for e in encoded) + len(encoded)
            theirs.append(time.perf_counter() - started)
        assert tokens == library_tokens, (tokens, library_tokens)  # the same work
        workers = {}
        for n in (1, 2):
            runs = []
            for attempt in range(2):
                out = folder / f"workers{n}_{attempt}"
                started = time.perf_counter()
                subprocess.run([sys.executable, "-m", "trainer.prepare", str(src), str(out),
                                "--valid-fraction", "0", "--tokenizer", str(tokenizer_file),
                                "--workers", str(n)], cwd=ROOT, check=True, capture_output=True,
                               env={**os.environ, "TOKENIZERS_PARALLELISM": "true"})
                runs.append(time.perf_counter() - started)
                shutil.rmtree(out)
            workers[n] = min(runs)
        mib = src.stat().st_size / 2**20
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"setup": f"{mib:.1f} MiB of JSON lines (stdlib sources), byte-level BPE 8,192, "
                     f"best of 3",
            "ours_tokens_per_s": round(tokens / min(ours)),
            "library_tokens_per_s": round(tokens / min(theirs)),
            "ours_over_library": round(min(theirs) / min(ours), 3),
            "workers_2_over_1_tokens_per_s": round(workers[1] / workers[2], 3),
            "workers_s": {str(n): round(s, 2) for n, s in workers.items()}}


def packing() -> dict:
    from trainer.checkpoint.hf_standin import write_standin
    from trainer.data.dataset import TokenDataset, prepare
    from trainer.data.packing import Packs

    folder = Path(tempfile.mkdtemp(prefix="bench-pack-"))
    try:
        write_standin(folder / "model", folder / "chats.jsonl")
        ds = TokenDataset.open(prepare(folder / "chats.jsonl", folder / "chat", 0.0,
                                       folder / "model", chat=True))
        starts = np.asarray(ds.meta["doc_starts"])
        by_length = {seq: Packs(starts, 0, ds.num_tokens, seq + 1) for seq in (2048, 256)}
        sizes = np.diff(np.concatenate((starts, [ds.num_tokens])))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"setup": f"{len(sizes):,} stand-in chats of {sizes.min()} to {sizes.max()} tokens "
                     f"(mean {sizes.mean():.0f}), best fit decreasing",
            "efficiency": {str(seq): round(p.efficiency, 4) for seq, p in by_length.items()}}


def measure(quick: bool = True) -> dict:
    steps = 3 if quick else 5
    return {"reset_attention_mask": reset_attention_mask(1, steps),
            "reset_attention_mask_cp4": reset_attention_mask(4, steps),
            "prepare_json_lines": prepare_json_lines(quick),
            "packing": packing()}


if __name__ == "__main__":
    print(json.dumps(measure(), indent=1))
