"""QK-clip (Kimi K2's MuonClip; Megatron's qk_clip): after each update, the query and key
projections of the attention heads whose largest logit in the step passed
optim.qk_clip_threshold are scaled down, so the next step's logits stay near it.

Each attention module records, through its attention_fn, the largest scaled logit q.k each of
this rank's query heads met over the pairs it attended (parallel.context.kernels.record_logits:
its CP chunks, its documents, its window). After the update the records are maxed over the
ranks that saw other tokens of the same heads (token_distinct: sequence shards, batch lanes, CP,
DP) and gathered over TP (each TP rank holds other heads). For each clip group g (a query group
under grouped-query attention, a head under multi-latent attention), eta = min(1, threshold /
max logit of g), and (alpha = optim.qk_clip_alpha):

    grouped-query attention  q rows of g's heads x eta^alpha, k rows of g x eta^(1 - alpha)
    multi-latent attention   q's non-rotary rows x eta^alpha, k's (kv_up) x eta^(1 - alpha),
                             q's rotary rows x eta (the rotary key is shared by every head)

so every logit of g is scaled by eta (RoPE is linear in q and k). Every rank scales the rows
it holds of the full weights (its TP and GTP_remat pieces, replicas alike), and a q/k/v bias's
rows with them; the optimizer's state is left as it is, as Megatron and Kimi do.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from parallel.parallelize import ParallelModel
from trainer.config import ModelConfig

Rows = list[tuple[int, int, int, str]]  # (first row, end, clip group, kind) of a weight


def attention_rows(cfg: ModelConfig, mla: bool) -> dict[str, Rows]:
    """The rows QK-clip scales, by parameter name within an attention module: kind q (x
    eta^alpha), k (x eta^(1 - alpha)) or q_rope (x eta), each with its clip group."""
    heads = cfg.num_heads
    if mla:
        nope, rope, v = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        q = "q.weight" if cfg.q_lora_rank is None else "q_up.weight"
        q_rows = [r for h in range(heads) for r in ((h * (nope + rope), h * (nope + rope) + nope,
                                                     h, "q"),
                                                    (h * (nope + rope) + nope,
                                                     (h + 1) * (nope + rope), h, "q_rope"))]
        return {q: q_rows, "kv_up.weight": [(h * (nope + v), h * (nope + v) + nope, h, "k")
                                            for h in range(heads)]}
    d, groups = cfg.head_dim, cfg.num_query_groups or heads
    per_group = heads // groups
    step, q = (2 * d, cfg.q_proj_size)  # with attention_output_gate: each query, then its gate
    step = step if cfg.attention_output_gate else d
    rows = [(h * step, h * step + d, h // per_group, "q") for h in range(heads)]
    rows += [(q + g * d, q + (g + 1) * d, g, "k") for g in range(groups)]
    out = {"qkv.weight": rows}
    if cfg.add_bias_linear or cfg.add_qkv_bias:
        out["qkv.bias"] = rows
    return out


class QkClip:
    """Every attention module's record and its rows; clip() after each update."""

    def __init__(self, model: ParallelModel, cfg: ModelConfig, threshold: float, alpha: float):
        self.model, self.threshold, self.alpha = model, threshold, alpha
        groups = model.groups
        self.token_distinct, self.tp, self.pp = groups.token_distinct, groups.tp, groups.pp
        local_heads = cfg.num_heads // groups.tp.size
        self.targets = []  # (module name, module, its rows, clip groups)
        for name, module in model.module.named_modules():
            if not hasattr(module, "max_logits"):
                continue
            mla = hasattr(module, "kv_up")
            device = next(module.parameters()).device
            module.max_logits = torch.full((local_heads,), -math.inf, device=device)
            clip_groups = cfg.num_heads if mla else (cfg.num_query_groups or cfg.num_heads)
            self.targets.append((name, module, attention_rows(cfg, mla), clip_groups))

    def reset(self) -> None:
        """Before a step's first forward (an evaluation's forwards between steps record too)."""
        for _, module, _, _ in self.targets:
            module.max_logits.fill_(-math.inf)

    @torch.no_grad()
    def clip(self) -> float:
        """Scale the heads over the threshold (collective over token_distinct, TP and PP);
        the largest logit of the step, over every stage (what metrics.jsonl logs)."""
        largest = -math.inf
        if self.targets:  # every layer's record in one collective of each group
            records = torch.stack([module.max_logits for _, module, _, _ in self.targets])
            records = self.token_distinct.all_reduce(records, dist.ReduceOp.MAX)
            # [TP ranks, layers, local heads] -> per layer, TP rank r's heads r * local onwards
            gathered = self.tp.all_gather(records).view(self.tp.size, *records.shape)
            per_layer = gathered.permute(1, 0, 2).flatten(1)
            largest = per_layer.max().item()
            for (name, _, rows, clip_groups), per_head in zip(self.targets, per_layer):
                group_max = per_head.view(clip_groups, -1).amax(1)
                # only a group over the threshold is scaled (a maximum <= 0, or a record left
                # at -inf by a stage without tokens, is no reason to)
                eta = torch.where(group_max > self.threshold, self.threshold / group_max, 1.0)
                if bool((eta < 1).any()):
                    self._scale(name, rows, eta.double().tolist())
        overall = torch.tensor([largest], dtype=torch.float64)
        return self.pp.all_reduce(overall, dist.ReduceOp.MAX).item()

    def _scale(self, module: str, rows: dict[str, Rows], eta: list[float]) -> None:
        powers = {"q": self.alpha, "k": 1.0 - self.alpha, "q_rope": 1.0}
        for leaf, segments in rows.items():
            name = f"{module}.{leaf}"
            param = self.model.module.get_parameter(name)
            for offsets, view in self.model.global_chunks(name, param.data):
                first, end = offsets[0], offsets[0] + view.shape[0]
                for start, stop, group, kind in segments:
                    lo, hi = max(start, first), min(stop, end)
                    if lo < hi and eta[group] < 1.0:
                        view[lo - first:hi - first].mul_(eta[group] ** powers[kind])
