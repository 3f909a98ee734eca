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

from parallel.context.chunks import Block

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)
_LSE_ALIGN = 32  # the memory-efficient kernel pads its log-sum-exp to a multiple of this


Aux = tuple  # what a CUDA kernel's forward returns for its backward besides out and lse


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
           ) -> tuple[torch.Tensor, torch.Tensor, Aux]:
    """(out in q's dtype, log-sum-exp, aux for attend_backward). `causal` needs as many queries
    as keys."""
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
                    out: torch.Tensor, lse: torch.Tensor, causal: bool, aux: Aux
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block, given the row's merged out (q's dtype) and log-sum-exp, and
    the aux of a forward call of the same shape (dropout-free dense calls: the same for all).
    The CPU kernel takes strided slices as they are; the CUDA kernels get contiguous ones."""
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
    """The running softmax-weighted output of one query block over the key blocks seen so
    far: out = sum_i out_i * exp(lse_i - lse), lse = log sum_i exp(lse_i)."""

    def __init__(self) -> None:
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None

    def add(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        out = out.to(lse.dtype)
        if self.out is None:
            self.out, self.lse = out, lse
            return
        merged = torch.logaddexp(self.lse, lse)
        self.out.mul_(torch.exp(self.lse - merged)[..., None])
        self.out.add_(out.mul_(torch.exp(lse - merged)[..., None]))
        self.lse = merged


def attend_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: list[Block],
                  chunk: int, merges: list[Merge], aux: dict) -> None:
    """Every block (see chunks.blocks) of local queries q over keys k, v, merged per query
    chunk; `chunk` tokens per chunk. aux: filled with each block shape's kernel aux."""
    for qi, k0, k1, causal in blocks:
        rows, keys = slice(qi * chunk, (qi + 1) * chunk), slice(k0 * chunk, k1 * chunk)
        out, lse, aux[k1 - k0, causal] = attend(q[:, :, rows], k[:, :, keys], v[:, :, keys],
                                                causal)
        merges[qi].add(out, lse)


def block_gradients(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, blocks: list[Block], chunk: int,
                    aux: dict) -> Iterator[tuple[slice, slice, tuple[torch.Tensor, ...]]]:
    """The backward of attend_blocks, block by block: (query rows, key rows, (dq, dk, dv))."""
    for qi, k0, k1, causal in blocks:
        rows, keys = slice(qi * chunk, (qi + 1) * chunk), slice(k0 * chunk, k1 * chunk)
        yield rows, keys, attend_backward(grad_out[:, :, rows], q[:, :, rows], k[:, :, keys],
                                          v[:, :, keys], out[:, :, rows], lse[:, :, rows],
                                          causal, aux[k1 - k0, causal])


def merged_output(merges: list[Merge], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the query chunks in order; out in like's dtype, laid out [b, s, heads, d]
    in memory as the kernels' outputs are, so the model's reshape after attention is free."""
    b, heads, s, d = like.shape
    out = like.new_empty(b, s, heads, d).transpose(1, 2)
    start = 0
    for merge in merges:
        size = merge.out.shape[2]
        out[:, :, start:start + size] = merge.out
        start += size
    return out, torch.cat([merge.lse for merge in merges], dim=2)
