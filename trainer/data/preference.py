"""Preference pairs: python -m trainer.prepare --preference, read by train.objective=dpo.

A line is {"prompt": ..., "chosen": ..., "rejected": ...}: three strings, or three lists of chat
messages (the prompt's turns, then the chosen or the rejected assistant turn(s)), rendered with
the tokenizer's chat template as --chat renders a conversation. Each pair becomes two documents,
side by side in the dataset: the prompt then the chosen response, and the prompt then the
rejected one, each with a loss mask over its response only (its end-of-document token counted,
as TRL counts the end of a completion). Pair i is documents 2i and 2i + 1; meta.json says
"preference": true. The split between train and valid falls between pairs, and data.pack packs
each pair whole (both documents in one sample, apart: trainer.data.packing).
"""
from __future__ import annotations

from typing import Any

import numpy as np


class PairEncoder:
    """Two documents (ids, loss mask) per pair: prompt + chosen, prompt + rejected."""

    def __init__(self, tok, chat=None):
        """chat: a trainer.data.chat.ChatEncoder for message pairs (None: text only)."""
        self.tok, self.chat = tok, chat

    def encode(self, pair: tuple[Any, Any, Any], where: str
               ) -> list[tuple[np.ndarray, np.ndarray]]:
        prompt, chosen, rejected = pair
        out = [self._one(prompt, response, f"{where} ({name})")
               for name, response in (("chosen", chosen), ("rejected", rejected))]
        for (_, mask), name in zip(out, ("chosen", "rejected")):
            if not mask.any():
                raise ValueError(f"{where}: the {name} response has no token (an empty "
                                 f"response). Fix: give it text, or drop the pair")
        return out

    def _one(self, prompt: Any, response: Any, where: str) -> tuple[np.ndarray, np.ndarray]:
        if isinstance(prompt, list):
            if self.chat is None:
                raise ValueError(f"{where}: chat messages need --tokenizer with a chat "
                                 f"template. Fix: pass a chat model's tokenizer folder")
            return self.chat.encode(prompt + response, where, from_message=len(prompt))
        first = np.asarray(self.tok.encode_text(prompt), dtype=np.int64)
        second = np.asarray(self.tok.encode_text(response), dtype=np.int64)
        eod = [] if getattr(self.tok, "eod_id", None) is None else [self.tok.eod_id]
        ids = np.concatenate([first, second, eod]).astype(np.int64)
        mask = np.zeros(ids.size, dtype=np.uint8)
        mask[first.size:] = 1  # the response and its end
        return ids, mask


def pair_starts(doc_starts: np.ndarray) -> np.ndarray:
    """Where each pair starts: its chosen document's first token."""
    return doc_starts[::2]
