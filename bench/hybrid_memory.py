"""The memory plan where a linear block's own moments are the step's peak (the model
tests/multirank/test_step_memory.py's LINEAR_HEAVY: a full block then two Gated DeltaNet
blocks of 8 value heads, so neither the MLP's nor the head's moments outgrow theirs). For each
case, what the allocator holds at most during the micro-batches of a second step (above the
rank's state) against the plan's step transients, on one simulated rank (the method and helpers
of that test, which runs four of these cases in CI).

    python bench/hybrid_memory.py [case ...]
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "multirank")]

import test_step_memory as memory  # noqa: E402

from parallel.layout import Layout  # noqa: E402
from trainer.config import CPCommType, Precision, RecomputeGranularity  # noqa: E402
from trainer.plan.options import EngineOptions  # noqa: E402

MODEL = memory.LINEAR_HEAVY
CASES = {"one_process": (1, {}, {}), "bf16": (1, {}, dict(precision=Precision.bf16)),
         "tp2_sp": (2, memory.TP2_SP, {}),
         "cp2_p2p": (2, dict(context_parallel_size=2), {}),
         "cp2_a2a": (2, dict(context_parallel_size=2), dict(cp_comm_type=CPCommType.a2a)),
         "cp2_all_gather": (2, dict(context_parallel_size=2),
                            dict(cp_comm_type=CPCommType.all_gather)),
         "selective": (1, {}, dict(recompute_granularity=RecomputeGranularity.selective)),
         "full": (1, {}, dict(recompute_granularity=RecomputeGranularity.full)),
         "tp2_sp_bf16": (2, memory.TP2_SP, dict(precision=Precision.bf16)),
         "cp2_p2p_bf16": (2, dict(context_parallel_size=2), dict(precision=Precision.bf16)),
         "cp2_a2a_bf16": (2, dict(context_parallel_size=2),
                          dict(cp_comm_type=CPCommType.a2a, precision=Precision.bf16)),
         "selective_bf16": (1, {}, dict(recompute_granularity=RecomputeGranularity.selective,
                                        precision=Precision.bf16)),
         "full_bf16": (1, {}, dict(recompute_granularity=RecomputeGranularity.full,
                                   precision=Precision.bf16))}


def main() -> None:
    for name in sys.argv[1:] or CASES:
        world, layout_kwargs, option_kwargs = CASES[name]
        layout = Layout(world, micro_batch_size=2, seq_length=512, **layout_kwargs)
        options = EngineOptions(**option_kwargs)
        step, _ = memory.simulated(world, 0, memory.allocated_transients, layout, options, MODEL)
        planned = memory.planned(layout, options, MODEL)["transient_bytes"]
        print(f"{name}: allocator {step:,} B, planned {planned:,} B ({planned / step - 1:+.2%})",
              flush=True)


if __name__ == "__main__":
    main()
