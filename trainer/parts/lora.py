"""LoRA's adapters from the config alone (no torch): which projections peft.target_modules
adapts, the adapters' names and shapes, how tensor parallel splits them, their terms of the
memory plan and the FLOP count (a frozen base keeps less: block_kept_bytes), and the
compose-time rules. trainer.model.lora builds them; parallel/ splits them by the plan entries
written here.

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

A mixture of experts' routed experts take one adapter per expert, as Hugging Face PEFT reads
gate_proj, up_proj and down_proj on such a model (transformers' fused experts; its shared
expert takes none): `mlp.experts.gate_up_lora.gate_proj.lora_A.weight` [E, r, h] and
`...lora_B.weight` [E, F, r], each expert's factors in its row of dim 0, 3-D like the experts'
weights and split over expert parallel as they are (parallel.experts); each expert's rows pass
through its own A and B as one grouped GEMM each. Expert tensor parallel splits the factor on
its projection's split side (B of gate|up by rows, A of down by columns) and keeps the other
whole on every ETP rank, its gradient summed over ETP (expert_splits).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

from trainer.config import CPCommType, ModelConfig, PeftConfig, Precision, RecomputeGranularity
from trainer.parts import PARTS, BlockParts, block_parts
from trainer.parts.tokens import FP32, Tokens

ADAPTERS = "_lora"  # `attn.qkv` -> `attn.qkv_lora`
FACTORS = ("lora_A", "lora_B")


def part_targets(cfg: ModelConfig, part: Any) -> dict[str, tuple[str, ...]]:
    """The projections `part` has in this model that LoRA can adapt (Part.lora_targets less
    those the config leaves out)."""
    shapes = part.shapes(cfg)
    return {m: names for m, names in part.lora_targets.items() if _weight(part, m) in shapes}


def per_expert(part: Any, module: str) -> bool:
    """Whether projection `module` of `part` (`experts.gate_up`) is the routed experts' 3-D
    weight: its adapters are one per expert, split over expert parallel (no TP style)."""
    return module.split(".")[0] in part.experts


def _weight(part: Any, module: str) -> str:
    """A projection's weight by name within its part: `qkv` -> `qkv.weight`; the routed
    experts' are 3-D parameters of their own name (`experts.gate_up`)."""
    return module if per_expert(part, module) else f"{module}.weight"


def is_expert_projection(module: str) -> bool:
    """Whether `module` (within a block: `mlp.experts.gate_up`) is the routed experts'."""
    return any(module == f"{part.slot}.{m}" and per_expert(part, m)
               for part in PARTS for m in part.lora_targets)


