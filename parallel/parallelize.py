"""parallelize: apply the layout to a single-device model from outside, by module name.

Each axis applies itself by the steps it registers (parallel.layout.axes), run by phase
(parallel.build): the pipeline cuts the model to this rank's stage (parallel.pipeline.steps),
the tensor axis replaces the linears and embedding by TP (+SP) layers with GTP_remat-sharded
weights (parallel.tensor), this rank's shards are allocated, then GTP_remat bundles each
block's gathers (parallel.bundle), context parallel injects its attention (parallel.context)
and the pipeline makes its chunk views. The model keeps its own code; what it holds afterwards
is this rank's shards, and its runner (parallel.pipeline.runner) runs the micro-batches in the
schedule's order.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from parallel.build import Build, CommOptions, Pruned, StagePart
from parallel.bundle import GradReduceQueue, ShardBundle
from parallel.experts import ExpertDispatch
from parallel.groups import Groups
from parallel.layout import Layout
from parallel.layout.axes import REGISTRY
from parallel.layout.parallel_plan import ParallelPlan
from parallel.layout.pipeline_schedules import SPLIT_BACKWARD
from parallel.pipeline.runner import PipelineRunner
from parallel.pipeline.stages import shared_weights
from parallel.tensor import (
    ParallelLinear,
    VocabParallelEmbedding,
    global_chunks,
    vocab_parallel_cross_entropy,
)
from parallel.weight_grads import DeferredWeightGrads

ParallelLayer = (ParallelLinear, VocabParallelEmbedding)
# (parameter name, its single-device shape, offsets, shape) -> that rectangle of its value
InitialValues = Callable[[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]], torch.Tensor]


class ParallelModel(nn.Module):
    """The parallelized model plus what the step needs: this rank's loss and gradient sync."""

    def __init__(self, module: nn.Module, groups: Groups, sequence_parallel: bool, head: str,
                 compute_dtype: torch.dtype = torch.float32,
                 bundles: list[ShardBundle] | None = None,
                 reduce_queue: GradReduceQueue | None = None, vocab_size: int | None = None,
                 stage: Stage | None = None, head_norms: tuple[str, ...] = (),
                 mixture: bool = False):
        super().__init__()
        # The pipeline stage this rank runs (all of the model without pipeline parallelism);
        # its chunk views are not submodules, so each parameter is registered once.
        self.stage = stage or Stage(StagePart([], True, True), [module], Pruned([], []))
        self.runner: PipelineRunner | None = None  # set by parallelize: runs the micro-batches
        self.module, self.groups, self.sequence_parallel = module, groups, sequence_parallel
        self.bundles, self.reduce_queue = bundles or [], reduce_queue
        # bf16: autocast the forward (and so the backward) while weights, gradients and
        # optimizer state stay in the parameters' fp32; the loss is computed in fp32.
        self.compute_dtype = compute_dtype
        self.layers = {n: m for n, m in module.named_modules() if isinstance(m, ParallelLayer)}
        sharded = {f"{n}.weight" for n in self.layers}
        # Experts split over EP (parallel.experts): parameter name -> its module's dispatch
        # and its name there (the experts' weights, and their LoRA factors under peft=lora).
        self.experts = {f"{n}.{p}": (m.dispatch, p) for n, m in module.named_modules()
                        if isinstance(getattr(m, "dispatch", None), ExpertDispatch)
                        for p, _ in m.named_parameters()}
        # Of those, what every ETP rank holds whole but forms a part of the gradient of (a
        # LoRA factor beside a split one): summed over ETP before the optimizer reads it.
        self.etp_whole_names = {n for n in self.experts if self.experts[n][0].split.size > 1
                                and self.experts[n][0].weights[self.experts[n][1]].whole}
        self.etp_whole = [p for n, p in module.named_parameters() if n in self.etp_whole_names]
        sharded |= set(self.experts)  # their gradients are summed by the optimizer alone
        # Whether the model has experts on some stage (its plan names them), this one or not.
        self.mixture = mixture
        # Whole on every rank of a weight tile (norms): gradients need a sum over gtp_remat, and
        # over TP too with SP (each TP rank saw different tokens); per-head norms (the plan's
        # head_norms) and column-parallel biases first, as their gradients are summed over TP
        # always (each TP rank saw other heads, or used other rows of the bias).
        whole = [(n, p) for n, p in module.named_parameters() if n not in sharded]
        column_biases = {f"{n}.bias" for n, m in self.layers.items()
                         if getattr(m, "bias", None) is not None and m.style == "column"}
        per_head = {n for n, _ in whole if n in column_biases
                    or any(n.removesuffix(".weight").endswith(s) for s in head_norms)}
        self.replicated = sorted(whole, key=lambda item: item[0] not in per_head)  # stable
        self.head_norm_count = len(per_head)
        self.vocab_start = (self.layers[head].tp.rank * self.layers[head].rows
                            if head in self.layers else 0)
        self.vocab_size = vocab_size  # logits of ids at or past it are padding

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        return self.forward_chunk(0, tokens, positions, documents)

    def forward_chunk(self, chunk: int, inputs: torch.Tensor, positions: torch.Tensor,
                      documents: torch.Tensor | None = None, *rest: torch.Tensor | None):
        """This rank's virtual pipeline chunk `chunk` (the whole model without pipelining):
        tokens or hidden states in, hidden states or logits out. documents: where each
        position's document starts, for the whole sequence (the model's AttentionFn); rest:
        what the model's forward takes after them (multi-token prediction's ids)."""
        autocast = self.compute_dtype != torch.float32
        with torch.autocast(inputs.device.type, dtype=self.compute_dtype, enabled=autocast):
            return self.stage.chunks[chunk](inputs, positions, documents, *rest)

    @property
    def stage_copies(self) -> set[str]:
        """Parameters this stage holds as a copy another stage owns (tied embeddings on the
        last stage): the owner's optimizer updates and saves them."""
        return {f"{h}.weight" for h in self.stage.pruned.holders}

    def finish_grads(self) -> None:
        """After the last backward of a step, before the optimizer reads a gradient: the
        sharded weights' reduce-scatters still overlapping that backward complete, then the
        replicated tensors' all-reduce, then the tied embedding's sum over its two stages. One
        call, in this order, so a step cannot leave one out or reorder the sums."""
        self._finish_grad_reduce()
        self._reduce_replicated_grads()
        self._reduce_etp_whole_grads()
        self._reduce_embedding_grads()

    def _reduce_embedding_grads(self) -> None:
        """Tied embeddings across stages: sum the shared weight's gradient over the embedding
        group (first and last stage), before the optimizer reads it. The copy's gradient is
        then used up: zeroed for the next step (like the optimizer's buffers, it stays)."""
        for name in self.stage.pruned.shared:
            param = self.module.get_parameter(name)
            if not param.requires_grad:  # frozen (peft=lora): no gradient on either stage
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            self.groups.embedding.all_reduce(param.grad)
            if name in self.stage_copies:
                param.grad.zero_()

    @torch.no_grad()
    def sync_stage_copies(self) -> None:
        """The owner's (first stage's) value of every shared weight into its copies: after an
        update or a load. Collective over the embedding group."""
        for name in self.stage.pruned.shared:
            self.groups.embedding.broadcast(self.module.get_parameter(name).data, root=0)

    def token_losses(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, labels, self.groups.tp, self.vocab_start,
                                            self.vocab_size)

    def is_sharded(self, name: str) -> bool:
        """A TP/GTP_remat-sharded weight (2-D)."""
        return name.removesuffix(".weight") in self.layers

    def is_expert(self, name: str) -> bool:
        """An expert weight, split over expert parallel (3-D)."""
        return name in self.experts

    def global_shape(self, name: str) -> tuple[int, ...]:
        layer = self.layers.get(name.removesuffix(".weight"))
        shape = tuple(self.module.get_parameter(name).shape)
        if name in self.experts:
            dispatch, within = self.experts[name]
            return dispatch.weights[within].shape
        return layer.full_shape if layer else shape

    def global_chunks(self, name: str, local: torch.Tensor
                      ) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        """Where the values of `local` (parameter `name` as this rank stores it, or a tensor
        of the same shape) sit in the single-device parameter: (offsets, view) pairs."""
        if name in self.experts:  # this rank's experts (dim 0), their ETP slice
            dispatch, within = self.experts[name]
            return dispatch.chunks(within, local)
        layer = self.layers.get(name.removesuffix(".weight"))
        if layer is None:  # whole on every rank
            return [((0,) * local.ndim, local)]
        return global_chunks(layer, local)

    @torch.no_grad()
    def initialize(self, values: InitialValues) -> None:
        """Fill every parameter this rank stores from the single-device model's initial values,
        asking only for the rectangles it holds (padding rows are zero), and every buffer
        (whole on each rank: a router's expert bias)."""
        for name, param in self.module.named_parameters():
            param.zero_()
            for offsets, view in self.global_chunks(name, param):
                view.copy_(values(name, self.global_shape(name), offsets, tuple(view.shape)))
        for name, buffer in self.module.named_buffers():
            shape = tuple(buffer.shape)
            buffer.copy_(values(name, shape, (0,) * buffer.ndim, shape))

    def wait_grad_reduces(self) -> None:
        """Wait for the gradient reduce-scatters still in flight (overlap_grad_reduce): the
        runner calls it after each backward pass, so their full-size messages never sit beside
        the next pass's activations."""
        if self.reduce_queue is not None:
            self.reduce_queue.finish()

    def _finish_grad_reduce(self) -> None:
        """After the last backward of a step: every sharded gradient is complete."""
        self.wait_grad_reduces()
        # A gathered weight kept past the step would be stale after the update.
        assert not any(b.live_gathers() for b in self.bundles), "gathered weights outlived use"
        owed = sum(b.uses_owed() for b in self.bundles)
        if owed:  # the step would update with part of its gradients
            raise RuntimeError(f"{owed} bundled linear use(s) of this step's forward got no "
                               f"backward: their weight gradients were never reduced")

    def _reduce_etp_whole_grads(self) -> None:
        """The experts' LoRA factors held whole over ETP: each ETP rank formed the part of
        their gradient its slice of the other factor gives; one all-reduce sums them."""
        grads = [p.grad for p in self.etp_whole if p.grad is not None]
        if grads:
            _reduce_coalesced(grads, self.groups.expert_tensor_parallel.all_reduce)

    def _reduce_replicated_grads(self) -> None:
        """Coalesced: one all-reduce per group for all small tensors."""
        held = [(i, p.grad) for i, (_, p) in enumerate(self.replicated) if p.grad is not None]
        if not held:
            return
        def reduce(flat: torch.Tensor) -> None:
            self.groups.gtp_remat.all_reduce(flat)
            if self.sequence_parallel:
                self.groups.tp.all_reduce(flat)
            elif self.head_norm_count:  # the per-head norms lead the flat tensor
                per_head = sum(g.numel() for i, g in held if i < self.head_norm_count)
                self.groups.tp.all_reduce(flat[:per_head])

        _reduce_coalesced([grad for _, grad in held], reduce)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter at its full single-device shape (collective over gtp_remat and tp,
        and expert_model_parallel and expert_tensor_parallel)."""
        out = {}
        for name, param in self.module.named_parameters():
            layer = self.layers.get(name.removesuffix(".weight"))
            if name in self.experts:
                dispatch, within = self.experts[name]
                out[name] = dispatch.full(within, param.detach())
            else:
                out[name] = param.detach().clone() if layer is None else \
                    layer.full_weight().clone()
        return out


def _reduce_coalesced(grads: list[torch.Tensor],
                      reduce: Callable[[torch.Tensor], object]) -> None:
    """Small gradients summed by one collective each: flattened into one tensor, reduced in
    place by `reduce`, copied back."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    reduce(flat)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()


