"""logger.sample_prompts: what a run has learned, as greedy continuations of a few prompts at
each evaluation. Every rank gives its parts of the weights (full_state_dict: collective over the
weight shards, TP and the experts' groups); rank 0 builds the single-device model from them and
generates with its KV cache (trainer.model.generate), in the run's compute device. The model is
held whole once more on rank 0 while it samples (the check refuses pipeline stages, which split
it across ranks)."""
from __future__ import annotations

import torch

from trainer.config import ModelConfig
from trainer.model.generate import generate
from trainer.model.transformer import Transformer


class Sampler:
    def __init__(self, model_cfg: ModelConfig, tokenizer_file: str | None, prompts: list[str],
                 max_new_tokens: int):
        from trainer.data.dataset import load_tokenizer

        self.model_cfg, self.prompts, self.max_new_tokens = model_cfg, prompts, max_new_tokens
        if tokenizer_file is None:
            raise ValueError("logger.sample_prompts needs the data's tokenizer, which a Megatron "
                             "dataset does not record")
        self.tok = load_tokenizer(tokenizer_file)

    @torch.no_grad()
    def sample(self, engine, rank: int, device: torch.device) -> list[dict] | None:
        """Collective. On rank 0: [{prompt, continuation}]; elsewhere None."""
        state = engine.model.full_state_dict()
        if rank != 0:
            return None
        model = Transformer(self.model_cfg)
        model.load_state_dict(state, strict=False)  # buffers (an expert bias) copied below
        for name, buffer in engine.model.module.named_buffers():
            model.get_buffer(name).copy_(buffer)
        model.to(device)
        out = []
        for prompt in self.prompts:
            ids = generate(model, self.tok.encode_text(prompt), self.max_new_tokens,
                           stop=self.tok.eod_id)
            out.append({"prompt": prompt, "continuation": self.tok.decode(ids)})
        return out
