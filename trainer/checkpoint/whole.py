"""A checkpoint, saved under any layout (or written by trainer.hf import), loaded whole into the
single-device model of one process: DCP reads each tensor's global chunks from whichever files
hold them, as a resume under another layout does (python -m trainer.generate)."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from trainer.checkpoint.hf import one_process
from trainer.config import ModelConfig
from trainer.model.transformer import Transformer


def load_model(ckpt: Path, model_cfg: ModelConfig, device: torch.device | None = None
               ) -> Transformer:
    """The model of `ckpt` (its config checked against the checkpoint by the caller:
    trainer.checkpoint.hf.read_model_config). Buffers the checkpoint lacks (an import's expert
    bias) keep their initial values."""
    model = Transformer(model_cfg)
    model.init_weights(0)  # every value is then read, but buffers an import lacks
    saved = set(dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata)
    state = {f"model.{n}": p.data for n, p in model.named_parameters()}
    state |= {f"model.{n}": b for n, b in model.named_buffers() if f"model.{n}" in saved}
    with one_process():
        dcp.load(state, checkpoint_id=ckpt, no_dist=True)
    return model.to(device) if device is not None else model
