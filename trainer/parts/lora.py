"""LoRA's adapters from the config alone (no torch): which projections peft.target_modules
adapts, the adapters' names and shapes, how tensor parallel splits them, and the compose-time
rules. trainer.model.lora builds them; parallel/ splits them by the plan entries written here.

Names. Beside a projection `attn.qkv` its adapters live in `attn.qkv_lora`, one per Hugging Face
name of its fused parts: `attn.qkv_lora.q_proj.lora_A.weight` [r, in] and `...lora_B.weight`
[q's rows, r], PEFT's own names under the projection's. A fused projection keeps one adapter per
part (q, k and v apart, as PEFT adapts each of q_proj, k_proj, v_proj), never one across parts.

Tensor parallel splits each adapter the way its projection is split, and keeps the other factor
whole, so the only new messages are r wide:
- column projection (q|k|v, gate|up: output rows split): B is split by rows like the part's rows
  (a column layer), A is whole. A runs on the rank's tokens and its r-wide output is gathered
  along the sequence (SP) before B, as the projection's input is; A's gradient is then summed
  like a norm's.
- row projection (o, down: input columns split): A is split by columns (a row layer), its r-wide
  partial outputs summed (or reduce-scattered, SP) like the projection's, then B, whole.
Splitting B (or A) the other way would need the full-width input gathered, or the full-width
output reduced, a second time. The split factor is a ParallelLinear, so GTP_remat shards it too
and gathers it with its block's weights; the whole factor is summed over the weight tile as a
norm is.
"""
from __future__ import annotations

from typing import Any

from trainer.config import ModelConfig, PeftConfig
from trainer.parts import PARTS, block_parts

ADAPTERS = "_lora"  # `attn.qkv` -> `attn.qkv_lora`
FACTORS = ("lora_A", "lora_B")


def targets(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Module name within a block -> the Hugging Face names of its parts, for every projection
    the model's blocks have that LoRA can adapt."""
    out: dict[str, tuple[str, ...]] = {}
    for block in range(cfg.num_layers):
        for part in block_parts(cfg, block):
            out |= {f"{part.slot}.{m}": names for m, names in part.lora_targets.items()}
    return out


def plan_entries() -> tuple[dict[str, tuple[str, tuple[int, ...]]], tuple[str, ...]]:
    """The parallelize plan's entries for every adapter any part may have: (split factors by
    module-name suffix -> (style, (1,)), whole factors' suffixes)."""
    split: dict[str, tuple[str, tuple[int, ...]]] = {}
    whole: list[str] = []
    for part in PARTS:
        for module, names in part.lora_targets.items():
            column = part.tp_styles[module] == "column"
            for name in names:
                a, b = (f"{part.slot}.{module}{ADAPTERS}.{name}.{f}" for f in FACTORS)
                split[b if column else a] = ("column" if column else "row", (1,))
                whole.append(a if column else b)
    return split, tuple(whole)


def adapted(cfg: ModelConfig, peft: PeftConfig, block: int | None = None
            ) -> dict[str, list[tuple[str, int, int]]]:
    """Module name within a block -> (Hugging Face name, in features, the part's rows) of each
    part peft.target_modules adapts: block `block`'s, or (None) any block's."""
    wanted = set(peft.target_modules)
    out: dict[str, list[tuple[str, int, int]]] = {}
    for i in range(cfg.num_layers) if block is None else (block,):
        for part in block_parts(cfg, i):
            shapes, fused = part.shapes(cfg), part.fused(cfg)
            for module, names in part.lora_targets.items():
                rows, cols = shapes[f"{module}.weight"]
                sizes = fused.get(module, (1,))
                chosen = [(n, cols, rows * s // sum(sizes)) for n, s in zip(names, sizes)
                          if n in wanted]
                if chosen:
                    out.setdefault(f"{part.slot}.{module}", chosen)
    return out


def block_lora_shapes(cfg: ModelConfig, peft: PeftConfig, block: int
                      ) -> dict[str, tuple[int, ...]]:
    """Block `block`'s adapter parameters' single-device shapes, by name within the block."""
    out = {}
    for module, parts in adapted(cfg, peft, block).items():
        for name, cols, rows in parts:
            out[f"{module}{ADAPTERS}.{name}.lora_A.weight"] = (peft.lora_rank, cols)
            out[f"{module}{ADAPTERS}.{name}.lora_B.weight"] = (rows, peft.lora_rank)
    return out


def is_adapter(name: str) -> bool:
    """Whether parameter `name` is an adapter's (trains under peft=lora; the rest is frozen)."""
    return f"{ADAPTERS}." in name and name.rsplit(".", 2)[-2] in FACTORS


def check_peft(model: ModelConfig, peft: PeftConfig | None, optim: Any = None,
               layout: Any = None) -> None:
    """peft.*'s rules: a ValueError naming the key, the value and the fix (with the optimizer
    and the layout: theirs too; an adapter import has neither)."""
    if peft is None:
        return
    if layout is not None and peft.lora_dropout and layout.tp_size > 1 \
            and not layout.sequence_parallel:
        # Without SP every TP rank runs the same tokens into a column projection's whole A:
        # masks drawn per rank would give its replicas different gradients.
        raise ValueError(f"peft.lora_dropout={peft.lora_dropout} under tensor parallel without "
                         f"sequence parallel: the TP ranks would drop different inputs of one "
                         f"replicated adapter. Fix: parallel.sequence_parallel=true, or "
                         f"peft.lora_dropout=0.")
    if peft.name != "lora":
        raise ValueError(f"peft.name={peft.name!r} is not a method this trainer has. Fix: "
                         f"peft=lora, or peft=null for full fine-tuning.")
    known = targets(model)
    names = sorted({n for parts in known.values() for n in parts})
    for name in peft.target_modules:
        if name not in names:
            have = ", ".join(names) or "none (its attention and MLP parts take no adapters yet)"
            raise ValueError(f"peft.target_modules: {name!r} is no projection of this model "
                             f"(model.name={model.name}) that LoRA adapts; it has {have}. Fix: "
                             f"name some of those.")
    if not peft.target_modules:
        raise ValueError("peft.target_modules is empty: nothing would train. Fix: name the "
                         "projections to adapt, e.g. [q_proj, v_proj].")
    if peft.lora_alpha <= 0:
        raise ValueError(f"peft.lora_alpha={peft.lora_alpha} must be > 0 (the update is scaled "
                         f"by lora_alpha / lora_rank). Fix: e.g. twice peft.lora_rank.")
    if not 0.0 <= peft.lora_dropout < 1.0:
        raise ValueError(f"peft.lora_dropout={peft.lora_dropout} is not in [0, 1). Fix: e.g. "
                         f"0.05, or 0.0 for none.")
    smallest = min(min(cols, rows) for parts in adapted(model, peft).values()
                   for _, cols, rows in parts)
    if not 1 <= peft.lora_rank <= smallest:
        raise ValueError(f"peft.lora_rank={peft.lora_rank} must be in [1, {smallest}] (the "
                         f"smallest side of an adapted projection): a larger one adds nothing "
                         f"a full update lacks. Fix: e.g. peft.lora_rank=16.")
    if optim is not None and optim.name != "adamw":
        raise ValueError(f"peft=lora with optim={optim.name}: Muon on low-rank adapters is "
                         f"not built (their matrices are r wide). Fix: optim=adamw.")
