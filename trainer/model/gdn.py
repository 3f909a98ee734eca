"""Gated DeltaNet (Qwen3-Next's linear attention) as plain single-device PyTorch: the part
"gated_delta_net" (trainer.parts.gdn).

Each value head keeps a state S [key_dim, value_dim] instead of a growing key/value set, written
by the gated delta rule (trainer.model.delta_rule: chunked, and token by token). q, k and v
first pass a short causal convolution (model.linear_conv_kernel_dim taps per channel) and silu;
q and k are L2-normalised, q scaled by key_dim ** -0.5. The output is normed per head and gated
by silu(z) (a gated RMSNorm), then projected back. Within packed documents the state and the
convolution restart at every document's first token, exactly as separate sequences would.

`linear_attention_fn` is a plain function attribute (the convolution and the rule, from the
mixed q|k|v before the convolution, with the inputs and the state before them): selective
recompute wraps it, context parallel and generation's cache wrap it (parallel.context.linear:
the state relayed between ranks; trainer.model.generate).
`heads_fn` passes the per-head weights (the convolution's channels, the decay's A_log and
dt_bias), whole on every rank, through tensor parallel's narrowing to the rank's heads.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import ModelConfig
from trainer.model.delta_rule import gated_delta_rule, recurrent_gated_delta_rule

L2_EPS = 1e-6  # q and k's L2 norm: x / sqrt(sum x^2 + eps), flash-linear-attention's
# (mixed q|k|v [b, s, channels], conv weight [channels, width], g [b, s, value heads],
# beta [b, s, value heads], document ids of the whole sequence [b, S] or None, (key_dim,
# value_dim), before=None, state=None, recurrent=False) -> (o [b, s, v heads, v dim], state)
LinearAttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def document_ids(documents: torch.Tensor | None, device: torch.device
                 ) -> torch.Tensor | None:
    """[batch, seq] ids, equal within a document and different across (from documents: where
    each position's document starts, trainer.model.attention's AttentionFn); None: one
    document a sample."""
    if documents is None:
        return None
    starts = documents[:, 1:] != documents[:, :-1]
    ids = torch.cat([torch.zeros_like(documents[:, :1], dtype=torch.long),
                     starts.long().cumsum(1)], dim=1)
    return ids.to(device)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor | None = None,
                before: torch.Tensor | None = None, before_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
    """silu of the depthwise causal convolution of x [b, s, channels] by weight
    [channels, width] (tap width-1 on the token itself, as torch's conv1d with width-1 zeros
    of left padding); a tap never reaches into another document (ids [b, s]). `before`
    [b, width-1, channels]: the inputs before x (context parallel's previous chunk; None:
    zeros), of documents before_ids [b, width-1] (None: x's first)."""
    b, s, c = x.shape
    width = weight.shape[-1]
    if before is None:
        before = x.new_zeros(b, width - 1, c)
    padded = torch.cat([before.to(x.dtype), x], dim=1)  # the one copy its backward keeps
    if ids is not None:
        if before_ids is None:
            before_ids = ids[:, :1].expand(b, width - 1)
        padded_ids = torch.cat([before_ids, ids], dim=1)
    out = padded[:, width - 1:] * weight[:, -1]
    for d in range(1, width):  # the input d tokens back, by tap width-1-d
        tap = padded[:, width - 1 - d:width - 1 - d + s] * weight[:, width - 1 - d]
        if ids is not None:  # within the document only
            tap = tap * (padded_ids[:, width - 1 - d:width - 1 - d + s] == ids)[..., None]
        out = out + tap
    return F.silu(out)


def split_mixed(mixed: torch.Tensor, dims: tuple[int, int], value_heads: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [b, s, key heads, key_dim], k likewise and v [b, s, value heads, value_dim] of the
    convolved q|k|v (each part's heads in order)."""
    key_dim, value_dim = dims
    b, s, channels = mixed.shape
    key_width = (channels - value_heads * value_dim) // 2
    q, k, v = mixed.split([key_width, key_width, value_heads * value_dim], dim=-1)
    return (q.reshape(b, s, -1, key_dim), k.reshape(b, s, -1, key_dim),
            v.reshape(b, s, value_heads, value_dim))


def prepared(q: torch.Tensor, k: torch.Tensor, dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as the rule reads them: in `dtype`, L2-normalised, q scaled by key_dim ** -0.5
    (each key head serves its value heads inside the rule)."""
    q, k = q.to(dtype), k.to(dtype)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2_EPS) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2_EPS)
    return q, k


def linear_attention(mixed: torch.Tensor, conv_weight: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, ids: torch.Tensor | None, dims: tuple[int, int],
                     before: torch.Tensor | None = None, state: torch.Tensor | None = None,
                     recurrent: bool = False, before_ids: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's core on one process (its linear_attention_fn): the causal convolution and
    the rule, in fp32 at least, from the inputs before `mixed` (before, [b, width-1,
    channels], of documents before_ids: causal_conv) and the state after them (None: zeros;
    read by mixed's first document only) -> (o [b, s, value heads, value_dim] in the rule's
    dtype, the state after the last token). recurrent: token by token (generation's decode
    step)."""
    dtype = torch.promote_types(mixed.dtype, torch.float32)
    q, k, v = split_mixed(causal_conv(mixed, conv_weight.to(mixed.dtype), ids, before,
                                      before_ids), dims, g.shape[-1])
    with torch.autocast(mixed.device.type, enabled=False):  # its products in fp32, not bf16
        q, k = prepared(q, k, dtype)
        rule = recurrent_gated_delta_rule if recurrent else gated_delta_rule
        return rule(q, k, v.to(dtype), g.to(dtype), beta.to(dtype), ids, state)


def _identity(weight: torch.Tensor, parts: tuple[int, ...] = (1,)) -> torch.Tensor:
    return weight


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's output, times silu(z) (Qwen3-Next's RMSNormGated): normed in
    fp32 at least and cast back before the weight, as transformers'; its weight starts at
    one (not zero-centred). It keeps x and z alone (_GatedNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return _GatedNorm.apply(x, z, self.weight, self.eps)


def _normed(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x's RMS-normed copy in fp32 at least, rounded to x's dtype as transformers' norm rounds
    it before the weight; its rsqrt): one tensor of x's size in fp32 (and x's square for a
    moment)."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    rsqrt = torch.rsqrt(x.to(dtype).pow(2).mean(-1, keepdim=True) + eps)
    normed = x.to(dtype, copy=True).mul_(rsqrt)
    if normed.dtype != x.dtype:
        normed.copy_(normed.to(x.dtype))
    return normed, rsqrt


class _GatedNorm(torch.autograd.Function):
    """The gated norm keeping its inputs only (not five tensors of its output's size), both
    ways written out, mostly in place: its forward holds two such tensors (fp32) beside its
    output, its backward three beside the gradient it is given, and a fourth for a moment (a
    product it sums)."""

    @staticmethod
    def forward(ctx, x, z, weight, eps):
        ctx.eps = eps
        ctx.save_for_backward(x, z, weight)
        out, _ = _normed(x, eps)
        gate = F.silu(z.to(out.dtype))
        return out.mul_(weight).mul_(gate).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, z, weight = ctx.saved_tensors
        normed, rsqrt = _normed(x, ctx.eps)  # as the forward rounds it
        dtype = normed.dtype
        # d(silu(z)) = grad * w * normed, times silu'(z) = sigmoid (1 + z (1 - sigmoid))
        gate = torch.sigmoid(z.to(dtype))
        slope = (1 - gate).mul_(z).add_(1).mul_(gate)
        del gate
        d_z = (weight * normed).mul_(grad).mul_(slope).to(z.dtype)
        del slope
        d_weighted = F.silu(z.to(dtype)).mul_(grad)  # d(w * normed)
        d_weight = (d_weighted * normed).sum(tuple(range(x.ndim - 1))).to(weight.dtype) \
            if ctx.needs_input_grad[2] else None
        d_normed = d_weighted.mul_(weight)
        # RMSNorm: dx = rsqrt (dn - n mean(dn n))
        dot = (d_normed * normed).mean(-1, keepdim=True)
        d_x = d_normed.sub_(normed.mul_(dot)).mul_(rsqrt).to(x.dtype)
        return d_x, d_z, d_weight, None


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, block: int = 0):
        super().__init__()
        h, dk, dv = cfg.hidden_size, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.dims = (dk, dv)
        # One projection of six fused parts, Megatron's in_proj (and Qwen3.5's in_proj_qkv,
        # _z, _b, _a): q, k, v (the convolution's channels, in its order), the output gate z,
        # the write strength b and the decay's a, each of all heads in order. TP splits each
        # part by heads (a key head's value heads are next to each other, so the rank's value
        # heads are its key heads'); one GEMM, one input kept (and cast), one gather under SP.
        key, value, heads = cfg.linear_key_size, cfg.linear_value_size, \
            cfg.linear_num_value_heads
        self.in_parts = (key, key, value, value, heads, heads)
        self.in_proj = nn.Linear(h, sum(self.in_parts), bias=False)
        # Depthwise over q|k|v's channels (each part's heads in order), not a linear: whole on
        # every rank, each TP rank's channels read through heads_fn.
        self.conv_weight = nn.Parameter(torch.empty(
            2 * cfg.linear_key_size + cfg.linear_value_size, cfg.linear_conv_kernel_dim))
        # The decay: g = -exp(A_log) * softplus(a + dt_bias), per value head (Mamba's).
        self.A_log = nn.Parameter(torch.empty(cfg.linear_num_value_heads))
        self.dt_bias = nn.Parameter(torch.empty(cfg.linear_num_value_heads))
        self.norm = GatedRMSNorm(dv, cfg.norm_eps)
        self.out_proj = nn.Linear(cfg.linear_value_size, h, bias=False)
        self.conv_parts = self.in_parts[:3]  # q | k | v
        self.linear_attention_fn: LinearAttentionFn = linear_attention
        self.heads_fn = _identity

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        dv = self.dims[1]
        projected = self.in_proj(x)
        b, s = projected.shape[:2]
        # Widths from the projection, not the config: a tensor-parallel rank has fewer heads.
        # (Its width read outside the comprehension: a closure over `projected` would make
        # the `del` below one that torch.compile cannot trace.)
        width, total = projected.shape[-1], sum(self.in_parts)
        q, k, v, z, beta, a = projected.split([width * n // total for n in self.in_parts],
                                              dim=-1)
        # Each part as a tensor of its own (the core's input as its hook keeps it, z, beta and
        # the decay), then the projection let go: a view would keep all of it to the end.
        mixed = torch.cat([q, k, v], dim=-1)
        z = z.reshape(b, s, -1, dv).contiguous()
        beta = beta.sigmoid()
        fp32 = torch.promote_types(a.dtype, torch.float32)
        g = -self.heads_fn(self.A_log).to(fp32).exp() * F.softplus(
            a.to(fp32) + self.heads_fn(self.dt_bias).to(fp32))
        del projected, q, k, v, a
        conv = self.heads_fn(self.conv_weight, self.conv_parts)
        ids = document_ids(documents, mixed.device)  # of the whole sequence, as documents
        o, _ = self.linear_attention_fn(mixed, conv, g, beta, ids, self.dims)
        del mixed, g, beta
        o = self.norm(o.to(z.dtype), z)
        return self.out_proj(o.reshape(b, s, -1))
