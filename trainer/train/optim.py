"""AdamW (or Muon with AdamW) with its state sharded over weight_replica (ZeRO-1 on top of the GTP
weight shards).

Parameters live as views into flat buffers: GTP-sharded weights, weights whole on every rank of
a weight tile (a router), norms (not decayed), and a mixture of experts' experts. Each rank of a
buffer's replica group owns one contiguous part of it: gradients are reduce-scattered onto the
parts, torch's own AdamW updates the parts in place, and the parts are all-gathered back into
the buffers. The replica group is weight_replica, but for the experts: expert_data_parallel, the
ranks holding the same experts (Megatron's expert DP; their gradients are summed there and only
there, as every rank of it saw other tokens).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from parallel.comm import Group
from parallel.layout import Layout
from parallel.parallelize import ParallelModel
from trainer.config import OptimConfig
from trainer.plan.memory import BUFFER_NAMES
from trainer.train.muon import MuonExchange
from trainer.train.qk_clip import QkClip

# AdamW's state tensors (torch's names); the buffers by kind in their order are the plan's
# (trainer.plan.memory.BUFFER_NAMES).
ADAM_STATES = ("exp_avg", "exp_avg_sq")
NS_DTYPES = {"master": None, "bf16": torch.bfloat16}

# Gradient elements squared in fp64 at a time for the norm: its transient is one fp64 chunk
# (8 MiB), where widening a whole part would cost 8 bytes per element the rank updates.
NORM_CHUNK = 1 << 20


@dataclass
class FlatBuffer:
    """Parameters (and their gradients) as views into one padded flat buffer per kind."""

    params: torch.Tensor  # [parts x part_size]
    grads: torch.Tensor
    part: torch.Tensor  # this rank's slice of `params`: what its AdamW updates
    counted: bool  # whether this rank's part enters the gradient norm
    slots: list[tuple[str, int, torch.Size]]  # (name, offset, shape) of each parameter
    replica: Group  # the ranks its parts are spread over
    # (start, end) ranges of this rank's part that another rank counts in the gradient norm
    # (a LoRA factor every ETP rank holds whole: ETP rank 0 counts it)
    uncounted: tuple[tuple[int, int], ...] = ()

    def ranges_of(self, names: set[str]) -> tuple[tuple[int, int], ...]:
        """Where parameters `names` lie in this rank's part, as (start, end) within it."""
        size = self.part.numel()
        lo = self.replica.rank * size
        out = []
        for name, offset, shape in self.slots:
            start, end = max(offset, lo), min(offset + shape.numel(), lo + size)
            if name in names and start < end:
                out.append((start - lo, end - lo))
        return tuple(out)

    def part_of(self, flat: torch.Tensor) -> torch.Tensor:
        size = self.part.numel()
        return flat[self.replica.rank * size:(self.replica.rank + 1) * size]

    @classmethod
    def build(cls, named: list[tuple[str, torch.nn.Parameter]], replica: Group, layout: Layout,
              counted: bool, experts: bool = False) -> FlatBuffer:
        params = [p for _, p in named]
        part_size = layout.optimizer_part(sum(p.numel() for p in params), experts)
        assert replica.size == layout.optimizer_replicas(experts)
        first = params[0]
        flat = first.new_zeros(part_size * replica.size)
        grads = torch.zeros_like(flat)
        offset, slots = 0, []
        for name, p in named:
            n = p.numel()
            slots.append((name, offset, p.shape))
            flat[offset:offset + n].copy_(p.detach().reshape(-1))
            p.data = flat[offset:offset + n].view_as(p)
            # Autograd accumulates in place into an existing .grad, so grads land in the buffer.
            p.grad = grads[offset:offset + n].view_as(p)
            offset += n
        part = flat[replica.rank * part_size:(replica.rank + 1) * part_size]
        return cls(flat, grads, part, counted, slots, replica)


