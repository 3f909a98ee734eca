"""How a family's files lay out a tensor when not as our rows (the parameter viewed 2-D, as
hf_families.hf_parts counts them): its shape on disk and the map each way. trainer.checkpoint.hf
applies them one tensor at a time; the families say which tensors (hf_families.layouts)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Layout:
    """A Hugging Face tensor stored otherwise than our rows: `to_ours` takes it as read from the
    files to our rows, `to_theirs` back; each only moves elements (a permutation, a transpose,
    a reshape), so an import then an export is bit-exact. shape: on disk; None: our rows'."""

    to_ours: Callable[[torch.Tensor], torch.Tensor]
    to_theirs: Callable[[torch.Tensor], torch.Tensor]
    shape: tuple[int, ...] | None = None


def reordered(order: list[int]) -> Layout:
    """Rows stored in another order: ours = theirs[order] (DeepSeek's interleaved rotary rows)."""
    back = torch.tensor(order).argsort().tolist()
    return Layout(lambda rows: rows[order], lambda rows: rows[back])
