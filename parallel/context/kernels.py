"""Attention of one block of queries over one block of keys on PyTorch's own fused kernels, with
the log-sum-exp each returns, and the online-softmax merge of such blocks.

q, k, v are [batch, heads, seq, head_dim]; a block's log-sum-exp is [batch, heads, q seq], in
fp32 (fp64 for fp64 inputs), and so are the merged output and log-sum-exp. The backward of a
block takes the *merged* output and log-sum-exp: the kernels form the softmax from the
log-sum-exp and its correction term from the output, so each block then gets exactly its share
of the gradient of the whole row.

Kernels by device: CPU, the flash kernel for CPU (checked here, fp32, fp64 and bf16). CUDA, the
flash kernel for bf16/fp16 and the memory-efficient kernel for fp32 (the same entry points
torch's own ring attention uses, and, as there, each backward gets the auxiliary outputs of a
forward call of its shape); this path has not been run on a GPU in this repository yet
(bench/gpu_attention.py checks it where one is lent).
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F

from parallel.context.calls import ANTI, CAUSAL, FULL, Call

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)
_LSE_ALIGN = 32  # the memory-efficient kernel pads its log-sum-exp to a multiple of this


Aux = tuple  # what a CUDA kernel's forward returns for its backward besides out and lse


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: str
           ) -> tuple[torch.Tensor, torch.Tensor, Aux]:
    """(out in q's dtype, log-sum-exp, aux for attend_backward) of a call's shape (calls.py):
    CAUSAL and ANTI need as many queries as keys. ANTI runs causally on rows and keys both
    reversed, so the kernels' own causal skipping does its work too."""
    if shape == ANTI:
        out, lse, aux = _attend(*_reversed(q, k, v), True)
        return out.flip(2), lse.flip(2), aux
    return _attend(q, k, v, shape == CAUSAL)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
            ) -> tuple[torch.Tensor, torch.Tensor, Aux]:
    if q.device.type == "cuda":
        k, v = _expand_groups(k, q), _expand_groups(v, q)
        if q.dtype in _HALF:
            out, lse, *aux = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
            return out, lse, tuple(aux[:6])  # cum_seq_q, cum_seq_k, max_q, max_k, rng, unused
        out, lse, *aux = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0,
                                                                      causal)
        return out, lse[..., :q.shape[2]], tuple(aux)  # philox seed, offset
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return out, lse, ()


def attend_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, shape: str, aux: Aux
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one call, given the row's merged out (q's dtype) and log-sum-exp, and
    the aux of a forward call of the same shape (dropout-free dense calls: the same for all)."""
    if shape == ANTI:
        grads = _attend_backward(*_reversed(grad_out, q, k, v, out, lse), True, aux)
        return tuple(grad.flip(2) for grad in grads)
    return _attend_backward(grad_out, q, k, v, out, lse, shape == CAUSAL, aux)


def _reversed(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Rows (dim 2: the sequence of [batch, heads, seq, ...]) in reverse order."""
    return tuple(t.flip(2) for t in tensors)