class ShardedOptimizer:
    """optim=adamw: AdamW on every parameter. optim=muon: Muon on the hidden matrices
    (trainer.parts.matrices; trainer.train.muon orthogonalises them), AdamW on the
    rest. Both keep their state sharded over each buffer's replicas."""

    def __init__(self, model: ParallelModel, cfg: OptimConfig, layout: Layout,
                 muon: MuonChoice | None = None, qk_clip: QkClip | None = None):
        groups = model.groups
        self.world, self.clip, self.cfg = groups.world, cfg.clip_grad, cfg
        # QK-clip after each update (None: off); the step's largest attention logit
        self.qk_clip, self.max_attention_logit = qk_clip, None
        muon = muon or MuonChoice(frozenset(), lambda name: ())
        # Flat buffers (trainer.plan.memory: SHARDED, WHOLE, NORMS, EXPERTS, then Muon's):
        # sharded weights; weights every rank of a weight tile holds whole (a router), decayed
        # too; norms, whole and not decayed; experts, split over EP, decayed; and the matrices
        # Muon takes of the sharded, whole and expert ones.
        kinds: dict[str, list] = {k: [] for k in BUFFER_NAMES}
        for name, param in model.module.named_parameters():
            if name in model.stage_copies or not param.requires_grad:
                continue  # another stage owns it (tied embeddings), or it is frozen (LoRA's base)
            if model.is_expert(name):
                kind = "experts"
            elif model.is_sharded(name):
                assert param.ndim == 2, f"{name}: a sharded weight is 2-D"
                kind = "sharded"
            else:
                kind = "whole" if param.ndim >= 2 else "norms"
            if name in muon.names:
                kind = "muon_" + kind
            kinds[kind].append((name, param))
        # Whole tensors are on every rank of a weight tile: count them once. Each rank's part
        # of the experts' buffer is its own (other experts over EP, other parts over expert DP).
        tile_root = groups.tp.rank == 0 and groups.gtp_remat.rank == 0
        replica, expert_replica = groups.weight_replica, groups.expert_data_parallel
        self.buffers, param_groups, self.muon = [], [], []
        steps, split = cfg.muon_num_ns_steps, muon.blocks_of
        for kind in BUFFER_NAMES:
            params = kinds[kind]
            if not params:
                continue
            experts = kind.endswith("experts")
            group = expert_replica if experts else replica
            counted = tile_root if kind.endswith(("whole", "norms")) else True
            buffer = FlatBuffer.build(params, group, layout, counted, experts)
            if experts and groups.expert_tensor_parallel.rank > 0:  # counted on ETP rank 0
                buffer.uncounted = buffer.ranges_of(model.etp_whole_names)
            self.buffers.append(buffer)
            if kind.startswith("muon_"):
                tile = groups.expert_tensor_parallel if experts else groups.weight_tile
                whole = {name for name, _ in params} if kind == "muon_whole" else set()
                exchange = MuonExchange(model, buffer.slots, tile, group, split, whole, steps,
                                        cfg.muon_scale_mode, cfg.muon_extra_scale_factor,
                                        NS_DTYPES[cfg.muon_ns_dtype])
                start = group.rank * buffer.part.numel()
                self.muon.append(MuonBuffer(buffer, exchange,
                                            exchange.runs(start, buffer.part.numel()),
                                            torch.zeros_like(buffer.part)))
                continue
            # wd_mult: Megatron's multiplier of the step's weight decay (0: norms, never).
            wd_mult = 0.0 if kind == "norms" else 1.0
            param_groups.append({"params": [buffer.part], "wd_mult": wd_mult,
                                 "weight_decay": cfg.weight_decay * wd_mult})
        # foreach=False: the same per-tensor kernels as a plain single-process AdamW.
        self.adam = torch.optim.AdamW(param_groups or [{"params": []}], lr=0.0,
                                      betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                      foreach=False)

    def zero_grad(self) -> None:
        for buffer in self.buffers:
            buffer.grads.zero_()
        if self.qk_clip is not None:  # a step's record starts empty
            self.qk_clip.reset()

    @torch.no_grad()
    def reduce_gradients(self) -> float:
        """Reduce-scatter gradients over each buffer's replicas; the global gradient norm
        (before clipping). Nothing is updated yet, so a caller can refuse a non-finite step."""
        for buffer in self.buffers:
            # The summed part lands in this rank's own slice of the gradient buffer, so the
            # optimizer holds no second copy of it.
            part_grad = buffer.part_of(buffer.grads)
            if buffer.replica.size > 1:
                part_grad.copy_(buffer.replica.reduce_scatter(buffer.grads))
            buffer.part.grad = part_grad
        square = torch.zeros((), dtype=torch.float64, device=self.buffers[0].part.device)
        for buffer in self.buffers:
            if buffer.counted:  # widened to fp64 a chunk at a time, not the whole part
                for chunk in buffer.part.grad.split(NORM_CHUNK):
                    wide = chunk.double()
                    square += torch.dot(wide, wide)
                    del wide  # else held while the next buffer's first chunk is widened
                for start, end in buffer.uncounted:
                    wide = buffer.part.grad[start:end].double()
                    square -= torch.dot(wide, wide)
        return self.world.all_reduce(square).sqrt().item()

    @torch.no_grad()
    def update(self, lr: float, grad_norm: float, weight_decay: float | None = None) -> None:
        """Clip by the global norm, update this rank's parts, all-gather them. weight_decay:
        this step's, for the decayed buffers (None: optim.weight_decay as built)."""
        if self.clip is not None:
            # torch.nn.utils.clip_grad_norm_'s rule, so one process clips identically.
            scale = min(self.clip / (grad_norm + 1e-6), 1.0)
            if scale < 1.0:
                for buffer in self.buffers:
                    buffer.part.grad.mul_(scale)
        for group in self.adam.param_groups:
            group["lr"] = lr
            if weight_decay is not None and "wd_mult" in group:
                group["weight_decay"] = weight_decay * group["wd_mult"]
        self.adam.step()
        decay = self.cfg.weight_decay if weight_decay is None else weight_decay
        for muon in self.muon:
            muon.step(lr, decay, self.cfg.muon_momentum, self.cfg.muon_nesterov)
        for buffer in self.buffers:  # with one replica the part is the whole buffer, in place
            if buffer.replica.size > 1:
                buffer.replica.all_gather_into(buffer.params, buffer.part.clone())
        if self.qk_clip is not None:  # on the updated weights, every rank's pieces alike
            self.max_attention_logit = self.qk_clip.clip()

    # ------------------------------------------------------------------ checkpoint support
    # The state leaves and enters as whole flat buffers (every replica's part), so each state
    # tensor can be viewed at its parameter's local shape and saved at the parameter's offsets:
    # AdamW's exp_avg and exp_avg_sq, Muon's momentum_buffer (torch's names).

    def _muon_of(self, buffer: FlatBuffer) -> MuonBuffer | None:
        """The Muon side of `buffer`, or None for an AdamW buffer."""
        return next((m for m in self.muon if m.buffer is buffer), None)

    def _states(self, buffer: FlatBuffer) -> dict[str, torch.Tensor] | None:
        """This rank's part of each state tensor of `buffer` (None before AdamW's first step:
        every moment is zero)."""
        muon = self._muon_of(buffer)
        if muon is not None:
            return {"momentum_buffer": muon.momentum}
        state = self.adam.state.get(buffer.part)
        return {k: state[k] for k in ADAM_STATES} if state else None

    def state_tensors(self) -> list[torch.Tensor]:
        """What this rank's optimizer state holds: AdamW's moments of its parts (once made by
        the first step), Muon's momentum of its parts."""
        adam = [v for state in self.adam.state.values() for v in state.values()
                if isinstance(v, torch.Tensor) and v.ndim]
        return adam + [m.momentum for m in self.muon]

    def gather_moments(self) -> Moments:
        """Collective over each buffer's replicas."""
        moments = self.empty_moments()
        for buffer, whole in zip(self.buffers, moments.states):
            parts = self._states(buffer)
            for kind, flat in whole.items():
                if parts:
                    buffer.replica.all_gather_into(flat, parts[kind])
            state = self.adam.state.get(buffer.part)
            if state:
                moments.step = int(state["step"].item())
        return moments

    def empty_moments(self) -> Moments:
        kinds = [("momentum_buffer",) if self._muon_of(b) else ADAM_STATES
                 for b in self.buffers]
        return Moments(0, [{k: torch.zeros_like(b.params) for k in ks}
                           for b, ks in zip(self.buffers, kinds)])

    def moment_views(self, moments: Moments) -> dict[str, dict[str, torch.Tensor]]:
        """Parameter name -> {state name: view shaped like the local parameter}."""
        views = {}
        for buffer, whole in zip(self.buffers, moments.states):
            for name, offset, shape in buffer.slots:
                n = shape.numel()
                views[name] = {k: flat[offset:offset + n].view(shape)
                               for k, flat in whole.items()}
        return views

    def load_moments(self, moments: Moments) -> None:
        for buffer, whole in zip(self.buffers, moments.states):
            muon = self._muon_of(buffer)
            if muon is not None:
                muon.momentum.copy_(buffer.part_of(whole["momentum_buffer"]))
            elif moments.step == 0:
                self.adam.state.pop(buffer.part, None)
            else:
                self.adam.state[buffer.part] = {
                    "step": torch.tensor(float(moments.step)),
                    **{k: buffer.part_of(whole[k]).clone() for k in ADAM_STATES}}


