"""prepare_throughput_vs_library: `trainer.prepare` with a Hugging Face tokenizer (a byte-level
BPE of 8,192 trained here on the same text) in tokens/s, over the tokenizers library's own batch
encoder on the same documents (read, encoded, nothing written), side by side, best of three.
The text is this Python's standard library source (a third of its files in quick mode, about
3.5 MiB), so nothing is downloaded.

    python bench/prepare_speed.py
"""
from __future__ import annotations

import json
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.data.dataset import BUILTIN_SKIP_DIRS, TokenDataset, find_files, prepare  # noqa: E402

VOCAB = 8192


def measure(quick: bool = True) -> dict:
    from tokenizers import Tokenizer

    files = find_files(Path(sysconfig.get_paths()["stdlib"]), ".py", BUILTIN_SKIP_DIRS)
    if quick:
        files = files[: len(files) // 3]
    folder = Path(tempfile.mkdtemp(prefix="prepare-speed-"))
    try:
        src = folder / "src"
        src.mkdir()
        for i, path in enumerate(files):  # one folder of plain files, as a user would have
            shutil.copyfile(path, src / f"{i:05d}.txt")
        started = time.perf_counter()
        trained = prepare(src, folder / "trained", 0.01, train_vocab_size=VOCAB)
        train_s = time.perf_counter() - started
        tokenizer_file = trained / "tokenizer.json"
        ours, theirs = [], []
        for attempt in range(3):
            out = folder / f"ours{attempt}"
            started = time.perf_counter()
            prepare(src, out, 0.01, tokenizer=tokenizer_file)
            ours.append(time.perf_counter() - started)
            tokens = TokenDataset.open(out).num_tokens
            shutil.rmtree(out)
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
            started = time.perf_counter()
            texts = [p.read_bytes().decode("utf-8", errors="replace")
                     for p in sorted(src.iterdir()) if p.stat().st_size]  # empty: no document
            encoded = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
            library_tokens = sum(len(e.ids) for e in encoded) + len(encoded)
            theirs.append(time.perf_counter() - started)
        assert tokens == library_tokens, (tokens, library_tokens)  # the same work
        megabytes = sum(p.stat().st_size for p in src.iterdir()) / 2**20
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"prepare_throughput_vs_library": round(min(theirs) / min(ours), 3),
            "ours_tokens_per_s": round(tokens / min(ours)),
            "library_tokens_per_s": round(tokens / min(theirs)),
            "tokens": tokens, "text_mib": round(megabytes, 1), "bpe_train_s": round(train_s, 2),
            "setup": f"byte-level BPE {VOCAB}, {len(files)} stdlib files, best of 3"}


if __name__ == "__main__":
    print(json.dumps(measure(), indent=1))
