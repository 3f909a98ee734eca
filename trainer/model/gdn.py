"""Gated DeltaNet (Qwen3-Next's linear attention) as plain single-device PyTorch: the part
"gated_delta_net" (trainer.parts.gdn).

Each value head keeps a state S [key_dim, value_dim] instead of a growing key/value set. Token t
decays it by exp(g_t), then writes its value with strength beta_t where the key already reads
something (the delta rule), and its query reads it:

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,   o_t = S_t^T q_t

q, k and v first pass a short causal convolution (model.linear_conv_kernel_dim taps per
channel) and silu; q and k are L2-normalised, q scaled by key_dim ** -0.5. The output is normed
per head and gated by silu(z) (a gated RMSNorm), then projected back.

`gated_delta_rule` is the chunked form (chunks of CHUNK tokens in parallel, the state carried
from chunk to chunk), `recurrent_gated_delta_rule` the token-by-token recurrence it is held to
(and what generation decodes with). Within packed documents the state and the convolution
restart at every document's first token, exactly as separate sequences would.

`linear_attention_fn` is a plain function attribute (the convolution and the rule, from the
mixed q|k|v before the convolution, with the inputs and the state before them): selective
recompute wraps it, context parallel and generation's cache wrap it (parallel.context.linear:
the state relayed between ranks; trainer.model.generate).
`heads_fn` passes the per-head weights (the convolution's channels, the decay's A_log and
dt_bias), whole on every rank, through tensor parallel's narrowing to the rank's heads.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import ModelConfig
from trainer.parts.gdn import CHUNK

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


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, ids: torch.Tensor | None = None,
                     state: torch.Tensor | None = None, chunk: int = CHUNK
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule. q, k [b, s, key heads, dk] (prepared), v [b, s, h, dv], g
    and beta [b, s, h] (h value heads, a multiple of the key heads), all in one dtype; ids
    [b, s] (document_ids) or None; state [b, h, dk, dv] the state before the first token
    (None: zeros), read by the first document only -> (o [b, s, h, dv], the state after the
    last token)."""
    b, s, h, dv = v.shape
    pad = -s % chunk
    n = (s + pad) // chunk
    if ids is None:
        ids = torch.zeros(b, s, dtype=torch.long, device=q.device)
    # padded positions write nothing (k, v, beta zero) and decay nothing (g zero): the final
    # state is the last token's
    ids = torch.cat([ids, ids[:, -1:].expand(b, pad)], dim=1).view(b, 1, n, chunk)
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)).transpose(1, 2).reshape(*t.shape[:1], -1, n,
                                                                      chunk, t.shape[-1])
               for t in (q, k, v))
    g, beta = (F.pad(t, (0, 0, 0, pad)).transpose(1, 2).reshape(b, h, n, chunk)
               for t in (g, beta))
    if state is None:
        state = q.new_zeros(b, h, q.shape[-1], dv)
    o, final = _ChunkedRule.apply(q, k, v, g, beta, ids, state.to(q.dtype))
    return o.reshape(b, h, n * chunk, dv)[:, :, :s].transpose(1, 2), final


