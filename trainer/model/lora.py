"""LoRA on the single-device model (peft=lora; what is adapted and how TP splits it:
trainer.parts.lora).

add_adapters puts a module of adapters beside each adapted projection and a forward hook on the
projection that adds them: y = W x + (alpha / r) B A dropout(x), part by part for a fused one.
The model's own code is untouched, and so are its parameters' names: a checkpoint or a Hugging
Face import of the base loads as it is. parallelize replaces the projection by its TP layer and
keeps the hook (parallel.tensor), and splits the adapters by the plan like any linear, so the
hook's input and output are the projection's local ones on every layout. The routed experts
have no module per projection: their adapters (one per expert, 3-D) sit in the Experts module,
which adds them through its lora_fn hook, and expert parallel splits them as the experts'
weights (parallel.experts). Every other parameter is frozen (freeze_base).
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from trainer.config import ModelConfig, PeftConfig
from trainer.model.moe import grouped
from trainer.parts import block_parts
from trainer.parts.assembly import kept_in_bf16
from trainer.parts.lora import ADAPTERS, adapted, is_adapter, per_expert


class LoRA(nn.Module):
    """One part's adapter: A [r, in], B [rows, r] (PEFT's lora_A, lora_B)."""

    def __init__(self, in_features: int, rows: int, rank: int):
        super().__init__()
        self.lora_A = nn.Linear(in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, rows, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lora_B(self.lora_A(x))


class ExpertFactor(nn.Module):
    """One factor of every routed expert's adapter, [E, out, in] as the experts' weights."""

    def __init__(self, experts: int, out_features: int, in_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out_features, in_features))


class ExpertLoRA(nn.Module):
    """One part's adapter on each routed expert: A [E, r, in], B [E, rows, r]; each expert's
    rows through its own, one grouped GEMM a factor."""

    def __init__(self, experts: int, in_features: int, rows: int, rank: int):
        super().__init__()
        self.lora_A = ExpertFactor(experts, rank, in_features)
        self.lora_B = ExpertFactor(experts, rows, rank)

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return grouped(grouped(rows, self.lora_A.weight, counts), self.lora_B.weight, counts)


class AddAdapters:
    """The projection's forward hook: its output plus each adapted part's update, in the
    part's place of the (maybe fused, maybe TP-local) output. A class, not a closure: it
    pickles, and compiled blocks guard on it cheaply."""

    def __init__(self, adapters: nn.ModuleDict, parts: list[str | None], shares: list[int],
                 scaling: float, dropout: float):
        # parts: per fused part, its adapter's name (None: not adapted); shares: their sizes
        self.adapters, self.parts, self.shares = adapters, parts, shares
        self.scaling, self.dropout = scaling, dropout
        self.enabled = True  # off: the base model (DPO's reference: adapters_off)

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return output
        x = args[0]
        if self.dropout and module.training:
            # native_dropout keeps a one-byte mask on every device (F.dropout on CPU keeps one
            # in x's dtype)
            x = torch.native_dropout(x, self.dropout, True)[0]
        # One input for every part's A, kept once for their backward: contiguous (SP's local
        # tokens are a strided view, which each A would copy) and, under autocast, cast once
        # (each A would cast its own copy). trainer.parts.lora.block_kept_bytes counts it.
        x = x.contiguous()
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        if len(self.parts) == 1:
            return output + self.adapters[self.parts[0]](x) * self.scaling
        total = sum(self.shares)
        widths = [output.shape[-1] * s // total for s in self.shares]
        pieces = list(output.split(widths, dim=-1))
        for i, name in enumerate(self.parts):
            if name is not None:
                pieces[i] = pieces[i] + self.adapters[name](x) * self.scaling
        return torch.cat(pieces, dim=-1)


class AddExpertAdapters:
    """The routed experts' Experts.lora_fn: a projection's output (gate_up, or down; the
    rank's experts' rows, sorted by expert) plus each adapted part's update, in the part's
    place (gate | up). Under expert tensor parallel the output is this rank's slice of each
    part and B of gate_up is split alike (A of down is split as down's input is: its partial
    updates are summed with the outputs'; parallel.experts)."""

    def __init__(self, parts: dict[str, list[str | None]], scaling: float, dropout: float):
        self.parts, self.scaling, self.dropout = parts, scaling, dropout
        self.enabled = True  # off: the base model (DPO's reference: adapters_off)

    def __call__(self, module: nn.Module, projection: str, rows: torch.Tensor,
                 counts: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        names = self.parts.get(projection)
        if not self.enabled or names is None:
            return out
        adapters = getattr(module, projection + ADAPTERS)
        if self.dropout and module.training:
            rows = torch.native_dropout(rows, self.dropout, True)[0]
        pieces = list(out.chunk(len(names), dim=-1))
        for i, name in enumerate(names):
            if name is not None:
                pieces[i] = pieces[i] + adapters[name](rows, counts) * self.scaling
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)


def add_adapters(model: nn.Module, cfg: ModelConfig, peft: PeftConfig | None) -> None:
    """peft=lora: adapters beside every adapted projection of the model's blocks, then the
    base frozen. Works on the meta device (ParallelModel.initialize fills them)."""
    if peft is None:
        return
    for index, block in model.layers.items():  # the model's blocks (not multi-token prediction's)
        chosen = adapted(cfg, peft, int(index))
        for part in block_parts(cfg, int(index)):
            if not part.lora_targets:
                continue
            slot = block.get_submodule(part.slot)
            experts: dict[str, list[str | None]] = {}
            for module, names in part.lora_targets.items():
                parts = chosen.get(f"{part.slot}.{module}")
                if not parts:
                    continue
                parent_name, _, attr = module.rpartition(".")
                parent = slot.get_submodule(parent_name) if parent_name else slot
                if per_expert(part, module):  # the routed experts' (trainer.parts.lora)
                    setattr(parent, attr + ADAPTERS, nn.ModuleDict({
                        name: ExpertLoRA(cfg.num_moe_experts, cols, rows, peft.lora_rank)
                        for name, cols, rows in parts}))
                    experts[attr] = [n if n in {p[0] for p in parts} else None for n in names]
                    parent.lora_fn = AddExpertAdapters(  # one for the module's projections
                        experts, peft.lora_alpha / peft.lora_rank, peft.lora_dropout)
                    continue
                adapters = nn.ModuleDict({name: LoRA(cols, rows, peft.lora_rank)
                                          for name, cols, rows in parts})
                setattr(parent, attr + ADAPTERS, adapters)
                getattr(parent, attr).register_forward_hook(AddAdapters(
                    adapters, [n if n in adapters else None for n in names],
                    list(part.fused(cfg).get(module, (1,))),
                    peft.lora_alpha / peft.lora_rank, peft.lora_dropout))
    freeze_base(model)


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """The base model: every adapter switched off while inside (PEFT's disable_adapter)."""
    hooks = [h for m in model.modules()
             for h in (*m._forward_hooks.values(), getattr(m, "lora_fn", None))
             if isinstance(h, (AddAdapters, AddExpertAdapters))]
    for hook in hooks:
        hook.enabled = False
    try:
        yield
    finally:
        for hook in hooks:
            hook.enabled = True


def freeze_base(model: nn.Module) -> None:
    """Adapters train, nothing else does (again after parallelize, whose layers are new
    parameters)."""
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))


def keep_base_in(model: nn.Module, dtype: torch.dtype) -> None:
    """peft.base_precision=bf16: the frozen matrices (the projections, an untied head, the
    experts) held in `dtype`, before they are filled (an fp32 base converts as it loads). The
    embedding and the norms stay fp32: the residual stream is fp32."""
    for name, param in model.named_parameters():
        if kept_in_bf16(name, tuple(param.shape)):
            param.data = torch.empty_like(param, dtype=dtype)


def adapter_std(name: str, in_features: int) -> float | None:
    """An adapter factor's initial std: B starts at zero, so training starts from the base
    model; A is drawn as any weight is, at the variance of PEFT's default (kaiming-uniform
    with a = sqrt(5): 1 / (3 in)). None: not an adapter."""
    if not is_adapter(name):
        return None
    return 0.0 if name.endswith("lora_B.weight") else 1.0 / math.sqrt(3 * in_features)
