"""A mixture of experts as plain single-device PyTorch (Megatron's routing and balance losses).

Router: each token's scores over E experts, its top-k experts and their weights, and the losses
that balance them. Experts: E gated MLPs (the dense MLP's activation) held as two 3-D weights
([E, 2F, h] and [E, h, F], the layout transformers and torchtitan use), run dropless: every
token reaches its top-k experts; the (token, expert) pairs are sorted by expert and each
projection is one grouped GEMM over them. MoE: the router, the experts and an optional shared
expert.

Like the attention, it knows nothing of ranks. Five attributes are the hooks set from outside:
    Router.token_sum     sums a tensor over every rank that holds other tokens of this
                         micro-batch (identity on one process): the balance losses and the
                         token counts are those of the whole micro-batch, whatever the layout
    Router.sequence_sum  sums a per-sequence tensor over the ranks that hold other tokens of the
                         same sequences (context parallel)
    Router.loss_scale    what the balance losses are weighted by in the step (1 / micro-batches)
    Experts.dispatch     takes the rows sorted by expert to their experts and back (expert
                         parallel: parallel.experts holds some experts on each rank and sends
                         the rows there by all-to-all); by default all are here
    Experts.lora_fn      adds each expert's LoRA update to a projection's output (peft=lora:
                         trainer.model.lora); by default nothing
What each micro-batch routed is recorded once, when its backward passes the router (a recomputed
forward records nothing): Router.records, read and cleared by the step.
"""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import ModelConfig
from trainer.model.capacity import keep_within_capacity
from trainer.model.mlp import GatedMLP, activation

Sum = Callable[[torch.Tensor], torch.Tensor]
Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (gate, up) -> hidden
GROUPED_DTYPES = (torch.float32, torch.bfloat16)  # what torch's grouped GEMM takes (else a loop)


