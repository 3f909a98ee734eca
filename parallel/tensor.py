"""Tensor parallel layers (optionally sequence parallel) whose TP-local weights are GTP-sharded.

Each replaces a layer of the single-device model: it takes the layer's shape, and stores this
rank's TP slice with 1/G of that slice's rows (parallel.sharding). Built from a layer on the meta
device it allocates nothing; ParallelModel.initialize then fills each shard from the model's
initial values, so no rank ever holds a full weight. Built from a real layer it copies its slice.
With SP, activations between layers are split along the sequence (dim 1) over TP: gathered
before a column-parallel layer, reduce-scattered after a row-parallel one. A linear's bias is
whole on every rank (ParallelLinear.bias).
"""
from __future__ import annotations

import torch
from torch import nn

from parallel.build import Build
from parallel.bundle import ShardBundle, bundled_linear
from parallel.comm import Group
from parallel.regions import (
    all_gather_dim,
    copy_to,
    gather_along,
    reduce_from,
    scatter_along,
)
from parallel.sharding import (
    IN_MASTER_DTYPE,
    CommDtypes,
    gather_rows,
    shard_rows,
    sharded_embedding,
    sharded_linear,
)
from parallel.weight_grads import DeferredWeightGrads

SEQ_DIM = 1  # activations are [batch, seq, features]


