"""A candidate layout's planned peak per rank, the same bytes as the dry run's memory plan
(trainer.report.memory, held equal by tests/unit/test_auto.py) but summed per block instead of
per parameter: the search sizes thousands of layouts, the dry run one.
"""
from __future__ import annotations

from functools import lru_cache

from parallel.layout import Layout
from parallel.pipeline.schedules import FORWARD, stage_actions
from trainer.config import ModelConfig
from trainer.model.plan import BLOCKS, EMBEDDING, HEAD
from trainer.report.activations import (
    Tokens,
    block_activation_bytes,
    compute_bytes,
    head_activation_bytes,
    step_memory,
)
from trainer.report.memory import BYTES_PER_ELEMENT, local_numel
from trainer.train.options import EngineOptions


@lru_cache(maxsize=4096)
def _alive(stage: int, pp: int, m: int, v: int) -> tuple[tuple[int, int], ...]:
    """The interleaved schedule's (micro-batch, chunk) pairs alive after each forward, as
    (all of them, those of the last chunk), keeping only pairs no other exceeds in both. The
    order of forwards does not depend on m and repeats every pp x v of them, so after the
    warm-up ((v + 1) x pp forwards at most) two periods show every count there is: 4 x pp
    micro-batches stand for any larger m."""
    total = last = 0
    seen: set[tuple[int, int]] = set()
    for action in stage_actions("interleaved_1f1b", stage, pp, min(m, 4 * pp), v):
        step = 1 if action.kind == FORWARD else -1
        total += step
        last += step if action.chunk == v - 1 else 0
        if step == 1:
            seen.add((total, last))
    return tuple(a for a in seen if not any(b != a and b[0] >= a[0] and b[1] >= a[1]
                                            for b in seen))


def kept_bytes(per_chunk: list[int], schedule: str, stage: int, layout: Layout) -> int:
    """stage_activation_bytes' peak over the schedule without walking every action, for a
    stage's chunks (equal but for the head on the last): 1f1b keeps min(PP - stage, m)
    micro-batches at most, gpipe all m."""
    pp, m, v = layout.pp_size, layout.num_microbatches, layout.virtual_pipeline_size
    if schedule == "gpipe":
        return m * per_chunk[0]
    if schedule == "1f1b":
        return min(pp - stage, m) * per_chunk[0]
    chunk, extra = per_chunk[0], per_chunk[-1] - per_chunk[0]
    assert all(b == chunk for b in per_chunk[:-1]), "a stage's chunks are equal"
    return max(total * chunk + last * extra for total, last in _alive(stage, pp, m, v))


class PeakPlanner:
    """planned_peak for one model over many layouts: the model's per-block shapes read once, and
    each layout's state per stage once for all of its options."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], m: ModelConfig):
        self.m = m
        self.block = [(n, s) for n, s in shapes.items() if n.startswith(f"{BLOCKS}.0.")]
        self.embed = shapes[f"{EMBEDDING}.weight"]
        self.head = shapes.get(f"{HEAD}.weight")

    def stages(self, layout: Layout) -> list[tuple]:
        """Per stage: (its chunks, state bytes, gathered block weights, largest, ends)."""
        p_bytes, g_bytes, o_bytes = BYTES_PER_ELEMENT
        local = [local_numel(n, s, layout) for n, s in self.block]
        block_sharded = sum(numel for numel, sharded in local if sharded)
        block_small = sum(numel for numel, sharded in local if not sharded)
        gathered = [numel * layout.gtp_remat_size for (numel, _), (_, shape) in
                    zip(local, self.block) if len(shape) == 2]
        embed = local_numel(f"{EMBEDDING}.weight", self.embed, layout)[0]
        head = local_numel(f"{HEAD}.weight", self.head, layout)[0] if self.head else 0
        pp, all_chunks = layout.pp_size, layout.pipeline_layers(self.m.num_layers)
        out = []
        for stage in range(pp):
            if 1 < stage < pp - 1:  # a middle stage is stage 1's twin
                out.append(out[1])
                continue
            first, last = stage == 0, stage == pp - 1
            chunks = all_chunks[stage::pp]
            blocks = sum(len(c) for c in chunks)
            sharded = blocks * block_sharded + (embed if first else 0) + (head if last else 0)
            small = blocks * block_small + (self.m.hidden_size if last else 0)
            copy = embed if self.m.tie_word_embeddings and pp > 1 and last else 0
            parts = sum(layout.optimizer_part(n) for n in (sharded, small) if n)
            buffers = parts * layout.num_weight_replicas
            state = (buffers + copy) * (p_bytes + g_bytes) + parts * o_bytes
            ends = ([embed * layout.gtp_remat_size] if first else []) + (
                [(head or embed) * layout.gtp_remat_size] if last else [])
            out.append((chunks, state, sum(gathered), max(gathered), max(ends, default=0)))
        return out

    def peak(self, layout: Layout, stages: list[tuple], options: EngineOptions) -> tuple[int, int]:
        """(the largest planned peak of any stage's rank in bytes, that stage)."""
        m, k, e = self.m, Tokens.of(layout), compute_bytes(options.precision)
        by_recompute: dict = {}

        def block_bytes(recompute) -> int:
            if recompute not in by_recompute:
                by_recompute[recompute] = block_activation_bytes(m, k, e, recompute,
                                                                 options.cp_comm_type)
            return by_recompute[recompute]

        worst, last_stage = (-1, 0), layout.pp_size - 1
        for stage in sorted({0, min(1, last_stage), last_stage}):  # the middle stages hold
            chunks, state, gathered, largest, ends = stages[stage]  # what stage 1 does, less
            last = stage == last_stage
            per_chunk = []
            for chunk in chunks:
                n, kept_n = len(chunk), options.recompute_num_layers
                recomputed = n if kept_n is None else min(n, kept_n)
                per_chunk.append(recomputed * block_bytes(options.recompute_granularity)
                                 + (n - recomputed) * block_bytes(None))
            if last:
                per_chunk[-1] += head_activation_bytes(m, k, e)
            kept = kept_bytes(per_chunk, options.pipeline_schedule, stage, layout)
            positions = [i for c in chunks for i in range(len(c))]
            step = step_memory(m, layout, options, positions, gathered, largest, ends, kept,
                               last, stage == 0)
            worst = max(worst, (state + step.transient_bytes, stage))
        return worst

    def state_floor(self, stages: list[tuple]) -> int:
        """The largest stage's state alone: a layout over budget here is over with any
        option."""
        return max(state for _, state, *_ in stages)


def planned_peak(shapes: dict[str, tuple[int, ...]], m: ModelConfig, layout: Layout,
                 options: EngineOptions) -> tuple[int, int]:
    """(the largest planned peak of any stage's rank in bytes, that stage)."""
    planner = PeakPlanner(shapes, m)
    return planner.peak(layout, planner.stages(layout), options)
