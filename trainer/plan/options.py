"""EngineOptions: the config keys that change what a rank holds and how it communicates, never
what it computes (every combination trains the same model), and which weights train
(peft=lora, whose frozen weights keep less for backward). No torch: the memory plan reads them
at compose time, the engine applies them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from trainer.config import Config, CPCommType, Precision, RecomputeGranularity
from trainer.parts.lora import Adapters


@dataclass(frozen=True)
class EngineOptions:
    precision: Precision = Precision.fp32
    recompute_granularity: Optional[RecomputeGranularity] = None  # null = keep activations
    recompute_num_layers: Optional[int] = None  # the first N blocks; null = all
    grad_reduce_in_bf16: bool = False
    overlap_param_gather: bool = False
    overlap_grad_reduce: bool = False
    cp_comm_type: CPCommType = CPCommType.p2p
    pipeline_schedule: str = "1f1b"  # parallel.layout.pipeline_schedules.SCHEDULES
    compile_blocks: bool = False  # train.compile=blocks
    lora: Optional[Adapters] = None  # peft=lora's adapters (None: every weight trains)

    @classmethod
    def from_config(cls, cfg: Config) -> EngineOptions:
        train, parallel = cfg.train, cfg.parallel
        return cls(train.precision, train.recompute_granularity, train.recompute_num_layers,
                   parallel.grad_reduce_in_bf16, parallel.overlap_param_gather,
                   parallel.overlap_grad_reduce, parallel.cp_comm_type,
                   parallel.pipeline_schedule, train.compile == "blocks",
                   Adapters.of(cfg.peft))

    def recomputes(self, block: int) -> Optional[RecomputeGranularity]:
        """What block `block` (its position in its model chunk: recompute_num_layers counts
        from each chunk's first block) recomputes in backward (None: nothing)."""
        if self.recompute_num_layers is not None and block >= self.recompute_num_layers:
            return None
        return self.recompute_granularity

    def chunk_recompute(self, blocks: int) -> dict[Optional[RecomputeGranularity], int]:
        """A model chunk of `blocks` blocks, counted by what each recomputes: the one rule the
        memory plan, the fit and the cost model count with (recomputes, block by block)."""
        first = blocks if self.recompute_num_layers is None else min(blocks,
                                                                     self.recompute_num_layers)
        counts = {None: blocks - first}
        counts[self.recompute_granularity] = counts.get(self.recompute_granularity, 0) + first
        return counts
