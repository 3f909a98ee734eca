"""ParallelPlan: what parallelize does to a model, by module name. Pure data (no torch), so the
dry run's memory plan reads the same plan the engine applies; each model's room holds its own.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ParallelPlan:
    """What to do to a model, by module name; the model's own room holds its plan."""

    # module-name suffix -> ("column"|"row", fused parts' relative sizes, (1,) if not fused)
    linears: dict[str, tuple[str, tuple[int, ...]]]
    embedding: str  # the token embedding (vocab-parallel)
    head: str  # the output projection whose logits feed the vocab-parallel loss
    # The blocks, a ModuleDict keyed by block index; each block's sharded linears share one
    # bundle. A pipeline stage keeps some of them (names unchanged), and drops the embedding or
    # the final norm and head where it does not run them: the model's forward must accept those
    # as None (it then takes, or returns, hidden states).
    blocks: str
    final_norm: str  # the norm before the head (on the last pipeline stage)
    hidden_size: int  # width of the hidden states between blocks (what crosses stages)
    # Multi-token prediction's module (None: none): on the last stage, after the head, and it
    # embeds tokens: that stage holds the embedding too (a copy, as for tied embeddings).
    mtp: str | None = None
    # Function attributes of a block's modules that selective recompute wraps (Megatron's
    # selective: the attention core and the MLP activation), by attribute name.
    recompute_hooks: tuple[str, ...] = ()
    # Linears the plan keeps whole on every rank (multi-latent attention's down-projections),
    # by module-name suffix: no TP style replaces them; their gradients are summed as a norm's.
    whole_linears: tuple[str, ...] = ()
    # Function attributes (identities on one process) through which a block's modules pass a
    # tensor that every TP rank's heads read (multi-latent attention's shared rotary key): TP
    # makes it whole-sequence on each rank (gathered under SP) with its gradient summed over TP.
    tp_shared_hooks: tuple[str, ...] = ()
    # Function attributes (identities on one process) through which a block's modules pass a
    # weight with an entry per query head, whole on every rank (attention sinks): TP narrows it
    # to the rank's heads; the weight is named in head_norms, so its gradient is summed over TP.
    tp_heads_hooks: tuple[str, ...] = ()
    # Whole weights applied to each attention head (qk_layernorm's norms), by module-name
    # suffix: a TP rank forms their gradient from its own heads only, so it is summed over TP
    # with sequence parallel or without (other whole weights only with it).
    head_norms: tuple[str, ...] = ()
    # A mixture of experts' experts, by module-name suffix: each module's 3-D parameters
    # ([experts, ...]) are split over expert parallel on dim 0, and its `dispatch` hook sends
    # each row to its expert's rank and back (parallel.experts).
    experts: tuple[str, ...] = ()
    # Each expert parameter's split over expert tensor parallel, by parameter name within its
    # module: (the dim ETP splits, its fused parts' relative sizes): 1 splits each expert's
    # outputs (a column split), 2 its inputs (a row split, partial outputs summed); None keeps
    # it whole on every ETP rank (a LoRA factor beside a split one), its gradient summed over
    # ETP.
    expert_splits: dict[str, tuple[int | None, tuple[int, ...]]] = field(default_factory=dict)

    def linear_style(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(style, fused parts) of linear module `name`; ("whole", (1,)) where kept whole."""
        if any(name == w or name.endswith("." + w) for w in self.whole_linears):
            return "whole", (1,)
        return by_suffix(self.linears, name)


def by_suffix(table: dict[str, Any], name: str) -> Any:
    """The entry of `table` whose key is module `name` or a dotted suffix of it."""
    found = next((v for suffix, v in table.items()
                  if name == suffix or name.endswith("." + suffix)), None)
    if found is None:
        raise ValueError(f"{name}: a linear layer the parallelize plan does not cover; add "
                         f"it to the model's plan (linears)")
    return found