def _attend_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor, lse: torch.Tensor, causal: bool, aux: Aux
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The CPU kernel takes strided slices as they are; the CUDA kernels get contiguous ones."""
    if q.device.type == "cuda":
        grad_out, lse = grad_out.contiguous(), lse.contiguous()
        groups = k.shape[1]
        k, v = _expand_groups(k, q), _expand_groups(v, q)
        if q.dtype in _HALF:
            cum_q, cum_k, max_q, max_k, rng, unused = aux
            dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
                grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, rng,
                unused)[:3]
        else:
            seed, offset = aux
            pad = -q.shape[2] % _LSE_ALIGN
            dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
                grad_out, q, k, v, None, out, F.pad(lse, (0, pad)), seed, offset, 0.0,
                [True, True, True, False], causal)
        return dq, _sum_groups(dk, groups), _sum_groups(dv, groups)
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, causal)


def _expand_groups(kv: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """K/V of fewer heads (grouped-query attention) repeated for their query heads: the CPU
    kernel reads the groups as they are; the CUDA kernels are given whole heads."""
    repeat = q.shape[1] // kv.shape[1]
    return kv if repeat == 1 else kv.repeat_interleave(repeat, dim=1)


def _sum_groups(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of _expand_groups: each group's query heads summed back."""
    b, heads, s, d = grad.shape
    return grad if heads == groups else grad.view(b, groups, heads // groups, s, d).sum(2)


class Merge:
    """The running softmax-weighted output of the local queries over the key blocks seen so
    far, by region (samples, rows): out = sum_i out_i * exp(lse_i - lse), lse = log sum_i
    exp(lse_i). A region starts empty (out 0, lse -inf), so its first block is taken as it is."""

    def __init__(self, q: torch.Tensor, dtype: torch.dtype):
        self.out = torch.zeros(q.shape, dtype=dtype, device=q.device)
        self.lse = torch.full(q.shape[:3], -torch.inf, dtype=dtype, device=q.device)

    def add(self, samples: slice, rows: slice, out: torch.Tensor, lse: torch.Tensor) -> None:
        mine, mine_lse = self.out[samples, :, rows], self.lse[samples, :, rows]
        merged = torch.logaddexp(mine_lse, lse)
        mine.mul_(torch.exp(mine_lse - merged)[..., None])
        mine.add_(out.to(merged.dtype).mul_(torch.exp(lse - merged)[..., None]))
        mine_lse.copy_(merged)


LOGIT_ROWS = 256  # query rows whose scores record_logits forms at once


@torch.no_grad()
def record_logits(q: torch.Tensor, k: torch.Tensor, calls: list[Call],
                  logits: torch.Tensor) -> None:
    """The largest attention logit (q.k scaled as the kernels scale it) each query head meets
    over the calls' query-key pairs, maxed into `logits` ([heads], fp32; QK-clip reads it).
    Scores are formed LOGIT_ROWS query rows at a time, so a call never holds rows x keys of
    every head at once beyond that."""
    scale = q.shape[-1] ** -0.5
    k = _expand_groups(k, q)
    for samples, rows, keys, shape in calls:
        wide = lse_dtype(q)  # fp32, fp64 for fp64 inputs
        qs, ks = q[samples, :, rows].to(wide), k[samples, :, keys].to(wide)
        n_keys = ks.shape[2]
        for first in range(0, qs.shape[2], LOGIT_ROWS):
            block = qs[:, :, first:first + LOGIT_ROWS]
            scores = torch.einsum("bhqd,bhkd->bhqk", block, ks) * scale
            if shape != FULL:  # CAUSAL: row r sees keys ..r; ANTI: keys r.. (calls.py)
                row = torch.arange(first, first + block.shape[2], device=q.device)[:, None]
                key = torch.arange(n_keys, device=q.device)[None, :]
                hidden = key > row if shape == CAUSAL else key < row
                scores.masked_fill_(hidden, -torch.inf)
            torch.maximum(logits, scores.amax(dim=(0, 2, 3)).to(logits.dtype), out=logits)


def attend_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, calls: list[Call],
                 merge: Merge, aux: dict, logits: torch.Tensor | None = None) -> None:
    """Every call (see calls.plan_calls) of local queries q over keys k, v, merged. aux:
    filled with each call's kernel aux, by its index. logits: where QK-clip's largest logits
    are recorded (None: not recorded)."""
    if logits is not None:
        record_logits(q, k, calls, logits)
    for i, (samples, rows, keys, shape) in enumerate(calls):
        out, lse, aux[i] = attend(q[samples, :, rows], k[samples, :, keys], v[samples, :, keys],
                                  shape)
        merge.add(samples, rows, out, lse)


def call_gradients(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, calls: list[Call], aux: dict
                   ) -> Iterator[tuple[slice, slice, slice, tuple[torch.Tensor, ...]]]:
    """The backward of attend_calls, call by call: (samples, query rows, key rows,
    (dq, dk, dv))."""
    for i, (samples, rows, keys, shape) in enumerate(calls):
        yield samples, rows, keys, attend_backward(
            grad_out[samples, :, rows], q[samples, :, rows], k[samples, :, keys],
            v[samples, :, keys], out[samples, :, rows], lse[samples, :, rows], shape, aux[i])