@dataclass
class Stage:
    """The pipeline stage a rank runs: its part, one view of the model per virtual chunk, and
    what pruning the model for it kept only as a copy (tied embeddings)."""

    part: StagePart
    chunks: list[nn.Module]
    pruned: Pruned


def parallelize(model: nn.Module, plan: ParallelPlan, layout: Layout, groups: Groups, rank: int,
                device: torch.device, compute_dtype: torch.dtype = torch.float32,
                options: CommOptions = CommOptions(), vocab_size: int | None = None
                ) -> ParallelModel:
    """A model on the meta device comes back with this rank's parameters allocated on
    `device` but not initialised (ParallelModel.initialize); a real one keeps its values.
    The axes' steps run by phase (parallel.build), each phase in the registry's order.
    vocab_size: the head's logits from this id on are padding (excluded from the loss).
    A weight the model shares between layers (tied embeddings) stays one parameter: both
    replacements store the same shard, and autograd sums the two uses' gradients into it."""
    build = Build(model, plan, layout, groups, rank, options, options.dtypes(compute_dtype))
    if options.pipeline_schedule in SPLIT_BACKWARD:
        build.weight_grads = DeferredWeightGrads()
    _run(build, "cut")
    ties = shared_weights(model)  # before the layers are replaced: which weights are one
    _run(build, "shard")
    # Before anything keeps a reference to a parameter: moving off meta makes new ones.
    if any(p.device.type == "meta" for p in model.parameters()):
        model.to_empty(device=device)
    else:
        model.to(device)
    for name, owner in ties.items():  # after to_empty, which makes a new parameter per module
        _tie(model.get_submodule(name), model.get_submodule(owner), name, owner)
    _run(build, "wire")
    # What the steps made, as the model holds it: each block's bundle, in forward order.
    bundles = list(dict.fromkeys(m.bundle for m in model.modules()
                                 if isinstance(m, ParallelLinear) and m.bundle is not None))
    queue = bundles[0].reduce_queue if bundles else None
    stage = Stage(build.part, build.chunks or [model], build.pruned)
    parallel = ParallelModel(model, groups, build.sequence_parallel, plan.head, compute_dtype,
                             bundles, queue, vocab_size, stage, plan.head_norms,
                             bool(plan.experts))
    parallel.runner = PipelineRunner(parallel, layout, options.pipeline_schedule, plan.hidden_size,
                                     build.weight_grads)
    return parallel


def _run(build: Build, phase: str) -> None:
    """Every registered axis's step of `phase`, in the registry's order."""
    for axis in REGISTRY:
        if phase in axis.steps:
            module, _, function = axis.steps[phase].partition(":")
            getattr(importlib.import_module(module), function)(build)


def _tie(module: nn.Module, owner: nn.Module, name: str, owner_name: str) -> None:
    if module.weight.shape != owner.weight.shape or module.weight.dtype != owner.weight.dtype:
        raise ValueError(f"{name} shares {owner_name}'s weight, but their parallel shards differ "
                         f"({tuple(module.weight.shape)} vs {tuple(owner.weight.shape)})")
    module.weight = owner.weight
