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
    padded = torch.cat([before.to(x.dtype), x], dim=1)
    if ids is not None:
        if before_ids is None:
            before_ids = ids[:, :1].expand(b, width - 1)
        padded_ids = torch.cat([before_ids, ids], dim=1)
    out = x * weight[:, -1]
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


def prepared(q: torch.Tensor, k: torch.Tensor, value_heads: int, dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as the rule reads them: in `dtype`, L2-normalised, q scaled by key_dim ** -0.5,
    each key head repeated for the value heads that share it."""
    q, k = q.to(dtype), k.to(dtype)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2_EPS) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2_EPS)
    share = value_heads // q.shape[2]
    if share > 1:
        q, k = q.repeat_interleave(share, dim=2), k.repeat_interleave(share, dim=2)
    return q, k


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, ids: torch.Tensor | None = None,
                     state: torch.Tensor | None = None, chunk: int = CHUNK
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule. q, k [b, s, h, dk] (prepared), v [b, s, h, dv], g and beta
    [b, s, h], all in one dtype; ids [b, s] (document_ids) or None; state [b, h, dk, dv] the
    state before the first token (None: zeros), read by the first document only -> (o
    [b, s, h, dv], the state after the last token).

    Within a chunk the delta rule's writes are solved at once (a unit lower-triangular system:
    the UT transform), the state read and written once a chunk. Across documents every
    pairwise decay is zero, and so is a position's read of the carried state unless it is of
    the document the state belongs to: exact per document, with no loop over them."""
    b, s, h, dk = k.shape
    dv = v.shape[-1]
    pad = -s % chunk
    n = (s + pad) // chunk
    if ids is None:
        ids = torch.zeros(b, s, dtype=torch.long, device=q.device)
    # padded positions write nothing (k, v, beta zero) and decay nothing (g zero): the final
    # state is the last token's
    ids = torch.cat([ids, ids[:, -1:].expand(b, pad)], dim=1)  # of the last document
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)).transpose(1, 2).reshape(b, h, n, chunk, -1)
               for t in (q, k, v))
    g, beta = (F.pad(t, (0, 0, 0, pad)).transpose(1, 2).reshape(b, h, n, chunk)
               for t in (g, beta))
    ids = ids.view(b, 1, n, chunk)
    # the document of the state entering each chunk: the previous chunk's last token's
    prev = torch.cat([ids[:, :, :1, 0], ids[:, :, :-1, -1]], dim=2)[..., None]
    same = ids[..., :, None] == ids[..., None, :]  # [b, 1, n, C, C]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    cum = g.cumsum(-1)  # within the chunk; differences within a document are its decays
    pair = torch.where(same & causal, cum[..., :, None] - cum[..., None, :], -math.inf).exp()
    reads = torch.where(ids == prev, cum, -math.inf).exp()  # decay of the carried state
    last = ids[..., -1:]
    to_end = torch.where(ids == last, cum[..., -1:] - cum, -math.inf).exp()
    carried = torch.where(last[..., 0] == prev[..., 0], cum[..., -1], -math.inf).exp()

    k_beta = k * beta[..., None]
    strict = (k_beta @ k.transpose(-1, -2)) * pair
    system = strict.tril(-1)  # I + this: the writes' interaction within the chunk
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    values = torch.linalg.solve_triangular(system + eye, v * beta[..., None], upper=False,
                                           unitriangular=True)
    keys_read = torch.linalg.solve_triangular(system + eye, k_beta * reads[..., None],
                                              upper=False, unitriangular=True)
    within = (q @ k.transpose(-1, -2)) * pair
    q_read = q * reads[..., None]
    k_write = k * to_end[..., None]
    state = q.new_zeros(b, h, dk, dv) if state is None else state.to(q.dtype)
    out = []
    for i in range(n):
        new = values[:, :, i] - keys_read[:, :, i] @ state
        out.append(q_read[:, :, i] @ state + within[:, :, i] @ new)
        state = state * carried[:, :, i, None, None] + k_write[:, :, i].transpose(-1, -2) @ new
    o = torch.stack(out, dim=2).reshape(b, h, n * chunk, dv)[:, :, :s]
    return o.transpose(1, 2), state


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               g: torch.Tensor, beta: torch.Tensor,
                               ids: torch.Tensor | None = None,
                               state: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule token by token (the definition; generation's decode step): the state
    restarts at zero at each document's first token."""
    b, s, h, dk = k.shape
    state = q.new_zeros(b, h, dk, v.shape[-1]) if state is None else state.to(q.dtype)
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
        q, k = prepared(q, k, g.shape[-1], dtype)
        rule = recurrent_gated_delta_rule if recurrent else gated_delta_rule
        return rule(q, k, v.to(dtype), g.to(dtype), beta.to(dtype), ids, state)


def _identity(weight: torch.Tensor, parts: tuple[int, ...] = (1,)) -> torch.Tensor:
    return weight


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's output, times silu(z) (Qwen3-Next's RMSNormGated): normed in
    fp32 at least and cast back before the weight, as transformers'; its weight starts at
    one (not zero-centred)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)
        normed = x.to(dtype) * torch.rsqrt(x.to(dtype).pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * normed.to(x.dtype)
        return (out * F.silu(z.to(dtype))).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, block: int = 0):
        super().__init__()
        h, dk, dv = cfg.hidden_size, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.dims, self.share = (dk, dv), cfg.linear_num_value_heads // cfg.linear_num_key_heads
        # Per key head, q, k, then its value heads' v and z (transformers' and Qwen's grouped
        # order): a tensor-parallel split by rows keeps whole key heads with their value heads.
        self.in_proj_qkvz = nn.Linear(h, 2 * cfg.linear_key_size + 2 * cfg.linear_value_size,
                                      bias=False)
        # Per key head, its value heads' b (write strength) then a (decay), grouped likewise.
        self.in_proj_ba = nn.Linear(h, 2 * cfg.linear_num_value_heads, bias=False)
        # Depthwise over q|k|v's channels (each part's heads in order), not a linear: whole on
        # every rank, each TP rank's channels read through heads_fn.
        self.conv_weight = nn.Parameter(torch.empty(
            2 * cfg.linear_key_size + cfg.linear_value_size, cfg.linear_conv_kernel_dim))
        # The decay: g = -exp(A_log) * softplus(a + dt_bias), per value head (Mamba's).
        self.A_log = nn.Parameter(torch.empty(cfg.linear_num_value_heads))
        self.dt_bias = nn.Parameter(torch.empty(cfg.linear_num_value_heads))
        self.norm = GatedRMSNorm(dv, cfg.norm_eps)
        self.out_proj = nn.Linear(cfg.linear_value_size, h, bias=False)
        self.conv_parts = (cfg.linear_key_size, cfg.linear_key_size, cfg.linear_value_size)
        self.linear_attention_fn: LinearAttentionFn = linear_attention
        self.heads_fn = _identity

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        (dk, dv), share = self.dims, self.share
        qkvz, ba = self.in_proj_qkvz(x), self.in_proj_ba(x)
        # Heads from the projections, not the config: a tensor-parallel rank has fewer.
        b, s = qkvz.shape[:2]
        qkvz = qkvz.view(b, s, -1, 2 * dk + 2 * share * dv)
        q, k, v, z = qkvz.split([dk, dk, share * dv, share * dv], dim=-1)
        beta, a = ba.view(b, s, -1, 2 * share).split([share, share], dim=-1)
        mixed = torch.cat([q.reshape(b, s, -1), k.reshape(b, s, -1), v.reshape(b, s, -1)], -1)
        beta = beta.reshape(b, s, -1).sigmoid()
        fp32 = torch.promote_types(a.dtype, torch.float32)
        g = -self.heads_fn(self.A_log).to(fp32).exp() * F.softplus(
            a.reshape(b, s, -1).to(fp32) + self.heads_fn(self.dt_bias).to(fp32))
        conv = self.heads_fn(self.conv_weight, self.conv_parts)
        ids = document_ids(documents, mixed.device)  # of the whole sequence, as documents
        o, _ = self.linear_attention_fn(mixed, conv, g, beta, ids, self.dims)
        o = self.norm(o.to(z.dtype), z.reshape(b, s, -1, dv))  # in the compute dtype
        return self.out_proj(o.reshape(b, s, -1))