class _ChunkedRule(torch.autograd.Function):
    """The chunks in order, each from the state the one before left (_chunk_step). It keeps
    its inputs and the state entering each chunk ([chunks, b, h, dk, dv]); backward walks the
    chunks in reverse, rebuilding one chunk's step at a time from them (flash-linear-
    attention's way): the rule keeps O(tokens + chunks x state), never a chunk's C x C
    matrices for the whole sequence, and backward holds one chunk's graph at a time."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, ids, state):
        n = v.shape[2]
        prev = torch.cat([ids[:, :, :1, 0], ids[:, :, :-1, -1]], dim=2)  # the entering state's
        # written in place chunk by chunk (a list then a stack would hold both at once)
        entering = state.new_empty(n, *state.shape)
        out = v.new_empty(*v.shape)
        for i in range(n):
            entering[i] = state
            out[:, :, i], state = _chunk_step(*(t[:, :, i] for t in (q, k, v, g, beta, ids)),
                                              prev[:, :, i], state)
        ctx.save_for_backward(q, k, v, g, beta, ids, prev, entering)
        return out, state

    @staticmethod
    def backward(ctx, d_out, d_state):
        q, k, v, g, beta, ids, prev, entering = ctx.saved_tensors
        grads = [torch.zeros_like(t) for t in (q, k, v, g, beta)]
        d_state = torch.zeros_like(entering[0]) if d_state is None else d_state
        for i in reversed(range(v.shape[2])):
            leaves = [t[:, :, i].detach().requires_grad_(True) for t in (q, k, v, g, beta)]
            start = entering[i].detach().requires_grad_(True)
            with torch.enable_grad():
                o, final = _chunk_step(*leaves, ids[:, :, i], prev[:, :, i], start)
            found = torch.autograd.grad([o, final], [*leaves, start], [d_out[:, :, i], d_state])
            for grad, d in zip(grads, found[:5]):
                grad[:, :, i] = d
            d_state = found[5]
        return (*grads, None, d_state)


def _chunk_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, ids: torch.Tensor, prev: torch.Tensor,
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: q, k [b, key heads, C, dk], v [b, h, C, dv], g, beta [b, h, C], ids [b, 1, C],
    prev [b, 1] (the document of `state`, [b, h, dk, dv]) -> (o [b, h, C, dv], the state after
    the chunk).

    The delta rule's writes within the chunk are solved at once (a unit lower-triangular
    system: the UT transform), the state read and written once. Across documents every
    pairwise decay is zero, and so is a position's read of the carried state unless it is of
    the state's document: exact per document, with no loop over them."""
    chunk, share = v.shape[2], v.shape[1] // k.shape[1]
    if share > 1:  # each key head serves `share` value heads
        q, k = q.repeat_interleave(share, dim=1), k.repeat_interleave(share, dim=1)
    same = ids[..., :, None] == ids[..., None, :]  # [b, 1, C, C]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    cum = g.cumsum(-1)  # within the chunk; differences within a document are its decays
    pair = torch.where(same & causal, cum[..., :, None] - cum[..., None, :], -math.inf).exp()
    reads = torch.where(ids == prev[..., None], cum, -math.inf).exp()  # the state's decay
    last = ids[..., -1:]
    to_end = torch.where(ids == last, cum[..., -1:] - cum, -math.inf).exp()
    carried = torch.where(last[..., 0] == prev, cum[..., -1], -math.inf).exp()
    k_beta = k * beta[..., None]
    system = ((k_beta @ k.transpose(-1, -2)) * pair).tril(-1)  # I + this: writes' interplay
    system = system + torch.eye(chunk, dtype=q.dtype, device=q.device)
    values = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False,
                                           unitriangular=True)
    keys_read = torch.linalg.solve_triangular(system, k_beta * reads[..., None], upper=False,
                                              unitriangular=True)
    new = values - keys_read @ state
    out = (q * reads[..., None]) @ state + ((q @ k.transpose(-1, -2)) * pair) @ new
    state = state * carried[..., None, None] + (k * to_end[..., None]).transpose(-1, -2) @ new
    return out, state


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               g: torch.Tensor, beta: torch.Tensor,
                               ids: torch.Tensor | None = None,
                               state: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule token by token (the definition; generation's decode step): the state
    restarts at zero at each document's first token."""
    b, s, h, dv = v.shape
    share = h // k.shape[2]
    if share > 1:
        q, k = q.repeat_interleave(share, dim=2), k.repeat_interleave(share, dim=2)
    state = q.new_zeros(b, h, k.shape[-1], dv) if state is None else state.to(q.dtype)
    out = []
    for t in range(s):
        if ids is not None and t > 0:
            state = state * (ids[:, t] == ids[:, t - 1]).to(q.dtype)[:, None, None, None]
        state = state * g[:, t].exp()[..., None, None]
        read = (state * k[:, t, :, :, None]).sum(-2)  # S^T k [b, h, dv]
        write = (v[:, t] - read) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * write[:, :, None, :]
        out.append((state * q[:, t, :, :, None]).sum(-2))
    return torch.stack(out, dim=1), state


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
        q, k, v, z, beta, a = projected.split(
            [projected.shape[-1] * n // sum(self.in_parts) for n in self.in_parts], dim=-1)
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
