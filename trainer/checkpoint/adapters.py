"""peft=lora's checkpoints hold the adapters alone (their weights and optimizer state, and the
model's buffers), and name the base they belong to in meta.json's "base": the checkpoint the
run loaded its frozen weights from (an import of a Hugging Face model, or any checkpoint), by
its folder and a fingerprint of its files' checksums, or the seed its weights were drawn from.
A LoRA checkpoint of a 70B model is its adapters' size, not 280 GB of a base it never changed.

Whoever loads a LoRA checkpoint (a resume, a fine-tune, an export) first finds its base: the
folder still there and the same files, or the same seed; anything else is one line naming both.
No torch here: the launcher checks before any rank starts.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from enum import Enum
from pathlib import Path
from typing import Any

from trainer.checkpoint.integrity import CHECKSUMS, read_meta, resolve, verify
from trainer.config import Config, PeftConfig

BASE = "base"  # meta.json's key


def peft_record(peft: PeftConfig) -> dict[str, Any]:
    """peft's keys as meta.json keeps them (an enum by its value)."""
    return {k: v.value if isinstance(v, Enum) else v for k, v in asdict(peft).items()}


def fingerprint(meta: dict[str, Any]) -> str:
    """A checkpoint's identity: its files' checksums (meta.json records them), hashed."""
    text = json.dumps(meta.get(CHECKSUMS, {}), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def base_record(config: Config) -> dict[str, Any] | None:
    """What a run's checkpoints name as their base (None: not a LoRA run): checkpoint.load's
    checkpoint, or that one's own base when it is a LoRA checkpoint, or the seed."""
    if config.peft is None:
        return None
    if config.checkpoint.load is None:
        return {"seed": config.train.seed}
    path = resolve(Path(config.checkpoint.load), None, lambda p: verify(p, None))
    meta = read_meta(path)
    if meta.get(BASE):
        return meta[BASE]
    return {"path": str(path.resolve()), "fingerprint": fingerprint(meta)}


def find_base(where: str, record: dict[str, Any], seed: int) -> Path | None:
    """The folder of a LoRA checkpoint's base, checked to be the one it was trained on (None:
    the base is the seed's initial weights, and this run's seed is that seed)."""
    if "seed" in record:
        if record["seed"] != seed:
            raise ValueError(f"{where} holds adapters of the base drawn from train.seed="
                             f"{record['seed']}, this run's seed is {seed}: other frozen "
                             f"weights. Fix: train.seed={record['seed']}.")
        return None
    path = Path(record["path"])
    try:
        meta = read_meta(path)
    except ValueError as error:
        raise ValueError(f"{where} holds adapters of the base {path}, which cannot be read "
                         f"({error}). Fix: restore that checkpoint there (a LoRA checkpoint "
                         f"holds the adapters only).") from None
    if fingerprint(meta) != record["fingerprint"]:
        raise ValueError(f"{where} holds adapters of the base {path}, whose files have changed "
                         f"since (fingerprint {fingerprint(meta)}, trained on "
                         f"{record['fingerprint']}): another base. Fix: restore the base it was "
                         f"trained on there.")
    return path


def base_of(path: Path) -> dict[str, Any] | None:
    """A checkpoint's base record: None unless it is a LoRA checkpoint."""
    return read_meta(path).get(BASE)