@dataclass
class Moments:
    """The optimizer's state as whole flat buffers (per FlatBuffer: state name -> tensor), and
    AdamW's step count."""

    step: int
    states: list[dict[str, torch.Tensor]]


@dataclass(frozen=True)
class MuonChoice:
    """Which parameters Muon takes (single-device names), and each one's row blocks
    (trainer.plan.muon.row_splits)."""

    names: frozenset[str]
    blocks_of: Callable[[str], tuple[int, ...]]


@dataclass
class MuonBuffer:
    """A Muon flat buffer, its exchange, its part's scale runs and its momentum (the part's)."""

    buffer: FlatBuffer
    exchange: MuonExchange
    runs: list[tuple[int, int, float]]
    momentum: torch.Tensor

    def step(self, lr: float, weight_decay: float, momentum: float, nesterov: bool) -> None:
        """torch.optim.Muon's update of this rank's part, each matrix orthogonalised whole."""
        buffer, grad = self.buffer, self.buffer.part.grad  # a view into buffer.grads
        self.momentum.lerp_(grad, 1 - momentum)
        if nesterov:
            grad.lerp_(self.momentum, momentum)
        else:
            grad.copy_(self.momentum)
        if buffer.replica.size > 1:  # in place: this rank's part is already its slot
            buffer.replica.all_gather_into(buffer.grads, grad)
        self.exchange.orthogonalise(buffer.grads)
        update = buffer.replica.reduce_scatter(buffer.grads)  # one replica: the buffer itself
        buffer.part.mul_(1 - lr * weight_decay)
        for start, end, ratio in self.runs:
            buffer.part[start:end].add_(update[start:end], alpha=-(lr * ratio))
