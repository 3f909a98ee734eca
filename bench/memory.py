"""Memory follows the layout: measured figures over the plan, each a ratio from one run.

- seed build: rank 0 of experiment=seed_128rank_cp2 (128 ranks, WS 64, SS 64, CP 2) with
  model.num_layers=2, train.seq_length=8192, built alone against a simulated world (the
  measured dry run's code): its build peak over its planned state, and its build time.
- step peak over planned peak: the measured dry run (the real CLI, dry_run_rank=0) of a
  mid-sized model under eight layouts, recompute settings and cp_comm_types.
- real ranks: 4 gloo ranks train model=small with WS 4; each rank's peak resident memory above
  its memory before the build, over the planned peak.
- bf16 gathers: the GTP_remat all-gather bytes of one step under precision=bf16 over fp32.

    python bench/memory.py
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from multiprocessing import get_context
from pathlib import Path

import torch
from omegaconf import OmegaConf

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))
from ranks import run_ranks  # noqa: E402

from parallel.layout import Layout  # noqa: E402
from trainer.config import ModelConfig, OptimConfig, Precision  # noqa: E402
from trainer.parts.assembly import parameter_shapes  # noqa: E402
from trainer.plan.memory import memory_per_stage  # noqa: E402
from trainer.plan.options import EngineOptions  # noqa: E402
from trainer.plan.stage_plan import step_per_stage  # noqa: E402

SEED = ["experiment=seed_128rank_cp2", "model.num_layers=2", "train.seq_length=8192"]
MID = ["model.hidden_size=512", "model.num_layers=4", "model.num_heads=8",
       "model.ffn_hidden_size=1376", "train.seq_length=2048", "train.micro_batch_size=2",
       "train.eval_interval=null"]
LAYOUTS = {  # name -> overrides on top of MID
    "one_rank": [],
    "tp2_sp": ["cluster.procs_per_node=2", "parallel.tensor_model_parallel_size=2",
               "parallel.sequence_parallel=true"],
    "ws4_ss4": ["cluster.procs_per_node=4", "parallel.tensor_parallel_num_weight_shards=4",
                "parallel.tensor_parallel_num_sequence_shards=4"],
    "cp4_p2p": ["cluster.procs_per_node=4", "parallel.context_parallel_size=4"],
    "cp4_all_gather": ["cluster.procs_per_node=4", "parallel.context_parallel_size=4",
                       "parallel.cp_comm_type=all_gather"],
    "cp4_a2a": ["cluster.procs_per_node=4", "parallel.context_parallel_size=4",
                "parallel.cp_comm_type=a2a"],
    "ws2_recompute_full": ["cluster.procs_per_node=2",
                           "parallel.tensor_parallel_num_weight_shards=2",
                           "train.recompute_granularity=full"],
    "recompute_selective": ["train.recompute_granularity=selective"],
}
OPTIM = OptimConfig(name="adamw", weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8,
                    clip_grad=1.0)


def _spawned(fn, *args):
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def _seed_build() -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from trainer.compose.runspec import settle
    from trainer.train.measured_rank import measure_rank

    from config_helpers import compose_config

    spec = settle(compose_config(*SEED, "dry_run=true"))
    planned = memory_per_stage(parameter_shapes(spec.config.model),
                               spec.config.model.num_layers, spec.layout)[0].total_bytes
    return {**measure_rank(spec, 0, step=False), "planned_state_bytes": planned}


def seed_build() -> dict:
    figures = _spawned(_seed_build)
    return {"build_peak_over_state": round(figures["build_peak_bytes"]
                                           / figures["planned_state_bytes"], 3),
            "build_s": figures["build_s"], **figures,
            "setup": " ".join(SEED) + " dry_run_rank=0 (build only)"}


def measured_dry_run(overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run([sys.executable, "launch.py", *overrides, "dry_run=true",
                        "dry_run_rank=0", f"hydra.run.dir={folder}"], cwd=ROOT, check=True,
                       capture_output=True, timeout=900)
        record = json.loads((Path(folder) / "layout.json").read_text())
    measured, plan = record["measured"], record["memory"]["per_stage"][0]
    # The allocator's count of the step (above the state: the larger of the micro-batches'
    # transients and the update's) beside the plan's peak; RSS is the end-to-end figure.
    allocated = measured["state_bytes"] + max(measured["step_transient_bytes"],
                                              measured["update_transient_bytes"])
    return {"allocated_peak_over_planned": round(allocated / plan["peak_bytes"], 3),
            "allocated_peak_bytes": allocated,
            "step_peak_over_planned": round(measured["step_peak_bytes"] / plan["peak_bytes"], 3),
            "step_peak_bytes": measured["step_peak_bytes"], "planned_peak_bytes":
            plan["peak_bytes"], "state_bytes": measured["state_bytes"],
            "planned_state_bytes": plan["total_bytes"]}


def small_layout() -> tuple[ModelConfig, Layout]:
    model = ModelConfig(**OmegaConf.to_container(OmegaConf.load(ROOT / "conf/model/small.yaml")))
    layout = Layout(4, micro_batch_size=8, seq_length=128, tensor_parallel_num_weight_shards=4)
    return model, replace(layout, global_batch_size=8 * layout.batch_parallel_size)


def _rank_peak(rank: int, model: ModelConfig, layout: Layout, options: EngineOptions,
               steps: int, fixed_mmap_threshold: bool) -> int:
    from trainer.train.batch import rank_micro_batches
    from trainer.train.engine import build_engine
    from trainer.train.measured_rank import PeakMemory
    from trainer.train.step import train_step

    fetch = lambda idx: torch.randint(0, model.vocab_size, (len(idx), layout.seq_length + 1))  # noqa: E731
    batches = [rank_micro_batches(fetch, layout, rank) for _ in range(steps)]
    peak = PeakMemory(torch.device("cpu"))
    if fixed_mmap_threshold:
        peak.fix_mmap_threshold()
    peak.reset()
    engine = build_engine(model, OPTIM, 0, layout, torch.device("cpu"), options)
    for micro_batches in batches:
        train_step(engine.model, engine.optimizer, micro_batches, 1e-4)
    return peak.above_baseline()


def real_ranks(steps: int) -> dict:
    """glibc's default raises its mmap threshold after each large free, so freed blocks up to
    32 MiB stay in the heap and resident; with a fixed 1 MiB threshold, resident memory follows
    the live tensors. Both are measured."""
    model, layout = small_layout()
    options = EngineOptions(overlap_param_gather=True, overlap_grad_reduce=True)
    shapes = parameter_shapes(model)
    planned = step_per_stage(shapes, model, layout, options)[0]["peak_bytes"]
    out = {}
    for name, fixed in (("glibc_default", False), ("fixed_mmap_threshold_1mib", True)):
        peaks = run_ranks(4, _rank_peak, model, layout, options, steps, fixed)
        out[name] = {"peak_rss_over_planned": round(max(peaks) / planned, 3),
                     "peak_rss_bytes": peaks}
    return {**out, "planned_peak_bytes": planned,
            "setup": f"4 gloo ranks, model=small, WS 4, micro-batch 8 x 128, {steps} steps, "
                     f"overlap on"}


def _gather_bytes(precision: Precision) -> int:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from trainer.train.batch import rank_micro_batches
    from trainer.train.engine import build_engine
    from trainer.train.step import train_step

    model, layout = small_layout()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    engine = build_engine(model, OPTIM, 0, layout, torch.device("cpu"), EngineOptions(precision))
    fetch = lambda idx: torch.randint(0, model.vocab_size, (len(idx), layout.seq_length + 1))  # noqa: E731
    engine.groups.stats.reset()
    train_step(engine.model, engine.optimizer, rank_micro_batches(fetch, layout, 0), 1e-4)
    return engine.groups.stats.bytes[("gtp_remat", "all_gather")]


def bf16_gathers() -> dict:
    fp32, bf16 = (_spawned(_gather_bytes, p) for p in (Precision.fp32, Precision.bf16))
    return {"bf16_gather_bytes_over_fp32": round(bf16 / fp32, 4), "fp32_bytes": fp32,
            "bf16_bytes": bf16, "setup": "rank 0 of 4 simulated, model=small, WS 4, one step"}


def measure(quick: bool = True) -> dict:
    return {
        "seed_build": seed_build(),
        "step_peak_vs_plan": {name: measured_dry_run(MID + extra)
                              for name, extra in LAYOUTS.items()},
        "real_ranks": real_ranks(2 if quick else 5),
        "bf16_gathers": bf16_gathers(),
    }


if __name__ == "__main__":
    print(json.dumps(measure(), indent=1))
