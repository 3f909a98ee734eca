"""Activation recompute (Megatron's --recompute-granularity), applied from outside the model.

full: a selected block keeps only its input and runs its forward again in backward. selective:
only the plan's cheap-to-recompute hooks (the attention core, the MLP activation) do. Both
wrap attributes of existing modules, so no module or parameter name changes; nothing here
knows the model's names, which come from its plan.
"""
from __future__ import annotations

from typing import Callable

from torch import nn
from torch.utils.checkpoint import checkpoint

from parallel.layout.parallel_plan import ParallelPlan
from trainer.config import RecomputeGranularity
from trainer.plan.options import EngineOptions


def checkpointed(fn: Callable) -> Callable:
    """fn whose intermediate activations are dropped after forward and rebuilt in backward.

    Non-reentrant checkpoint: it keeps fn's inputs, replays fn under the forward's autocast
    and RNG state when backward first needs a saved tensor, and stops replaying once it has
    them all. Collectives inside fn (TP, SP, CP gathers) run again in the same order on every
    rank, because every rank walks the same graph backward."""

    def run(*args, **kwargs):
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)

    run.recomputed = fn  # what the wrapper replays (tests and a second apply look for it)
    return run


class _RecomputedCall:
    """Put in front of a block's class by recompute_block: the block's whole __call__, its
    hooks included, runs inside checkpoint."""

    def __call__(self, *args, **kwargs):
        # early_stop=False: the replay runs to its end, so the forward hooks fire after it too
        # (a weight-sharding bundle frees the weights the replay gathered there); stopping
        # early would leave the replay inside the block's last linear.
        return checkpoint(super().__call__, *args, use_reentrant=False, early_stop=False,
                          **kwargs)


_RECOMPUTED: dict[type, type] = {}  # a block class -> its recomputed subclass


def recompute_block(block: nn.Module) -> None:
    """full: the block's class becomes a subclass whose __call__ runs under checkpoint (the
    way FSDP2's fully_shard swaps classes), so no module or parameter name changes, and its
    hooks fire once around the forward and once around the replay in backward, as with
    torch's checkpoint_wrapper. Checkpointing only the instance's bound forward would replay
    it without the hooks: a ShardBundle would keep the weights its replay gathered, and the
    next step's forward would use them, from before the optimizer update."""
    cls = type(block)
    if cls not in _RECOMPUTED:
        _RECOMPUTED[cls] = type(f"Recomputed{cls.__name__}", (_RecomputedCall, cls), {})
    block.__class__ = _RECOMPUTED[cls]


def recompute_hooks(block: nn.Module, hooks: tuple[str, ...]) -> int:
    """selective: every function attribute named in `hooks` on the block's modules (after
    parallelize, so context-parallel attention is what gets wrapped). Returns how many."""
    wrapped = 0
    for module in block.modules():
        for hook in hooks:
            fn = getattr(module, hook, None)
            if fn is not None:
                setattr(module, hook, checkpointed(fn))
                wrapped += 1
    return wrapped


def apply_recompute(model: nn.Module, plan: ParallelPlan, options: EngineOptions,
                    chunks: list[range]) -> None:
    """Wrap each block that `options.recomputes` selects, in place. Call once, after
    parallelize: the wrappers must enclose the parallel layers and attention they replay.
    chunks: the blocks of each model chunk this rank runs (Layout.stage_chunks);
    recompute_num_layers counts from the start of each, as Megatron's does per stage."""
    if options.recompute_granularity is None:
        return
    blocks = model.get_submodule(plan.blocks)
    for chunk in chunks:
        for position, block_index in enumerate(chunk):
            _apply(blocks[str(block_index)], block_index, options.recomputes(position), plan)
    # Multi-token prediction's depths (on the last stage) recompute their blocks alike.
    depths = getattr(model, plan.mtp, None) if plan.mtp else None
    for d, depth in enumerate(depths.depths.values() if depths is not None else ()):
        _apply(depth.block, len(blocks) + d, options.recompute_granularity, plan)


def _apply(block: nn.Module, index: int, granularity: RecomputeGranularity | None,
           plan: ParallelPlan) -> None:
    if granularity is None:
        return
    if _already_wrapped(block, plan.recompute_hooks):
        raise RuntimeError(f"{plan.blocks}.{index}: recompute is already applied")
    if granularity is RecomputeGranularity.full:
        recompute_block(block)
    elif not recompute_hooks(block, plan.recompute_hooks):
        raise ValueError(
            f"train.recompute_granularity=selective, but block {plan.blocks}.{index} has "
            f"none of the plan's recompute_hooks {plan.recompute_hooks}. Fix: name the "
            f"model's attention and activation function attributes in its plan, or use "
            f"train.recompute_granularity=full.")


def _already_wrapped(block: nn.Module, hooks: tuple[str, ...]) -> bool:
    if isinstance(block, _RecomputedCall):
        return True
    return any(hasattr(getattr(module, hook, None), "recomputed")
               for module in block.modules() for hook in hooks)
