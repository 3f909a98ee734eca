"""parallel=auto against measurement: its compose time, its ranking of layouts against their
measured gloo step times, and its memory plan against the measured dry run of the worst rank.

- compose: `launch.py --cfg job --resolve` of a 16,384-rank world (model=llama3_1_8b and
  llama3_1_70b on dgx_h100) with parallel=auto over the same command without it.
- ranking: on 4 and 8 gloo ranks of this machine, cluster=local with figures calibrated here
  (each rank's matmul FLOP/s while every rank computes, gloo's all-gather latency and
  bandwidth), the cost model's step time of each of eight layouts of one model against its
  measured step time (median of 3 after a warm-up): Spearman's rank correlation.
- memory: the layout auto chooses for the seed's two examples and for llama3_1_8b and
  llama3_1_70b on 64- and 512-rank dgx_h100 clusters, cut to one block per model chunk, a
  sixteenth of the sequence, at most PP micro-batches and fp32 (a CPU builds and steps it),
  planned against the measured dry run of the cut's worst stage; the seed's 128-rank example
  also in bf16.

    python bench/auto.py [--record]   # --record: into bench/results.json
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests"))
from ranks import run_ranks  # noqa: E402

from parallel.layout import Layout, RankCoords  # noqa: E402
from trainer.config import ModelConfig, OptimConfig  # noqa: E402
from trainer.plan.cost import estimate  # noqa: E402
from trainer.plan.hardware import Hardware  # noqa: E402
from trainer.plan.options import EngineOptions  # noqa: E402

WORLD_16K = ["cluster=dgx_h100", "cluster.num_nodes=2048", "train.seq_length=8192",
             "train.micro_batch_size=1", "train.precision=bf16"]
MODEL = ModelConfig(name="llama", vocab_size=256, hidden_size=256, num_layers=4, num_heads=8,
                    ffn_hidden_size=704, rope_theta=10000.0, norm_eps=1e-5, init_std=0.02)
OPTIM = OptimConfig(name="adamw", weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8,
                    clip_grad=1.0)
MICRO, SEQ, GBS = 2, 256, 16
LAYOUTS = {  # world -> name -> Layout keywords
    4: {"dp4": {}, "ws2": dict(tensor_parallel_num_weight_shards=2),
        "ws4": dict(tensor_parallel_num_weight_shards=4),
        "tp2_sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
        "tp4_sp": dict(tensor_model_parallel_size=4, sequence_parallel=True),
        "cp2": dict(context_parallel_size=2), "cp4": dict(context_parallel_size=4),
        "pp2": dict(pipeline_model_parallel_size=2)},
    8: {"dp8": {}, "ws8": dict(tensor_parallel_num_weight_shards=8),
        "ws2": dict(tensor_parallel_num_weight_shards=2),
        "tp2_sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
        "tp8_sp": dict(tensor_model_parallel_size=8, sequence_parallel=True),
        "cp2": dict(context_parallel_size=2), "cp8": dict(context_parallel_size=8),
        "pp4": dict(pipeline_model_parallel_size=4)},
}
MEMORY = {  # name -> overrides (parallel=auto added)
    "seed_128rank_cp2": ["cluster=nvl72", "cluster.num_nodes=32", "model=llama3_1_8b",
                         "train.micro_batch_size=1", "train.global_batch_size=1",
                         "train.seq_length=131072", "train.precision=bf16"],
    "seed_ws64_tp2_sp": ["cluster=nvl72", "model=llama3_1_8b", "train.micro_batch_size=1",
                         "train.global_batch_size=4", "train.seq_length=32768",
                         "train.precision=bf16"],
    "llama3_1_8b_64": ["cluster=dgx_h100", "cluster.num_nodes=8", "model=llama3_1_8b",
                       "train.micro_batch_size=1", "train.global_batch_size=64",
                       "train.seq_length=8192", "train.precision=bf16"],
    "llama3_1_70b_512": ["cluster=dgx_h100", "cluster.num_nodes=64", "model=llama3_1_70b",
                         "train.micro_batch_size=1", "train.global_batch_size=256",
                         "train.seq_length=8192", "train.precision=bf16"],
}


def _wall(args: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "launch.py", *args, "--cfg", "job", "--resolve"], cwd=ROOT,
                   check=True, capture_output=True)
    return time.perf_counter() - started


def compose(repeats: int = 3) -> dict:
    out = {}
    for model in ("llama3_1_8b", "llama3_1_70b"):
        args = [*WORLD_16K, f"model={model}"]
        plain = statistics.median(_wall(args) for _ in range(repeats))
        auto = statistics.median(_wall([*args, "parallel=auto"]) for _ in range(repeats))
        out[model] = {"auto_s": round(auto, 3), "plain_s": round(plain, 3),
                      "auto_over_plain": round(auto / plain, 3)}
    return out


def _calibrate(rank: int, world: int) -> dict:
    """This rank's matmul FLOP/s while every rank computes, and gloo all-gather times."""
    a, b = torch.randn(MICRO * SEQ, MODEL.hidden_size), torch.randn(MODEL.hidden_size,
                                                                       MODEL.ffn_hidden_size)
    dist.barrier()
    started, count = time.perf_counter(), 0
    while time.perf_counter() - started < 1.0:
        a @ b
        count += 1
    flops = 2 * a.shape[0] * a.shape[1] * b.shape[1] * count / (time.perf_counter() - started)
    times = {}
    for size in (2, 1 << 20):  # floats per rank
        shard, out = torch.zeros(size // 4 or 1), torch.zeros(world * (size // 4 or 1))
        dist.barrier()
        started = time.perf_counter()
        for _ in range(20):
            dist.all_gather_single(out, shard)  # torch 2.13 deprecates all_gather_into_tensor
        times[size] = (time.perf_counter() - started) / 20
    return {"flops": flops, "small_s": times[2], "large_s": times[1 << 20]}


def local_hardware(world: int) -> tuple[Hardware, dict]:
    ranks = run_ranks(world, _calibrate, world)
    flops = statistics.median(r["flops"] for r in ranks)
    small = statistics.median(r["small_s"] for r in ranks)
    large = statistics.median(r["large_s"] for r in ranks)
    latency = small / (world - 1)
    bandwidth = (world - 1) * (1 << 20) / max(large - small, 1e-9)  # bytes each rank sends
    cores = len(os.sched_getaffinity(0))
    hw = Hardware(2.0, 0.1, flops / 1e12, flops / 1e12, 1.0, bandwidth / 1e9, bandwidth / 1e9,
                  latency * 1e6, world, ranks_per_core=max(1.0, world / cores))
    return hw, {"flops_per_rank": round(flops), "latency_us": round(latency * 1e6, 1),
                "bandwidth_gbs": round(bandwidth / 1e9, 3), "cores": cores}


def _steps(rank: int, layout: Layout, steps: int) -> list[float]:
    from trainer.train.batch import rank_micro_batches
    from trainer.train.engine import build_engine
    from trainer.train.step import train_step

    engine = build_engine(MODEL, OPTIM, 0, layout, torch.device("cpu"),
                          EngineOptions(overlap_param_gather=True, overlap_grad_reduce=True))
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, MODEL.vocab_size, (GBS, SEQ + 1), generator=gen)
    micro = rank_micro_batches(lambda idx: batch[idx], layout, rank)
    times = []
    for _ in range(steps + 1):
        dist.barrier()
        started = time.perf_counter()
        train_step(engine.model, engine.optimizer, micro, 1e-3)
        dist.barrier()
        times.append(time.perf_counter() - started)
    return times[1:]