class ParallelLinear(nn.Module):
    """column: output features split over TP; row: input features split over TP. A fused
    column layer (several `parts`, e.g. q|k|v, given as relative sizes: (heads, groups,
    groups) under grouped-query attention) splits each part over TP, so a rank's output is its
    slice of every part, in order and in the same proportions: the model still finds q, k and
    v by their shares.

    A bias (model.add_bias_linear, add_qkv_bias) stays whole on every rank, outside GTP_remat's
    shards: a column layer adds its rows of it (each fused part's TP slice, as the weight's
    rows), a row layer adds it once, after the all-reduce or the reduce-scatter. Whole, it is
    saved, initialised and counted like any 1-D tensor (a norm's); its gradient is summed over
    TP always for a column bias (each rank's covers its rows only: ParallelModel's per-head
    tensors) and, for a row bias, under SP only (each rank's covers its tokens), as a norm's."""

    def __init__(self, full: nn.Linear, style: str, tp: Group, gtp: Group,
                 sequence_parallel: bool, name: str, parts: tuple[int, ...] = (1,),
                 dtypes: CommDtypes = IN_MASTER_DTYPE):
        super().__init__()
        if style not in ("column", "row"):
            raise ValueError(f"{name}: style {style!r} is neither 'column' nor 'row'")
        self.style, self.tp, self.gtp, self.sequence_parallel = style, tp, gtp, sequence_parallel
        self.tp_dim = 0 if style == "column" else 1
        self.full_shape = tuple(full.weight.shape)
        if self.full_shape[self.tp_dim] % tp.size:
            raise ValueError(
                f"{name}: {self.full_shape[self.tp_dim]} "
                f"{'output' if style == 'column' else 'input'}"
                f" features do not split over tensor_model_parallel_size={tp.size}")
        self.part_rows = _part_rows(self.full_shape[0], parts)
        if (self.part_rows is None or any(r % tp.size for r in self.part_rows)
                or (len(parts) > 1 and style == "row")):
            raise ValueError(f"{name}: fused parts {parts} of {self.full_shape} do not split "
                             f"over tensor_model_parallel_size={tp.size}")
        self.dtypes = dtypes  # of its gathers when not bundled
        rows, cols = self.full_shape
        # self.rows: TP-local rows before GTP padding
        self.rows, local_cols = (rows // tp.size, cols) if style == "column" else (
            rows, cols // tp.size)
        self.weight = _shard_of(full.weight, self, (shard_rows(self.rows, gtp), local_cols))
        self.bias = None if full.bias is None else nn.Parameter(
            full.bias.detach().clone(), requires_grad=full.bias.requires_grad)
        self.bundle: ShardBundle | None = None  # set by join_bundle
        self.bundle_index = -1
        self.bundle_key: torch.Tensor | None = None  # the bundle's, read by its operators
        # A split backward's (parallel.weight_grads): set by shard_layers where the schedule
        # has one; the weight's gradient then waits for W.
        self.weight_grads: DeferredWeightGrads | None = None

    def join_bundle(self, bundle: ShardBundle) -> None:
        """Gather and reduce-scatter together with the bundle's other layers."""
        self.bundle, self.bundle_index = bundle, bundle.add(self.weight, self.rows)
        self.bundle_key = bundle.key

    def full_weight(self) -> torch.Tensor:
        """The single-device weight (collective over gtp_remat and tp)."""
        local = gather_rows(self.weight.detach(), self.gtp, self.rows)
        gathered = all_gather_dim(local, self.tp, self.tp_dim)  # [tp0 parts..., tp1 parts...]
        if len(self.part_rows) == 1:
            return gathered
        per_rank = gathered.view(self.tp.size, self.rows, -1)
        local_rows = [r // self.tp.size for r in self.part_rows]
        pieces = per_rank.split(local_rows, dim=1)  # each [tp, local rows of the part, cols]
        return torch.cat([p.reshape(-1, p.shape[-1]) for p in pieces]).reshape(self.full_shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.style == "column":
            x = gather_along(x, self.tp, SEQ_DIM) if self.sequence_parallel else copy_to(x, self.tp)
        if self.bundle_key is not None:  # (not the bundle: compiled, each would be a guard)
            y = bundled_linear(x, self.weight, self.bundle_key, self.bundle_index, self.rows)
        else:
            y = sharded_linear(x, self.weight, self.gtp, self.rows, self.dtypes,
                               self.weight_grads)
        if self.style == "row":
            sp = self.sequence_parallel
            y = scatter_along(y, self.tp, SEQ_DIM) if sp else reduce_from(y, self.tp)
        if self.bias is not None:
            bias = self.bias if self.style == "row" else self._rows_of_rank(self.bias)
            y = y + bias.to(y.dtype)  # (fp32 master bias, y in the compute dtype)
        return y

    def _rows_of_rank(self, full: torch.Tensor) -> torch.Tensor:
        """This TP rank's rows of a column layer's output-sized tensor: its slice of each
        fused part, in order (views joined: the gradient reaches only those rows)."""
        if self.tp.size == 1:
            return full
        slices = [part.narrow(0, self.tp.rank * (rows // self.tp.size), rows // self.tp.size)
                  for part, rows in zip(full.split(self.part_rows), self.part_rows)]
        return slices[0] if len(slices) == 1 else torch.cat(slices)


def global_chunks(layer: ParallelLinear | VocabParallelEmbedding, shard: torch.Tensor
                  ) -> list[tuple[tuple[int, int], torch.Tensor]]:
    """The rectangles of the single-device weight that this rank's shard holds, as (global
    offsets, view of `shard`), padding rows excluded. `shard` is the weight itself or anything
    of its shape (an optimizer moment): this is how checkpoints find every value's place."""
    per_rank = shard.shape[0]
    start = layer.gtp.rank * per_rank
    end = min(start + per_rank, layer.rows)  # TP-local rows this rank stores
    if end <= start:
        return []
    if layer.tp_dim == 1:  # row-parallel: all rows, this rank's block of columns
        return [((start, layer.tp.rank * shard.shape[1]), shard[:end - start])]
    # Column-parallel (and the vocabulary): TP-local rows are each part's TP slice, in order.
    chunks, local_start, global_start = [], 0, 0
    for rows in layer.part_rows:
        local = rows // layer.tp.size
        first, last = max(start, local_start), min(end, local_start + local)
        if first < last:  # this rank's stored rows that fall in this part
            offset = global_start + layer.tp.rank * local + first - local_start
            chunks.append(((offset, 0), shard[first - start:last - start]))
        local_start, global_start = local_start + local, global_start + rows
    return chunks


def _part_rows(rows: int, parts: tuple[int, ...]) -> tuple[int, ...] | None:
    """The rows of each fused part, `parts` being their relative sizes; None if uneven."""
    unit, rest = divmod(rows, sum(parts))
    return None if rest else tuple(unit * p for p in parts)


def _shard_of(full: torch.Tensor, layer: ParallelLinear | VocabParallelEmbedding,
              shape: tuple[int, int]) -> nn.Parameter:
    """The layer's shard parameter on `full`'s device: empty on meta, else `full`'s values
    at this rank's rectangles (padding rows zero)."""
    shard = torch.zeros(shape, dtype=full.dtype, device=full.device)
    if full.device.type != "meta":
        with torch.no_grad():
            for (row, col), view in global_chunks(layer, shard):
                view.copy_(full[row:row + view.shape[0], col:col + view.shape[1]])
    return nn.Parameter(shard, requires_grad=full.requires_grad)  # frozen stays frozen


class VocabParallelEmbedding(nn.Module):
    """Rows (the vocabulary) split over TP; each rank looks up the tokens in its range."""

    def __init__(self, full: nn.Embedding, tp: Group, gtp: Group, sequence_parallel: bool,
                 name: str, dtypes: CommDtypes = IN_MASTER_DTYPE):
        super().__init__()
        vocab = full.weight.shape[0]
        if vocab % tp.size:
            raise ValueError(f"{name}: vocabulary {vocab} does not split over "
                             f"tensor_model_parallel_size={tp.size}")
        self.tp, self.gtp, self.sequence_parallel = tp, gtp, sequence_parallel
        self.tp_dim, self.full_shape = 0, tuple(full.weight.shape)
        self.part_rows = (self.full_shape[0],)
        self.dtypes = dtypes
        self.rows = vocab // tp.size
        self.vocab_start = tp.rank * self.rows
        self.weight = _shard_of(full.weight, self, (shard_rows(self.rows, gtp), self.full_shape[1]))

    def full_weight(self) -> torch.Tensor:
        local = gather_rows(self.weight.detach(), self.gtp, self.rows)
        return all_gather_dim(local, self.tp, 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local_ids = ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.rows)
        out = sharded_embedding(local_ids.masked_fill(outside, 0), self.weight, self.gtp,
                                self.rows, self.dtypes)
        if self.tp.size > 1:
            out = out.masked_fill(outside[..., None], 0.0)
        if self.sequence_parallel:
            return scatter_along(out, self.tp, SEQ_DIM)
        return reduce_from(out, self.tp)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy of logits split over TP along the vocabulary (Megatron's
    formulation); full logits are never materialised on one rank."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, tp: Group, vocab_start: int):
        logits = logits.to(_at_least_fp32(logits.dtype))
        max_logit = tp.all_reduce(logits.max(dim=-1).values, torch.distributed.ReduceOp.MAX)
        shifted = logits - max_logit[..., None]
        local = labels - vocab_start
        outside = (local < 0) | (local >= logits.shape[-1])
        local = local.masked_fill(outside, 0)
        target = shifted.gather(-1, local[..., None]).squeeze(-1).masked_fill(outside, 0.0)
        tp.all_reduce(target)
        exp = shifted.exp()
        sum_exp = tp.all_reduce(exp.sum(dim=-1))
        softmax = exp.div_(sum_exp[..., None])
        ctx.save_for_backward(softmax, local, outside)
        return sum_exp.log() - target

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local, outside = ctx.saved_tensors
        grad = softmax.clone()
        own = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local[..., None], -own[..., None])
        return grad * grad_loss[..., None], None, None, None


def _at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, tp: Group,
                                 vocab_start: int, vocab_size: int | None = None) -> torch.Tensor:
    """logits [..., vocab / TP] -> per-token loss [...] (the same on every TP rank). Logits of
    ids >= vocab_size (a padded vocabulary's padding) are set to -inf in place: they take no
    probability and get no gradient, so the padded model computes what the unpadded one does."""
    valid = logits.shape[-1] if vocab_size is None else vocab_size - vocab_start
    if valid < logits.shape[-1]:
        logits[..., max(valid, 0):] = float("-inf")
    if tp.size == 1:
        logits = logits.to(_at_least_fp32(logits.dtype))
        return nn.functional.cross_entropy(logits.flatten(0, -2), labels.flatten(),
                                           reduction="none").view(labels.shape)
    return _VocabParallelCrossEntropy.apply(logits, labels, tp, vocab_start)


def shard_layers(build: Build) -> None:
    """The tensor axis's step of parallelize (shard, on the meta device): every linear and
    embedding the model's plan names is replaced by its TP (+SP) layer, which stores this
    rank's GTP_remat shard of the TP-local weight and keeps the layer's forward hooks (they
    see its local input and output) and whether it trains."""
    model, plan, sp = build.model, build.plan, build.sequence_parallel
    tp, gtp = build.groups.tp, build.groups.gtp_remat
    for name, child in list(model.named_modules()):
        for hook in plan.tp_shared_hooks:
            if tp.size > 1 and hasattr(child, hook):
                setattr(child, hook, _SharedOverTP(tp, sp))
        for hook in plan.tp_heads_hooks:
            if tp.size > 1 and hasattr(child, hook):
                setattr(child, hook, _HeadsOfRank(tp))
        if isinstance(child, nn.Embedding):
            replacement = VocabParallelEmbedding(child, tp, gtp, sp, name, build.dtypes)
        elif isinstance(child, nn.Linear):
            style, parts = plan.linear_style(name)
            if style == "whole":  # kept as it is: whole on every rank
                continue
            replacement = ParallelLinear(child, style, tp, gtp, sp, name, parts, build.dtypes)
            replacement.weight_grads = build.weight_grads
        else:
            continue
        for hook in child._forward_hooks.values():  # the model's own (LoRA's adapters)
            replacement.register_forward_hook(hook)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, replacement)


class _SharedOverTP:
    """A tensor every TP rank's heads read whole (the plan's tp_shared_hooks): with SP it is
    computed from the rank's own tokens and gathered along the sequence (its gradient, each
    rank's heads' share, reduce-scattered back); without, every rank computes it whole and
    its gradient is summed over TP. A class, not a closure: compiled blocks guard on it
    cheaply, and it pickles with the module."""

    def __init__(self, tp: Group, sequence_parallel: bool):
        self.tp, self.sequence_parallel = tp, sequence_parallel

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return gather_along(x, self.tp, SEQ_DIM)
        return copy_to(x, self.tp)


class _HeadsOfRank:
    """A weight with an entry per head, whole on every rank (the plan's tp_heads_hooks): this
    TP rank's heads' entries (the column-parallel projection's share; of each fused part, in
    order, where `parts` gives their relative sizes: Gated DeltaNet's convolution over q|k|v),
    views, so its gradient reaches only them; the plan's head_norms sum it over TP."""

    def __init__(self, tp: Group):
        self.tp = tp

    def __call__(self, weight: torch.Tensor, parts: tuple[int, ...] = (1,)) -> torch.Tensor:
        return share_of_parts(weight, _part_rows(weight.shape[0], parts), self.tp.size,
                              self.tp.rank)


def share_of_parts(x: torch.Tensor, sizes, count: int, index: int, dim: int = 0
                   ) -> torch.Tensor:
    """Of x's `dim`, made of fused parts of `sizes` (each of whole heads), the index-th of
    `count` equal slices of each part, joined in order (a TP rank's heads of q|k|v, a CP
    rank's); views where there is one part, so a gradient reaches only those entries."""
    slices = [part.narrow(dim, index * (n // count), n // count)
              for part, n in zip(x.split(list(sizes), dim=dim), sizes)]
    return slices[0] if len(slices) == 1 else torch.cat(slices, dim=dim)