def kv_gradients(grad_out: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor, step: list[Call], aux: dict, dq: torch.Tensor,
               dkv: torch.Tensor | None = None) -> list:
    """The gradients of calls over one K/V buffer `kv` (k and v stacked; a ring step's, the
    window exchange's): their dq added into dq; their (samples, key rows, dk, dv) added into
    dkv as they come, or returned without dkv (the ring adds them once the block's arrive)."""
    key_grads = []
    for samples, rows, keys, (dq_call, dk, dv) in call_gradients(grad_out, q, kv[0], kv[1], out,
                                                                 lse, step, aux):
        dq[samples, :, rows] += dq_call
        key_grads.append((samples, keys, dk, dv))
        if dkv is not None:
            added_kv(dkv, key_grads)
            key_grads.clear()
    return key_grads


def added_kv(dkv: torch.Tensor, key_grads: list) -> torch.Tensor:
    """kv_gradients' returned (samples, key rows, dk, dv) added into dkv."""
    for samples, keys, dk, dv in key_grads:
        dkv[0][samples, :, keys] += dk
        dkv[1][samples, :, keys] += dv
    return dkv


def merged_output(merge: Merge, like: torch.Tensor, sinks: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse), with the sinks joined (add_sinks) where given; out in like's dtype, laid out
    [b, s, heads, d] in memory as the kernels' outputs are, so the model's reshape after
    attention is free."""
    if sinks is not None:
        add_sinks(merge, sinks)
    b, heads, s, d = like.shape
    out = like.new_empty(b, s, heads, d).transpose(1, 2)
    out.copy_(merge.out)
    return out, merge.lse


def add_sinks(merge: Merge, sinks: torch.Tensor) -> None:
    """Attention sinks (gpt-oss's; Megatron's softmax_type=learnable): a logit per head [heads]
    that joins every row's softmax denominator once, with a value of zero. Added after every
    block is merged, so once whatever the split of the keys: lse' = logaddexp(lse, sink) and
    out' = out exp(lse - lse'). The kernels' backward, given out' and lse', then forms the
    gradient of the softmax with the sink in it (its value adds nothing to dP)."""
    total = torch.logaddexp(merge.lse, sinks.to(merge.lse.dtype)[None, :, None])
    merge.out.mul_(torch.exp(merge.lse - total)[..., None])
    merge.lse.copy_(total)


def sink_gradient(grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  sinks: torch.Tensor) -> torch.Tensor:
    """The sinks' gradient from this rank's rows: -sum over rows of p_sink rowsum(dO o O),
    p_sink = exp(sink - lse') (out and lse with the sinks joined)."""
    rows = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # [b, heads, s]
    p_sink = torch.exp(sinks.to(lse.dtype)[None, :, None] - lse)
    return -(p_sink * rows).sum((0, 2)).to(sinks.dtype)


class ChunkPairs(torch.autograd.Function):
    """Local queries over keys and values in one buffer, by calls (calls.plan_calls), with
    sinks or without (None)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, calls: list[Call],
                sinks: torch.Tensor | None = None, logits: torch.Tensor | None = None):
        with torch.autocast(q.device.type, enabled=False):
            merge, aux = Merge(q, lse_dtype(q)), {}
            attend_calls(q, k, v, calls, merge, aux, logits)
            out, lse = merged_output(merge, q, sinks)
        ctx.calls, ctx.aux = calls, aux
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = (torch.zeros(t.shape, dtype=lse.dtype, device=t.device) for t in (q, k, v))
        for samples, rows, keys, grads in call_gradients(grad_out, q, k, v, out, lse, ctx.calls,
                                                         ctx.aux):
            for total, grad in zip((dq[samples, :, rows], dk[samples, :, keys],
                                    dv[samples, :, keys]), grads):
                total += grad
        d_sinks = None if sinks is None else sink_gradient(grad_out, out, lse, sinks)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, d_sinks, None


def lse_dtype(q: torch.Tensor) -> torch.dtype:
    """What the kernels' log-sum-exp comes in, and the merge accumulates in: fp32, fp64 for
    fp64 inputs."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32