def spearman(x: list[float], y: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        for place, i in enumerate(order):
            out[i] = place
        return out
    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def ranking(world: int, steps: int = 3) -> dict:
    hw, figures = local_hardware(world)
    options = EngineOptions(overlap_param_gather=True, overlap_grad_reduce=True)
    rows = {}
    for name, kwargs in LAYOUTS[world].items():
        layout = Layout(world, micro_batch_size=MICRO, seq_length=SEQ, global_batch_size=GBS,
                        **kwargs)
        measured = statistics.median(run_ranks(world, _steps, layout, steps)[0])
        rows[name] = {"predicted_s": round(estimate(MODEL, layout, options, hw).step_s, 4),
                      "measured_s": round(measured, 4)}
    rho = spearman([r["predicted_s"] for r in rows.values()],
                   [r["measured_s"] for r in rows.values()])
    return {"rank_correlation": round(rho, 3), "calibrated": figures, "layouts": rows}


def _override(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else \
        str(value)


def _dry_run(args: list[str], folder: str) -> dict:
    subprocess.run([sys.executable, "launch.py", *args, "dry_run=true",
                    f"hydra.run.dir={folder}"], cwd=ROOT, check=True, capture_output=True,
                   timeout=1800)
    return json.loads((Path(folder) / "layout.json").read_text())


def memory(name: str, overrides: list[str], precision: str = "fp32") -> dict:
    """The chosen layout, cut, planned against its measured dry run on the cut's worst stage.
    precision: the cut's train.precision (fp32 by default: this CPU's bf16 GEMMs run at about
    4 GFLOP/s, a tenth of fp32, and an 8B head's weight gradient alone takes minutes)."""
    from trainer.compose.runspec import settle

    from config_helpers import compose_config

    chosen = settle(compose_config(*overrides, "parallel=auto")).auto.chosen
    layout, values = chosen.layout, chosen.values
    # one block per model chunk, a sixteenth of the sequence, at most PP micro-batches a step
    # (as many as 1F1B keeps in flight on the first stage)
    per_micro = layout.micro_batch_size * layout.batch_parallel_size  # samples a micro-batch
    cut = {"model.num_layers": layout.pp_size * layout.virtual_pipeline_size,
           "train.seq_length": layout.seq_length // 16,
           "train.global_batch_size": per_micro * min(layout.num_microbatches, layout.pp_size),
           "train.precision": precision}
    args = [*overrides, *(f"{k}={_override(v)}" for k, v in {**values, **cut}.items())]
    with tempfile.TemporaryDirectory() as folder:
        stages = _dry_run(args, folder)["memory"]["per_stage"]
    worst = max(range(len(stages)), key=lambda i: stages[i]["peak_bytes"])
    rank = layout.rank(RankCoords(0, 0, 0, 0, 0, worst))
    with tempfile.TemporaryDirectory() as folder:
        record = _dry_run([*args, f"dry_run_rank={rank}"], folder)
    planned = record["memory"]["per_stage"][worst]["peak_bytes"]
    measured = record["measured"]["step_peak_bytes"]
    return {"chosen": chosen.describe(), "planned_peak_full_gib": round(
        chosen.peak_bytes / 2**30, 2), "cut": " ".join(f"{k}={v}" for k, v in cut.items()),
        "rank": rank, "stage": worst,
        "measured_over_planned": round(measured / planned, 3),
        "measured_step_peak_bytes": measured, "planned_peak_bytes": planned}


def measure(quick: bool = True) -> dict:
    out = {"compose": compose(), "ranking": {str(w): ranking(w) for w in LAYOUTS}}
    out["memory"] = {name: memory(name, o) for name, o in MEMORY.items()}
    seed = "seed_128rank_cp2"
    out["memory"][f"{seed}_bf16"] = memory(seed, MEMORY[seed], "bf16")
    return out


if __name__ == "__main__":
    # --record: also write the figures into bench/results.json (figures.auto), as bench/run.py
    # would, without running the other benchmarks.
    import datetime

    result = {"measured": datetime.date.today().isoformat(), **measure()}
    print(json.dumps(result, indent=1))
    if "--record" in sys.argv:
        path = HERE / "results.json"
        record = json.loads(path.read_text())
        record["figures"]["auto"] = result
        path.write_text(json.dumps(record, indent=1))
        print(f"wrote {path} (figures.auto)")
