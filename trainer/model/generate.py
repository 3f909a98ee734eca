"""Text generation with the single-device model and a KV cache.

The cache is applied from outside, as context parallelism is: each attention's attention_fn is
replaced for the duration by one that keeps the keys and values it has seen and attends the new
queries over them (the prompt at once, causally; then one token a step, over everything). A
windowed block keeps only the last window + 1 keys (a sliding-window cache: all a new token may
see), and sinks join the new token's softmax as in training. The rest of the model runs as in
training, on the new tokens only, at their positions.

Decoding: temperature 0 is greedy (the highest logit; transformers' do_sample=False picks the
same tokens), otherwise the softmax of logits / temperature restricted to the smallest set of
tokens whose probability reaches top_p (nucleus sampling), drawn with a seeded generator: the
distribution transformers' TemperatureLogitsWarper and TopPLogitsWarper give on the same logits
(tests/integration/test_generate.py). Padding rows of the vocabulary are never chosen.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F

from parallel.context.calls import ALL, FULL
from parallel.context.kernels import ChunkPairs
from trainer.model.attention import causal_attention
from trainer.model.transformer import Transformer


class _CachedAttention:
    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 documents: torch.Tensor | None = None, window: int | None = None,
                 sinks: torch.Tensor | None = None, logits: torch.Tensor | None = None
                 ) -> torch.Tensor:
        first = self.k is None
        if not first and q.shape[2] != 1:
            raise ValueError("after the prompt, the cache takes one token at a time")
        keep = slice(None) if window is None else slice(-(window + 1), None)
        self.k = k if first else torch.cat((self.k, k), dim=2)[:, :, keep]
        self.v = v if first else torch.cat((self.v, v), dim=2)[:, :, keep]
        if first:  # the prompt: causal among itself, as in training
            out = causal_attention(q, k, v, None, window, sinks)
            self.k, self.v = self.k[:, :, keep], self.v[:, :, keep]
            return out
        # a new token: every key kept is before it and within its window
        if sinks is not None:
            calls = [(ALL, slice(0, 1), slice(0, self.k.shape[2]), FULL)]
            return ChunkPairs.apply(q, self.k, self.v, calls, sinks)
        return F.scaled_dot_product_attention(q, self.k, self.v,
                                              enable_gqa=self.k.shape[1] != q.shape[1])


class _CachedLinearAttention:
    """Gated DeltaNet's cache: the recurrent state and the convolution's last width-1 inputs
    (the prompt through the layer's chunked rule, then one token a step through its
    recurrence)."""

    def __init__(self, core) -> None:
        self.core = core  # the layer's linear_attention_fn
        self.state: torch.Tensor | None = None
        self.before: torch.Tensor | None = None

    def __call__(self, mixed: torch.Tensor, conv_weight: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor, ids: torch.Tensor | None, dims: tuple[int, int]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        first, width = self.state is None, conv_weight.shape[-1]
        if not first and mixed.shape[1] != 1:
            raise ValueError("after the prompt, the cache takes one token at a time")
        out, self.state = self.core(mixed, conv_weight, g, beta, None, dims, self.before,
                                    self.state, recurrent=not first)
        before = mixed.new_zeros(mixed.shape[0], width - 1, mixed.shape[-1]) if first \
            else self.before
        self.before = torch.cat([before, mixed], dim=1)[:, mixed.shape[1]:]
        return out, self.state


@contextlib.contextmanager
def kv_cache(model: Transformer) -> Iterator[None]:
    """Within: every attention of `model` caches its keys and values, every linear attention
    its state (one sequence)."""
    hooks = {"attention_fn": lambda fn: _CachedAttention(),
             "linear_attention_fn": _CachedLinearAttention}
    cached = [(m, hook) for m in model.modules() for hook in hooks if hasattr(m, hook)]
    saved = [getattr(m, hook) for m, hook in cached]
    for (module, hook), fn in zip(cached, saved):
        setattr(module, hook, hooks[hook](fn))
    try:
        yield
    finally:
        for (module, hook), fn in zip(cached, saved):
            setattr(module, hook, fn)


@torch.no_grad()
def generate(model: Transformer, prompt: list[int], max_new_tokens: int,
             temperature: float = 0.0, top_p: float = 1.0, stop: int | None = None,
             seed: int = 0) -> list[int]:
    """The tokens after `prompt` (at most max_new_tokens; `stop` ends it and is included)."""
    if not prompt:
        raise ValueError("the prompt is empty: generation needs at least one token to follow")
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    out: list[int] = []
    with kv_cache(model):
        tokens = torch.tensor([prompt], device=device)
        positions = torch.arange(len(prompt), device=device)[None]
        for _ in range(max_new_tokens):
            logits = model(tokens, positions)[0, -1, :model.vocab_size].float()
            token = next_token(logits, temperature, top_p, generator)
            out.append(token)
            if token == stop:
                break
            tokens = torch.tensor([[token]], device=device)
            positions = positions[:, -1:] + 1
    return out


def next_token(logits: torch.Tensor, temperature: float, top_p: float,
               generator: torch.Generator) -> int:
    """The token after `logits` (one position's, [vocab]): greedy at temperature 0, else drawn
    from `distribution` with `generator`."""
    if temperature == 0:
        return int(logits.argmax())
    return int(torch.multinomial(distribution(logits, temperature, top_p).cpu(), 1,
                                 generator=generator))


def distribution(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The probabilities a sampled token is drawn from (temperature > 0, 0 < top_p <= 1)."""
    # Shifted by the largest logit first: the same softmax, but a tiny temperature cannot turn
    # a logit into inf (and the softmax into nan).
    probs = torch.softmax((logits - logits.max()) / temperature, dim=-1)
    if top_p < 1:
        ordered, order = probs.sort(descending=True)
        # keep a token while the probability before it is below top_p (the first always)
        keep = ordered.cumsum(0) - ordered < top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], ordered[keep])
    return probs / probs.sum()
