"""What a model part is made of: one swappable piece of a block (an attention kind, an MLP
kind, a norm), described in one place for everything that reads the model without building it.
No torch: the checks, the memory plan, the FLOP count and the search read parts at compose time;
the part's single-device layer is named as "module:factory" and imported only when a model is
built (as an axis's steps are).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from trainer.config import ModelConfig

Shapes = dict[str, tuple[int, ...]]
# Our parameter name -> the Hugging Face tensors it is the row-wise concatenation of, with rows.
HfNames = dict[str, list[tuple[str, int]]]


def _none(cfg: ModelConfig) -> dict:
    return {}


def _no_rules(cfg: ModelConfig) -> None:
    return None


def _no_flops(cfg: ModelConfig, seq_length: int, window: int | None = None) -> float:
    return 0.0


def _nothing(*args) -> int:
    return 0


@dataclass(frozen=True, eq=False)  # by identity: the plan counts blocks by their parts
class Part:
    """One part of a block. Names are within its slot ("attn" or "mlp": the block's attribute
    that holds it, and so its parameters' prefix)."""

    name: str  # how the registry and a family name it
    slot: str
    # "module:factory" of its single-device layer: factory(cfg: ModelConfig) -> nn.Module.
    layer: str
    # Its parameters' shapes from the config alone, in the layer's named_parameters() order.
    shapes: Callable[[ModelConfig], Shapes]
    # Tensor parallel: module name -> "column" or "row" (column then row: one collective a
    # pair), and each fused projection's parts' relative sizes (split so each part's rows
    # stay together).
    tp_styles: dict[str, str] = field(default_factory=dict)
    fused: Callable[[ModelConfig], dict[str, tuple[int, ...]]] = _none
    whole: tuple[str, ...] = ()  # modules whose weights no TP style splits (whole on each rank)
    # Linears whose 2-D weight optim=muon leaves to AdamW: a router classifies tokens over
    # experts, it is no hidden map for Muon to orthogonalise (trainer.plan.muon).
    adamw_linears: tuple[str, ...] = ()
    # LoRA (trainer.parts.lora): module name -> the Hugging Face projection names of its fused
    # parts, in order (q_proj, k_proj, v_proj of a fused qkv); what peft.target_modules names.
    lora_targets: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Initialisation: parameters on the residual branch's output, whose std shrinks with depth
    # so the residual stream keeps its scale (the rest: init_std; 1-D ones start at one).
    residual_outputs: tuple[str, ...] = ()
    # Initial values other than those (trainer.model.init.special_values): name -> ("ones",),
    # or ("log_uniform", low, high): the log of a uniform draw per entry (Mamba's A_log).
    initial: dict[str, tuple] = field(default_factory=dict)
    # Selective recompute wraps this function attribute of the layer (the attention core, the
    # MLP's activation); context parallel replaces the attention's (what CP does for the part).
    hook: str | None = None
    # A function attribute (the identity on one process) through which the layer passes a
    # tensor every TP rank's heads read whole: TP replaces it (parallel.tensor).
    tp_shared: str | None = None
    # A function attribute (the identity on one process) through which the layer passes a
    # weight with one entry per query head, whole on every rank (attention sinks): TP narrows
    # it to the rank's heads (parallel.tensor); name it in head_norms too, so its gradient,
    # each TP rank's heads' share, is summed over TP.
    tp_heads: str | None = None
    # Whole weights applied per attention head (qk_layernorm's norms): TP sums their gradients.
    head_norms: tuple[str, ...] = ()
    # Expert parallel: modules whose 3-D parameters ([experts, ...]) split over EP on dim 0 (and
    # whose `dispatch` hook sends each row to its expert's rank), and each such parameter's
    # split over ETP: its name -> (the dim ETP splits, its fused parts' relative sizes).
    experts: tuple[str, ...] = ()
    expert_splits: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    # Its buffers (fp32, whole on every rank, saved beside the weights): every name it may
    # have, and the shapes a config gives it.
    buffer_names: tuple[str, ...] = ()
    buffers: Callable[[ModelConfig], Shapes] = _none
    # Forward FLOPs per token beyond its weights' 2*W (attention's QK^T and AV), at a sequence
    # length and the block's sliding window (None: none).
    core_flops: Callable[..., float] = _no_flops
    # Its terms of the memory plan (trainer.plan.activations; symbols there, k: a rank's
    # trainer.parts.tokens.Tokens, e: bytes of the compute dtype). kept_bytes(cfg, k, e,
    # recompute, cp_comm_type): what it keeps for its backward without full recompute;
    # backward_bytes(cfg, k, e, selective[, cp_comm_type]: an attention part's): the most its
    # backward forms beside that, the gradient entering the block included (a block's largest
    # part's); rebuild_bytes(cfg, k, e): what its forward, rebuilt under full recompute, holds
    # beyond its backward's.
    kept_bytes: Callable[..., int] = _nothing
    # lora_kept_bytes(cfg, k, e, recompute, cp_comm_type, adapted, grad_in, dropout): what it
    # keeps under peft=lora, its weights frozen (no input kept for a weight's gradient):
    # adapted, its Hugging Face projection names that have adapters; grad_in, whether its
    # input carries a gradient (a norm part: one flag per norm); dropout, whether the adapters
    # drop their input. None: kept_bytes stands for it (an upper bound). trainer.parts.lora
    # adds the adapters' own tensors.
    lora_kept_bytes: Callable[..., int] | None = None
    backward_bytes: Callable[..., int] = _nothing
    # split_bytes(cfg, k, e): what its backward holds more at its largest moment when a
    # zero-bubble schedule's I runs it (parallel.weight_grads): the inputs W needs of the
    # linears whose backward ran before that moment, which a whole backward has freed by
    # then; 0 where none outlives its use there
    split_bytes: Callable[..., int] = _nothing
    rebuild_bytes: Callable[..., int] = _nothing
    # forward_bytes(cfg, k, e, recompute, cp_comm_type: an attention part's): the most its
    # forward holds beyond what it keeps once done (negative: less); 0 where a backward
    # moment always outgrows it
    forward_bytes: Callable[..., int] = _nothing
    # Its Hugging Face names: hf_names(cfg, ours, theirs, family) for one block at prefixes
    # `ours` ("layers.3.") and `theirs` ("model.layers.3.").
    hf_names: Callable[[ModelConfig, str, str, Any], HfNames] = \
        lambda cfg, ours, theirs, family: {}
    # Its compose-time rules: a ValueError naming the key, the value and the fix.
    rules: Callable[[ModelConfig], None] = _no_rules
    # An attention part's widths as context parallel exchanges them: (q's, k's or v's), all of
    # a rank's heads before TP (trainer.plan.axis_costs.context); None for other parts.
    exchanged_widths: Callable[[ModelConfig], tuple[int, int]] | None = None

    def prefixed(self, names) -> tuple[str, ...]:
        return tuple(f"{self.slot}.{n}" for n in names)

    def slot_shapes(self, cfg: ModelConfig) -> Shapes:
        """Its parameter shapes by name within the block."""
        return {f"{self.slot}.{n}": shape for n, shape in self.shapes(cfg).items()}

    def slot_buffers(self, cfg: ModelConfig) -> Shapes:
        """Its buffers' shapes by name within the block."""
        return {f"{self.slot}.{n}": shape for n, shape in self.buffers(cfg).items()}