def _unchanged(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@dataclass
class Routed:
    """What one micro-batch's forward through a router decided, as its backward records it."""

    counts: torch.Tensor  # [E] tokens routed to each expert, over the whole micro-batch
    # Tensors, read by the step when it logs (a number read here would stop the device, and
    # end a compiled graph, once a micro-batch):
    loss: torch.Tensor  # this rank's part of the balance losses (summed over ranks: the loss)
    dropped: torch.Tensor  # (token, expert) pairs beyond their expert's capacity, micro-batch's


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.experts, self.topk = cfg.num_moe_experts, cfg.moe_router_topk
        self.score_function, self.pre_softmax = (cfg.moe_router_score_function,
                                                 cfg.moe_router_pre_softmax)
        self.scaling = cfg.moe_router_topk_scaling_factor or 1.0
        self.groups, self.group_topk = cfg.moe_router_num_groups, cfg.moe_router_group_topk
        self.balancing = cfg.moe_router_load_balancing_type
        self.aux_coeff, self.z_coeff = cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff or 0.0
        self.weight = nn.Parameter(torch.empty(cfg.num_moe_experts, cfg.hidden_size))
        # gpt-oss's router bias (model.add_bias_linear): in the logits, so it both chooses and
        # weighs (unlike the expert bias below)
        self.bias = nn.Parameter(torch.empty(cfg.num_moe_experts)) if cfg.add_bias_linear \
            else None
        # DeepSeek-V3's auxiliary-loss-free bias: chooses experts, never weighs them; moved by
        # the step (trainer.train.step), saved with the weights.
        self.bias_update_rate = cfg.moe_router_bias_update_rate
        self.register_buffer("expert_bias", torch.zeros(cfg.num_moe_experts)
                             if cfg.moe_router_enable_expert_bias else None)
        # Pairs an expert may run at most of a micro-batch's tokens (None: dropless)
        self.capacity = cfg.expert_capacity
        self.dropless = cfg.moe_expert_capacity_factor is None
        self.token_sum: Sum = _unchanged
        self.sequence_sum: Sum = _unchanged
        self.loss_scale = 1.0
        self.records: list[Routed] = []
        self.key = torch.tensor(next(_ROUTER_KEYS), device="cpu")  # for _record_routing
        # the block it reports its balance as, where its name does not say (a multi-token
        # prediction depth's: after the model's blocks)
        self.block: int | None = None
        _ROUTERS[int(self.key)] = self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [b, s, h] -> (weights [b*s, k], experts [b*s, k], this rank's part of the balance
        losses, the micro-batch's tokens per expert, which pairs their experts' capacity keeps
        [b*s, k] (None: dropless), the pairs the micro-batch drops). The balance losses and
        the counts are the router's choice before any drop. The router runs in fp32 at least,
        whatever the compute dtype (Megatron's moe_router_dtype=fp32): a bf16 logit would turn
        near ties into other experts."""
        b, s, _ = x.shape
        dtype = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.reshape(b * s, -1).to(dtype), self.weight.to(dtype),
                              None if self.bias is None else self.bias.to(dtype))
        weights, experts = self._route(logits)
        counts = expert_counts(experts.reshape(-1), self.experts)
        # One collective for the micro-batch's counts and its tokens, summed over the ranks.
        totals = self.token_sum(torch.cat([counts, counts.new_tensor([b * s])]).double())
        counts, tokens = totals[:-1], totals[-1]
        loss = self._balance_loss(logits, experts, counts, tokens, b, s)
        keep, dropped = None, totals.new_zeros(())
        # dropless needs no token count on the host (reading one would end a compiled graph)
        limit = None if self.dropless else self.capacity(float(tokens))
        if limit is not None:
            keep, dropped = keep_within_capacity(weights, experts, counts, limit, self.token_sum)
        return weights, experts, loss, counts, keep, dropped

    def _route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.topk
        if self.score_function == "sigmoid":
            scores = torch.sigmoid(logits)
        elif self.pre_softmax:
            scores = torch.softmax(logits, dim=-1)
        else:  # the top-k logits' softmax; the bias (pre_softmax only) is refused at compose
            if self.groups is None:
                top, experts = torch.topk(logits, k, dim=-1)
            else:
                experts = self._within_groups(logits, k)
                top = logits.gather(-1, experts)
            return torch.softmax(top, dim=-1) * self.scaling, experts
        chooser = scores if self.expert_bias is None else scores + self.expert_bias
        experts = torch.topk(chooser, k, dim=-1).indices if self.groups is None \
            else self._within_groups(chooser, k)
        weights = scores.gather(-1, experts)
        if self.score_function == "sigmoid" and k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, experts

    @torch.no_grad()
    def _within_groups(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        """Group-limited top-k (Megatron's group_limited_topk): the experts in `groups` groups
        of consecutive experts, each group ranked by the sum of its k / group_topk best scores
        (DeepSeek-V3's 8 / 4: its two best), and the k experts chosen among the group_topk best
        groups' only. Indices only: the weights are gathered from the scores, so the gradient is
        the plain top-k's."""
        tokens = scores.shape[0]
        grouped_scores = scores.view(tokens, self.groups, -1)
        best = grouped_scores.topk(k // self.group_topk, dim=-1).values.sum(-1)  # [tokens, groups]
        kept = torch.zeros_like(best, dtype=torch.bool).scatter_(
            1, best.topk(self.group_topk, dim=-1, sorted=False).indices, True)
        masked = grouped_scores.masked_fill(~kept[..., None], float("-inf"))
        return masked.view(tokens, -1).topk(k, dim=-1).indices

    def _balance_loss(self, logits: torch.Tensor, experts: torch.Tensor, counts: torch.Tensor,
                      tokens: torch.Tensor, b: int, s: int) -> torch.Tensor:
        """This rank's part of the micro-batch's balance losses (Megatron's formulas, over the
        whole micro-batch): summed over the ranks that hold its tokens, they are the loss."""
        loss = logits.new_zeros(())
        E, k = self.experts, self.topk
        if self.balancing != "none" and self.aux_coeff:
            # The scores every expert gets, as the loss sees them: softmax, or the sigmoid's
            # normalised over the experts.
            if self.score_function == "softmax":
                probs = torch.softmax(logits, dim=-1)
            else:
                sig = torch.sigmoid(logits)
                probs = sig / (sig.sum(dim=-1, keepdim=True) + 1e-20)
            if self.balancing == "aux_loss":  # the switch loss: E * sum_i f_i * P_i
                loss = loss + (probs.sum(0) * counts.to(probs.dtype)).sum() * (
                    E * self.aux_coeff / (k * tokens * tokens)).to(probs.dtype)
            else:  # per sequence, averaged over the micro-batch's sequences
                chosen = F.one_hot(experts, E).sum(1).view(b, s, E).sum(1)  # [b, E]
                whole = self.sequence_sum(torch.cat(
                    [chosen, chosen.new_full((b, 1), s)], dim=1).double())
                seq_len = whole[0, -1]
                f = whole[:, :-1] * (E / (k * seq_len))  # [b, E]
                p = probs.view(b, s, E).sum(1) / seq_len  # this rank's part of each mean
                loss = loss + ((f.to(p.dtype) * p).sum() * (self.aux_coeff * seq_len / tokens)
                               .to(p.dtype))
        if self.z_coeff:
            z = torch.logsumexp(logits, dim=-1).square().sum()
            loss = loss + z * (self.z_coeff / tokens).to(z.dtype)
        return loss


# key -> router, for the operator that records routing (weak: a dropped model's go with it)
_ROUTERS: weakref.WeakValueDictionary[int, Router] = weakref.WeakValueDictionary()
_ROUTER_KEYS = itertools.count()


@torch.library.custom_op("gtp::record_routing", mutates_args=())
def _record_routing(grad: torch.Tensor, key: torch.Tensor, counts: torch.Tensor,
                    loss: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
    """grad, unchanged (a copy: an operator's output is its own), and the micro-batch's routing
    appended to its router's records. An operator, so that a compiled block calls it where
    appending to a list would end its graph; copies, as a compiled graph may reuse its
    inputs' memory."""
    _ROUTERS[int(key)].records.append(Routed(counts.clone(), loss.clone(), dropped.clone()))
    return grad.clone()


@_record_routing.register_fake
def _(grad, key, counts, loss, dropped):
    return torch.empty_like(grad)


class _RecordRouting(torch.autograd.Function):
    """The MoE's output, unchanged; in backward the balance losses get their gradient (their
    weight in the step, Router.loss_scale) at the router's place (Megatron's
    MoEAuxLossAutoScaler), and the micro-batch's routing is recorded, once (a recomputed
    forward's graph is never run backward)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor, router: Router,
                counts: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
        ctx.scale, ctx.loss_meta = router.loss_scale, (loss.dtype, loss.device)
        ctx.save_for_backward(router.key, counts, loss.detach(), dropped)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = _record_routing(grad, *ctx.saved_tensors)
        dtype, device = ctx.loss_meta
        return grad, torch.full((), ctx.scale, dtype=dtype, device=device), None, None, None


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig, activation_fn: Activation):
        super().__init__()
        E, f, h = cfg.num_moe_experts, cfg.expert_ffn_size, cfg.hidden_size
        self.num_experts = E
        self.gate_up = nn.Parameter(torch.empty(E, 2 * f, h))  # each expert's gate | up
        self.down = nn.Parameter(torch.empty(E, h, f))
        # Biases (model.add_bias_linear, gpt-oss's) as weights of one input column, [E, out, 1]:
        # expert and expert tensor parallel split them as they split the weights' rows.
        biased = cfg.add_bias_linear
        self.gate_up_bias = nn.Parameter(torch.empty(E, 2 * f, 1)) if biased else None
        self.down_bias = nn.Parameter(torch.empty(E, h, 1)) if biased else None
        # down_bias as run adds it to the rows: ETP splits the down projection's inputs, so
        # each ETP rank holds some of its outputs' bias and places them at their columns
        # (zeros elsewhere): summed over ETP, every bias entry is added once (parallel.experts)
        self.row_bias_fn: Sum = _unchanged
        self.activation_fn = activation_fn  # selective recompute wraps it, as the dense MLP's
        self.dispatch: Dispatch = _here  # expert parallel sends the rows to their experts' ranks
        self.lora_fn: Adapt = _not_adapted  # peft=lora adds the adapters' updates

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, h]; each token's top-k experts and their weights [N, k] -> [N, h]. keep
        [N, k]: the pairs their experts' capacity keeps (None: all); a dropped pair adds
        nothing to its token."""
        k, chosen = experts.shape[1], experts.reshape(-1)
        if keep is None:
            order = chosen.argsort(stable=True)  # (token, slot) pairs by expert
        else:
            pairs = keep.reshape(-1).nonzero().squeeze(1)
            order = pairs[chosen[pairs].argsort(stable=True)]
        counts = expert_counts(chosen[order], self.num_experts)
        tokens = order // k
        dtype = (torch.get_autocast_dtype(x.device.type)
                 if torch.is_autocast_enabled(x.device.type) else x.dtype)
        with torch.autocast(x.device.type, enabled=False):
            out = self.dispatch(x[tokens].to(dtype), counts, self.run)
            out = out * weights.reshape(-1)[order, None].to(out.dtype)
            return out.new_zeros(x.shape).index_add_(0, tokens, out)

    def run(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert (counts[e] for the e-th expert this module holds) through
        their experts: [rows, h] -> [rows, h]."""
        gate_up = self.lora_fn(self, "gate_up", rows, counts, grouped(rows, self.gate_up, counts))
        if self.gate_up_bias is not None:
            gate_up = gate_up + _per_row(self.gate_up_bias, counts, gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = self.activation_fn(gate, up)
        out = self.lora_fn(self, "down", hidden, counts, grouped(hidden, self.down, counts))
        if self.down_bias is not None:
            out = out + _per_row(self.row_bias_fn(self.down_bias), counts, out)
        return out


def _per_row(bias: torch.Tensor, counts: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Each expert's bias [E, n, 1] repeated for its rows (counts[e] of them): [rows, n]."""
    return bias.squeeze(-1).to(like.dtype).repeat_interleave(counts, dim=0,
                                                            output_size=like.shape[0])


# (rows sorted by expert, each expert's row count, Experts.run) -> the rows back, in order
Dispatch = Callable[[torch.Tensor, torch.Tensor, Callable], torch.Tensor]


# (the Experts module, its projection "gate_up" or "down", that projection's input rows sorted by
# expert, each expert's row count, its output) -> the output with LoRA's updates added
Adapt = Callable[[nn.Module, str, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _not_adapted(module: nn.Module, projection: str, rows: torch.Tensor, counts: torch.Tensor,
                 out: torch.Tensor) -> torch.Tensor:
    return out


def _here(rows: torch.Tensor, counts: torch.Tensor, run: Callable) -> torch.Tensor:
    return run(rows, counts)  # every expert on this device


def expert_counts(chosen: torch.Tensor, experts: int) -> torch.Tensor:
    """How many of `chosen` (expert indices) go to each expert: bincount's answer with a shape
    known in advance (bincount's depends on the largest index, so compiling breaks there)."""
    return chosen.new_zeros(experts).index_add_(0, chosen, torch.ones_like(chosen))


def grouped(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of x sorted by expert (counts[e] rows for expert e) times each expert's weight
    [E, out, in], transposed: one grouped GEMM, or a loop over experts where torch's grouped
    GEMM does not take the dtype (fp64)."""
    weight = weight.to(x.dtype)
    if x.dtype in GROUPED_DTYPES:
        return F.grouped_mm(x, weight.transpose(1, 2), offs=counts.cumsum(0).to(torch.int32))
    parts = x.split(counts.tolist())
    return torch.cat([part @ w.T for part, w in zip(parts, weight)])


class MoE(nn.Module):
    """The MLP of a mixture-of-experts block: x [b, s, h] -> [b, s, h]."""

    def __init__(self, cfg: ModelConfig, activation_fn: Activation, shared: nn.Module | None):
        super().__init__()
        self.router, self.experts = Router(cfg), Experts(cfg, activation_fn)
        self.shared = shared  # a dense MLP every token passes through (or None)
        # model.moe_shared_expert_gate: the shared expert's output times sigmoid(x w), one
        # scalar a token (Qwen3-Next's shared_expert_gate); whole on every rank, as the router
        self.shared_gate = nn.Linear(cfg.hidden_size, 1, bias=False) \
            if shared is not None and cfg.moe_shared_expert_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts, loss, counts, keep, dropped = self.router(x)
        out = self.experts(x.reshape(-1, x.shape[-1]), weights, experts, keep).view(x.shape)
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
        return _RecordRouting.apply(out, loss, self.router, counts, dropped)


def moe_mlp(cfg: ModelConfig, block: int = 0) -> MoE:
    """A block's mixture of experts, with its shared expert (a dense MLP of the same
    activation) where model.moe_shared_expert_intermediate_size is set."""
    shared, fn = cfg.moe_shared_expert_intermediate_size, activation(cfg)
    return MoE(cfg, fn, GatedMLP(cfg.hidden_size, shared, fn, cfg.add_bias_linear)
               if shared else None)
