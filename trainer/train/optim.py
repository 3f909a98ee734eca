"""AdamW with its state sharded over weight_replica (ZeRO-1 on top of the GTP weight shards).

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

import torch

from parallel.comm import Group
from parallel.layout import Layout
from parallel.parallelize import ParallelModel
from trainer.config import OptimConfig

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


class ShardedAdamW:
    def __init__(self, model: ParallelModel, cfg: OptimConfig, layout: Layout):
        groups = model.groups
        self.world, self.clip = groups.world, cfg.clip_grad
        # Four flat buffers (trainer.plan.memory: SHARDED, WHOLE, NORMS, EXPERTS): sharded
        # weights; weights every rank of a weight tile holds whole (a router), decayed too;
        # norms, whole and not decayed; experts, split over EP, decayed.
        sharded, whole, norms, experts = [], [], [], []
        for name, param in model.module.named_parameters():
            if name in model.stage_copies:  # another stage owns it (tied embeddings)
                continue
            if model.is_expert(name):
                experts.append((name, param))
            elif model.is_sharded(name):
                assert param.ndim == 2, f"{name}: a sharded weight is 2-D"
                sharded.append((name, param))
            else:
                (whole if param.ndim >= 2 else norms).append((name, param))
        # Whole tensors are on every rank of a weight tile: count them once. Each rank's part
        # of the experts' buffer is its own (other experts over EP, other parts over expert DP).
        tile_root = groups.tp.rank == 0 and groups.gtp_remat.rank == 0
        replica, expert_replica = groups.weight_replica, groups.expert_data_parallel
        self.buffers, param_groups = [], []
        # wd_mult: Megatron's multiplier of the step's weight decay (0: norms, never decayed).
        for params, wd_mult, counted, group in ((sharded, 1.0, True, replica),
                                                (whole, 1.0, tile_root, replica),
                                                (norms, 0.0, tile_root, replica),
                                                (experts, 1.0, True, expert_replica)):
            if params:
                buffer = FlatBuffer.build(params, group, layout, counted,
                                          group is expert_replica)
                self.buffers.append(buffer)
                param_groups.append({"params": [buffer.part], "wd_mult": wd_mult,
                                     "weight_decay": cfg.weight_decay * wd_mult})
        # foreach=False: the same per-tensor kernels as a plain single-process AdamW.
        self.adam = torch.optim.AdamW(param_groups, lr=0.0, betas=(cfg.beta1, cfg.beta2),
                                      eps=cfg.eps, foreach=False)

    def zero_grad(self) -> None:
        for buffer in self.buffers:
            buffer.grads.zero_()

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
            if weight_decay is not None:
                group["weight_decay"] = weight_decay * group["wd_mult"]
        self.adam.step()
        for buffer in self.buffers:  # with one replica the part is the whole buffer, in place
            if buffer.replica.size > 1:
                buffer.replica.all_gather_into(buffer.params, buffer.part.clone())

    # ------------------------------------------------------------------ checkpoint support
    # Adam moments leave and enter as whole flat buffers (every replica's part), so each
    # moment can be viewed at its parameter's local shape and saved at the parameter's offsets.

    def gather_moments(self) -> Moments:
        """Collective over each buffer's replicas."""
        moments = self.empty_moments()
        for buffer, avg, avg_sq in zip(self.buffers, moments.exp_avg, moments.exp_avg_sq):
            state = self.adam.state.get(buffer.part)
            if state:  # before the first step every moment is zero
                buffer.replica.all_gather_into(avg, state["exp_avg"])
                buffer.replica.all_gather_into(avg_sq, state["exp_avg_sq"])
                moments.step = int(state["step"].item())
        return moments

    def empty_moments(self) -> Moments:
        return Moments(0, [torch.zeros_like(b.params) for b in self.buffers],
                       [torch.zeros_like(b.params) for b in self.buffers])

    def moment_views(self, moments: Moments) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Parameter name -> (exp_avg, exp_avg_sq) views shaped like the local parameter."""
        views = {}
        for buffer, avg, avg_sq in zip(self.buffers, moments.exp_avg, moments.exp_avg_sq):
            for name, offset, shape in buffer.slots:
                n = shape.numel()
                views[name] = (avg[offset:offset + n].view(shape),
                               avg_sq[offset:offset + n].view(shape))
        return views

    def load_moments(self, moments: Moments) -> None:
        for buffer, avg, avg_sq in zip(self.buffers, moments.exp_avg, moments.exp_avg_sq):
            if moments.step == 0:
                self.adam.state.pop(buffer.part, None)
                continue
            self.adam.state[buffer.part] = {
                "step": torch.tensor(float(moments.step)),
                "exp_avg": buffer.part_of(avg).clone(),
                "exp_avg_sq": buffer.part_of(avg_sq).clone(),
            }


@dataclass
class Moments:
    """AdamW's state as whole flat buffers (one per FlatBuffer), and its step count."""

    step: int
    exp_avg: list[torch.Tensor]
    exp_avg_sq: list[torch.Tensor]