def targets(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Module name within a block -> the Hugging Face names of its parts, for every projection
    the model's blocks have that LoRA can adapt."""
    out: dict[str, tuple[str, ...]] = {}
    for block in range(cfg.num_layers):
        for part in block_parts(cfg, block):
            out |= {f"{part.slot}.{m}": names for m, names in part_targets(cfg, part).items()}
    return out


def plan_entries() -> tuple[dict[str, tuple[str, tuple[int, ...]]], tuple[str, ...]]:
    """The parallelize plan's entries for every adapter any part may have: (split factors by
    module-name suffix -> (style, (1,)), whole factors' suffixes)."""
    split: dict[str, tuple[str, tuple[int, ...]]] = {}
    whole: list[str] = []
    for part in PARTS:
        for module, names in part.lora_targets.items():
            if per_expert(part, module):  # split over EP instead
                continue
            column = part.tp_styles[module] == "column"
            for name in names:
                a, b = (f"{part.slot}.{module}{ADAPTERS}.{name}.{f}" for f in FACTORS)
                split[b if column else a] = ("column" if column else "row", (1,))
                whole.append(a if column else b)
    return split, tuple(whole)


@cache
def expert_splits() -> dict[str, tuple[int | None, tuple[int, ...]]]:
    """The routed experts' adapter factors by name within their Experts module
    (`gate_up_lora.gate_proj.lora_A.weight`) -> how expert tensor parallel splits them
    (ParallelPlan.expert_splits; None: whole on every ETP rank, its gradient summed over
    ETP): as the projection's weight for the factor on its split side (B of gate_up, split by
    rows; A of down, by columns), the other whole."""
    out: dict[str, tuple[int | None, tuple[int, ...]]] = {}
    for part in PARTS:
        for module, names in part.lora_targets.items():
            if not per_expert(part, module):
                continue
            weight = module.partition(".")[2]
            rows_split = part.expert_splits[weight][0] == 1
            for name in names:
                a, b = (f"{weight}{ADAPTERS}.{name}.{f}.weight" for f in FACTORS)
                out[a], out[b] = (None, (1,)) if rows_split else (2, (1,)), \
                    (1, (1,)) if rows_split else (None, (1,))
    return out


def whole_over_etp(name: str) -> bool:
    """Whether 3-D parameter `name` is a routed expert's LoRA factor every ETP rank holds
    whole (expert_splits: split over EP only)."""
    return expert_splits().get(".".join(name.split(".")[-4:]), (0,))[0] is None


def projections(cfg: ModelConfig, block: int) -> dict[str, list[tuple[str, int, int]]]:
    """Module name within block `block` -> (Hugging Face name, in features, the part's rows)
    of each fused part of every projection LoRA can adapt, in the fused order (each expert's,
    for the routed experts)."""
    out: dict[str, list[tuple[str, int, int]]] = {}
    for part in block_parts(cfg, block):
        shapes, fused = part.shapes(cfg), part.fused(cfg)
        for module, names in part_targets(cfg, part).items():
            rows, cols = shapes[_weight(part, module)][-2:]
            sizes = fused.get(module, (1,))
            out[f"{part.slot}.{module}"] = [(n, cols, rows * s // sum(sizes))
                                            for n, s in zip(names, sizes)]
    return out


def adapted(cfg: ModelConfig, peft: PeftConfig, block: int | None = None
            ) -> dict[str, list[tuple[str, int, int]]]:
    """Module name within a block -> (Hugging Face name, in features, the part's rows) of each
    part peft.target_modules adapts: block `block`'s, or (None) any block's."""
    wanted = set(peft.target_modules)
    out: dict[str, list[tuple[str, int, int]]] = {}
    for i in range(cfg.num_layers) if block is None else (block,):
        for module, parts in projections(cfg, i).items():
            chosen = [p for p in parts if p[0] in wanted]
            if chosen:
                out.setdefault(module, chosen)
    return out


def adapter_elements(cfg: ModelConfig, lora: Adapters) -> float:
    """The adapters' weight elements a token multiplies by in a block (r x (in + rows) each;
    a routed expert's, moe_router_topk times: each token runs that many experts), averaged over
    the blocks: the FLOP count's (trainer.plan.cost.TokenFlops)."""
    return sum(lora.rank * (cols + rows) * (cfg.moe_router_topk if is_expert_projection(module)
                                            else 1)
               for block in range(cfg.num_layers)
               for module, parts in projections(cfg, block).items()
               for name, cols, rows in parts if name in lora.targets) / max(cfg.num_layers, 1)


def block_lora_shapes(cfg: ModelConfig, peft: PeftConfig, block: int
                      ) -> dict[str, tuple[int, ...]]:
    """Block `block`'s adapter parameters' single-device shapes, by name within the block
    (the routed experts': one per expert, [E, ...])."""
    out = {}
    for module, parts in adapted(cfg, peft, block).items():
        each = (cfg.num_moe_experts,) if is_expert_projection(module) else ()
        for name, cols, rows in parts:
            out[f"{module}{ADAPTERS}.{name}.lora_A.weight"] = (*each, peft.lora_rank, cols)
            out[f"{module}{ADAPTERS}.{name}.lora_B.weight"] = (*each, rows, peft.lora_rank)
    return out


@dataclass(frozen=True)
class Adapters:
    """What the memory plan asks of peft=lora (trainer.plan.options.EngineOptions.lora)."""

    rank: int
    targets: frozenset[str]  # Hugging Face projection names (peft.target_modules)
    dropout: float
    base_bf16: bool = False  # peft.base_precision=bf16

    @classmethod
    def of(cls, peft: PeftConfig | None) -> Adapters | None:
        if peft is None:
            return None
        return cls(peft.lora_rank, frozenset(peft.target_modules), peft.lora_dropout,
                   Precision(peft.base_precision) is Precision.bf16)


def block_kept_bytes(cfg: ModelConfig, parts: BlockParts, k: Tokens, e: int,
                     recompute: RecomputeGranularity | None, cp_comm_type: CPCommType,
                     lora: Adapters, grad_in: bool) -> int:
    """What a block keeps for its backward under peft=lora (without full recompute; k: the
    rank's local sizes; grad_in: whether its input carries a gradient, not so
    in the model's first block, fed by the frozen embedding). Its parts' terms with their
    weights frozen (Part.lora_kept_bytes; a part without one counts as fully trained: an upper
    bound), and each adapter's own: B's input, A's r-wide output, T*r*e for a column
    projection (gathered along the sequence under SP) or Tr*r*e for a row one (reduce-
    scattered), and with dropout its mask (a byte an element of the projection's local input,
    where that carries a gradient)."""
    own = {part.name: lora.targets & {n for names in part_targets(cfg, part).values()
                                      for n in names}
           for part in (parts.attention, parts.mlp)}
    attention_out = grad_in or bool(own[parts.attention.name])
    mlp_out = attention_out or bool(own[parts.mlp.name])
    norm_grads = (grad_in, attention_out) + ((attention_out, mlp_out) if cfg.sandwich_norm else ())
    total = parts.norm.lora_kept_bytes(cfg, k, e, recompute, cp_comm_type, frozenset(),
                                       norm_grads)
    for part, part_in in ((parts.attention, grad_in), (parts.mlp, attention_out)):
        if part.lora_kept_bytes is None:
            total += part.kept_bytes(cfg, k, e, recompute, cp_comm_type)
        else:
            total += part.lora_kept_bytes(cfg, k, e, recompute, cp_comm_type, own[part.name],
                                          part_in, lora.dropout > 0)
        shapes, grad = part.shapes(cfg), part_in
        for module, names in part_targets(cfg, part).items():  # a row one reads a column's
            count = len(lora.targets & set(names))
            if per_expert(part, module):
                total += _expert_kept_bytes(cfg, part, module, count, k, e, lora)
                continue
            if not count:
                continue
            cols = shapes[_weight(part, module)][-1]
            column = part.tp_styles[module] == "column"
            total += count * (k.T if column else k.Tr) * lora.rank * e
            if lora.dropout and grad:  # the mask is kept for the input's gradient only
                total += k.Tr * cols if column else k.T * cols // k.t
            grad = True
    return total


def _expert_kept_bytes(cfg: ModelConfig, part: Any, module: str, count: int, k: Tokens,
                       e: int, lora: Adapters) -> int:
    """A routed experts' projection with `count` adapted parts: each adapter's r-wide A output
    per (token, expert) pair (a rank runs as many pairs as it sends, the router balanced),
    with dropout its one-byte mask of the input, and under bf16 the casts of its factors on
    the rank (E / EP experts, split over ETP as expert_splits says). A bf16 base is cast by
    nothing: Part.kept_bytes's copy of the experts' weight is not made."""
    E, rows, cols = part.shapes(cfg)[_weight(part, module)]
    local = E // k.ep
    pairs = k.Tr * cfg.moe_router_topk
    total = count * pairs * lora.rank * e + (pairs * cols if count and lora.dropout else 0)
    if e != FP32:
        part_rows = rows // len(part.lora_targets[module])
        rows_split = part.expert_splits[module.partition(".")[2]][0] == 1
        total += count * local * lora.rank * (cols + part_rows // k.etp if rows_split
                                              else cols // k.etp + part_rows) * e
        if lora.base_bf16:
            total -= local * rows * cols // k.etp * e
    return total


def head_kept_bytes(cfg: ModelConfig, k: Tokens, e: int) -> int:
    """Under peft=lora the frozen final norm keeps no normalised input (Tr*h fp32) and the
    frozen head no input (T*h*e): what the head's terms of the plan drop."""
    return k.Tr * cfg.hidden_size * FP32 + k.T * cfg.hidden_size * e


def local_adapter_elements(cfg: ModelConfig, lora: Adapters, t: int) -> float:
    """A block's adapters' elements on a TP rank (a column projection's B and a row one's A
    split over TP, the other factor whole), averaged over the blocks: under bf16 autocast
    keeps a cast of each, and with peft.base_precision=bf16 of nothing else in a block (the
    routed experts' casts: block_kept_bytes)."""
    return sum(lora.rank * (cols + rows // t if style == "column" else cols // t + rows)
               for block in range(cfg.num_layers)
               for module, parts in projections(cfg, block).items()
               for style in (module_style(cfg, block, module),) if style is not None
               for name, cols, rows in parts if name in lora.targets) / max(cfg.num_layers, 1)


def module_style(cfg: ModelConfig, block: int, module: str) -> str | None:
    """The TP style of projection `module` ("attn.qkv") of block `block` (None: the routed
    experts', which TP does not split)."""
    slot, name = module.split(".", 1)
    part = next(p for p in block_parts(cfg, block) if p.slot == slot)
    return part.tp_styles.get(name)


def uncast_elements(cfg: ModelConfig, lora: Adapters, t: int) -> int:
    """Under bf16 autocast a frozen weight is cast at each use and the cast kept only where
    its input carries a gradient: not in the model's first block for qkv, nor for o while q,
    k and v have no adapters, nor for the MLP's while the attention has none. Their TP-local
    elements, which the plan's autocast copies drop on the first stage."""
    parts = block_parts(cfg, 0)
    shapes = {**parts.attention.shapes(cfg), **parts.mlp.shapes(cfg)}
    grad, out = False, 0
    for part in (parts.attention, parts.mlp):
        for module, names in part_targets(cfg, part).items():
            if not grad and not per_expert(part, module):  # (the experts': counted whole)
                rows, cols = shapes[f"{module}.weight"]
                out += rows * cols // t
            grad = grad or bool(lora.targets & set(names))
    return out


def is_adapter(name: str) -> bool:
    """Whether parameter `name` is an adapter's (trains under peft=lora; the rest is frozen)."""
    return f"{ADAPTERS}." in name and name.rsplit(".", 2)[-2] in FACTORS


def check_peft(model: ModelConfig, peft: PeftConfig | None, optim: Any = None,
               layout: Any = None, precision: Precision | None = None) -> None:
    """peft.*'s rules: a ValueError naming the key, the value and the fix (with the optimizer,
    the layout and train.precision: theirs too; an adapter import has none)."""
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
    if layout is not None and peft.lora_dropout and layout.etp_size > 1 and any(
            is_expert_projection(m) for m in adapted(model, peft)):
        # Every ETP peer runs the same rows through its slice of an expert: masks drawn per
        # rank would feed one whole factor different inputs.
        raise ValueError(f"peft.lora_dropout={peft.lora_dropout} with the routed experts "
                         f"adapted under expert tensor parallel (ETP {layout.etp_size}): the "
                         f"ETP ranks would drop different inputs of one expert's adapter. Fix: "
                         f"parallel.expert_tensor_parallel_size=1, or peft.lora_dropout=0.")
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
    if precision is not None and Precision(peft.base_precision) is Precision.bf16 \
            and precision is not Precision.bf16:
        raise ValueError(f"peft.base_precision=bf16 with train.precision={precision.value}: the "
                         f"frozen base in bf16 is multiplied in bf16, which train.precision=fp32 "
                         f"does not compute in. Fix: train.precision=bf16, or "
                         f"peft.base_precision=fp32.")
    if optim is not None and optim.name != "adamw":
        raise ValueError(f"peft=lora with optim={optim.name}: Muon on low-rank adapters is "
                         f"not built (their matrices are r wide). Fix: optim=adamw.")
