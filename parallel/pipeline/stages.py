"""A pipeline stage of a single-device model: only its blocks, and views that run one chunk.

The model is cut by module name, on the meta device, before anything is allocated: a rank keeps
the blocks of its chunks (the embedding on the first stage, the final norm and head on the
last) and drops the rest, so it never holds another stage's weights. Names do not change (block
i stays `layers.i`), which is why a checkpoint written under one pipeline layout loads under any
other. The model's contract (its plan documents it): the embedding, final norm and head may be
None, and then its forward takes hidden states and returns them.

With tied embeddings the head's weight is the embedding's, on another stage. The last stage then
keeps the embedding module too, as the holder of that weight: a copy the first stage owns, whose
gradient the embedding group sums, and which the first stage's update refreshes. Multi-token
prediction (on the last stage, after the head) embeds tokens: it makes the last stage a holder
of the embedding in the same way.
"""
from __future__ import annotations

import copy

from torch import nn

from parallel.build import Pruned, StagePart
from parallel.layout.parallel_plan import ParallelPlan


def prune(model: nn.Module, plan: ParallelPlan, part: StagePart,
          ties: dict[str, str]) -> Pruned:
    """Drop, in place, every module `part` does not run (use on the meta device). `ties` maps
    a module to the owner of the weight it shares (tied embeddings: head -> embedding)."""
    keep = {str(i) for chunk in part.chunks for i in chunk}
    blocks = getattr(model, plan.blocks)
    for name in [n for n in blocks._modules if n not in keep]:
        del blocks._modules[name]
    ends = {plan.embedding: part.first, plan.final_norm: part.last, plan.head: part.last}
    if plan.mtp is not None:  # it runs after the head, and embeds: it needs the embedding
        ends[plan.mtp] = part.last
        ties = {**ties, plan.mtp: plan.embedding}
    holders = list(dict.fromkeys(owner for module, owner in ties.items()
                                 if ends.get(module, True) and not ends.get(owner, True)))
    shared = list(dict.fromkeys(f"{owner}.weight" for module, owner in ties.items()
                                if ends.get(module, True) != ends.get(owner, True)))
    for name, kept in ends.items():
        if not kept and name not in holders:
            setattr(model, name, None)
    return Pruned(holders, shared)


def shared_weights(model: nn.Module) -> dict[str, str]:
    """Module name -> the earlier module whose weight parameter it shares (tied embeddings:
    head -> embedding)."""
    owners: dict[int, str] = {}
    ties = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, nn.Parameter):
            if id(weight) in owners:
                ties[name] = owners[id(weight)]
            else:
                owners[id(weight)] = name
    return ties


def chunk_view(model: nn.Module, plan: ParallelPlan, part: StagePart, chunk: int) -> nn.Module:
    """The pruned model as chunk `chunk` runs it: the same modules (nothing copied but the
    module table), with only that chunk's blocks and ends. Its forward is the model's."""
    view = copy.copy(model)
    view._modules = dict(model._modules)
    blocks = getattr(model, plan.blocks)
    setattr(view, plan.blocks, type(blocks)(
        {str(i): blocks[str(i)] for i in part.chunks[chunk]}))
    embedding, head = part.runs(chunk)
    if not embedding and not (head and plan.mtp is not None):  # MTP embeds on the last chunk
        setattr(view, plan.embedding, None)
    if not head:
        setattr(view, plan.final_norm, None)
        setattr(view, plan.head, None)
        if plan.mtp is not None:
            setattr(view, plan.mtp, None)
    return view
